"""Continuations (SamplingParams.output_offset): a request resubmitted as prompt + the
first k output tokens, with the same params, produces exactly the rest of the output
the uninterrupted request produced, greedy or seeded, n=1 or n=2, constrained or not."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pagefleet.engine import LLM, SamplingParams, StepFailedError, StructuredOutputsParams
from pagefleet.engine.handoffs import SampleUpdate
from pagefleet.engine.sample_state import SampleState
from pagefleet.engine.sequence import token_seed
from tests.conftest import prompt_ids, tokenizer_for

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 9999},
        "name": {"type": "string", "maxLength": 8},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 3},
    },
    "required": ["id", "name", "tags"],
    "additionalProperties": False,
}
JSON = StructuredOutputsParams(json=SCHEMA)

CASES = {
    "greedy": SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
    "seeded": SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=7, max_tokens=24),
    "seeded-min-tokens": SamplingParams(temperature=1.0, seed=11, max_tokens=20, min_tokens=12),
    "seeded-n2": SamplingParams(temperature=1.0, top_k=40, seed=3, max_tokens=20, n=2),
    "greedy-json": SamplingParams(temperature=0, max_tokens=40, structured_outputs=JSON),
    "seeded-json": SamplingParams(
        temperature=1.0, top_p=0.95, seed=5, max_tokens=40, structured_outputs=JSON
    ),
    "seeded-n2-json": SamplingParams(
        temperature=1.0, top_k=50, seed=9, max_tokens=40, n=2, structured_outputs=JSON
    ),
}


@pytest.fixture(scope="module")
def llm(llama_dir: str) -> LLM:
    return LLM(model=llama_dir, num_kv_blocks=128, max_num_seqs=8)


def _run(llm: LLM, prompt: list[int], params: SamplingParams) -> list:
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    llm.check_block_accounting()
    return out.outputs


@pytest.mark.parametrize("case", CASES)
def test_continuation_equals_uninterrupted_output(llm: LLM, llama_dir: str, case: str) -> None:
    params = CASES[case]
    prompt = prompt_ids(llama_dir)[0]
    whole = _run(llm, prompt, params)
    assert len(whole) == params.n
    for sample in whole:
        tokens = sample.token_ids
        assert len(tokens) >= 4, tokens
        for k in sorted({1, 2, len(tokens) // 2, len(tokens) - 1}):
            cont = replace(params, n=1, output_offset=k, sample_index=sample.index)
            rest = _run(llm, prompt + tokens[:k], cont)[0]
            assert tokens[:k] + rest.token_ids == tokens, (case, sample.index, k)
            assert rest.finish_reason == sample.finish_reason


def test_continuation_logprobs_are_the_uninterrupted_ones(llm: LLM, llama_dir: str) -> None:
    params = SamplingParams(temperature=1.0, seed=21, max_tokens=12, logprobs=2, ignore_eos=True)
    prompt = prompt_ids(llama_dir)[1]
    whole = _run(llm, prompt, params)[0]
    k = 5
    rest = _run(llm, prompt + whole.token_ids[:k], replace(params, output_offset=k))[0]
    assert rest.token_ids == whole.token_ids[k:]
    assert rest.logprobs is not None and whole.logprobs is not None
    for got, want in zip(rest.logprobs, whole.logprobs[k:], strict=True):
        assert got.keys() == want.keys()
        assert got == pytest.approx(want, abs=1e-4)


def test_seeded_noise_is_a_function_of_seed_sample_and_position() -> None:
    assert token_seed(7, 0, 3) == token_seed(7, 0, 3)
    seeds = {token_seed(7, s, p) for s in range(3) for p in range(50)}
    assert len(seeds) == 150 and all(0 <= x < 1 << 62 for x in seeds)
    assert token_seed(8, 0, 3) != token_seed(7, 0, 3)


def test_continuation_refused_when_its_tokens_break_the_constraint(
    llm: LLM, llama_dir: str
) -> None:
    prompt = prompt_ids(llama_dir)[0]
    not_json = llm.get_tokenizer().encode("hello", add_special_tokens=False)
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=JSON)
    cont = replace(params, output_offset=len(not_json))
    with pytest.raises(StepFailedError):
        llm.generate([{"prompt_token_ids": prompt + not_json}], cont, use_tqdm=False)
    llm.check_block_accounting()


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"output_offset": 16}, "output_offset"),
        ({"output_offset": -1}, "output_offset"),
        ({"output_offset": 2, "n": 2}, "n=1"),
    ],
)
def test_bad_continuation_params_are_refused(fields: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(max_tokens=16, **fields)


def test_offset_must_leave_a_prompt(llm: LLM) -> None:
    with pytest.raises(ValueError, match="output_offset"):
        llm.generate(
            [{"prompt_token_ids": [5, 6]}], SamplingParams(output_offset=2), use_tqdm=False
        )


def _stream(state: SampleState, tokens: list[int], finish_at_end: bool) -> str:
    """The text a client is streamed as `state` takes `tokens` one step at a time."""
    text = ""
    for i, token in enumerate(tokens):
        last = finish_at_end and i == len(tokens) - 1
        state.update(SampleUpdate(0, token, None, None, "length" if last else None, None))
        text += state.emit(0).text
        if state.finished:
            break
    return text


@pytest.mark.parametrize("k", [1, 3, 5, 8, 11])
def test_continuation_stream_continues_text_and_stop_strings(llama_dir: str, k: int) -> None:
    tokenizer = tokenizer_for(llama_dir)
    prompt = prompt_ids(llama_dir)[0]
    tokens = tokenizer.encode(" alpha beta gamma delta epsilon zeta", add_special_tokens=False)
    # A stop string that spans several tokens: held back, then cut, wherever the split falls.
    params = SamplingParams(max_tokens=len(tokens), stop=["gamma delta"])
    whole = _stream(SampleState(tokenizer, prompt, params), tokens, finish_at_end=True)
    assert whole == " alpha beta "
    before = _stream(SampleState(tokenizer, prompt, params), tokens[:k], finish_at_end=False)
    resumed = SampleState(tokenizer, prompt + tokens[:k], replace(params, output_offset=k))
    after = _stream(resumed, tokens[k:], finish_at_end=True)
    assert before + after == whole
