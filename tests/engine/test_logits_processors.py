"""vLLM's logits processors in the sampler: `allowed_token_ids`, `logit_bias` and
`bad_words`, greedy, against transformers' own processors (`prefix_allowed_tokens_fn`,
`sequence_bias`, `bad_words_ids`) on the same checkpoint."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from pagefleet.engine import LLM, SamplingParams
from tests.conftest import _hf_model, prompt_ids, tokenizer_for

ENGINE = {"num_kv_blocks": 64, "block_size": 8, "max_num_seqs": 8, "max_model_len": 128}
N = 12


@pytest.fixture(scope="module")
def llm(llama_dir: str) -> Iterator[LLM]:
    with LLM(model=llama_dir, **ENGINE) as llm:
        yield llm
        llm.check_block_accounting()


def hf(path: str, ids: list[int], **kwargs: object) -> list[int]:
    model = _hf_model(path)
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=N,
            min_new_tokens=N,
            do_sample=False,
            **kwargs,
        )
    return out[0, len(ids) :].tolist()


def greedy(llm: LLM, ids: list[int], **kwargs: object) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, **kwargs)
    return list(llm.generate([{"prompt_token_ids": ids}], params)[0].outputs[0].token_ids)


def test_allowed_token_ids_equal_transformers_prefix_allowed_tokens(
    llm: LLM, llama_dir: str
) -> None:
    ids = prompt_ids(llama_dir)[2]
    allowed = [5, 17, 300, 511, 900]
    got = greedy(llm, ids, allowed_token_ids=allowed)
    assert set(got) <= set(allowed)
    assert got == hf(llama_dir, ids, prefix_allowed_tokens_fn=lambda _b, _ids: allowed)


def test_logit_bias_equals_transformers_sequence_bias(llm: LLM, llama_dir: str) -> None:
    ids = prompt_ids(llama_dir)[4]
    plain = greedy(llm, ids)
    bias = {plain[1]: -100.0, 42: 3.5, 77: 100.0}
    got = greedy(llm, ids, logit_bias=bias)
    assert got == hf(llama_dir, ids, sequence_bias={(t,): b for t, b in bias.items()})
    assert got == [77] * N  # +100 wins every step


def test_bad_words_are_never_generated(llm: LLM, llama_dir: str) -> None:
    tok = tokenizer_for(llama_dir)
    ids = prompt_ids(llama_dir)[6]
    plain = greedy(llm, ids)
    word = tok.decode(plain[2:4]).strip()  # a word the model would write
    got = greedy(llm, ids, bad_words=[word])
    processor = llm.engine.input_processor
    banned = processor.bad_words_token_ids((word,))
    assert got != plain
    for seq in banned:
        assert all(got[i : i + len(seq)] != list(seq) for i in range(len(got)))
    assert got == hf(llama_dir, ids, bad_words_ids=[list(s) for s in banned])


def test_token_ids_outside_the_vocabulary_are_refused(llm: LLM) -> None:
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.generate(["x"], SamplingParams(allowed_token_ids=[10**6]))
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate(["x"], SamplingParams(logit_bias={10**6: 1.0}))
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: 101.0})
