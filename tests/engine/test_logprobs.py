"""Logprobs and prompt logprobs equal transformers' log-softmax of the raw logits."""

from __future__ import annotations

import torch

from pagefleet.engine import LLM, SamplingParams
from tests.conftest import _hf_model, prompt_ids


def test_logprobs_match_transformers(qwen2_dir: str) -> None:
    prompts = prompt_ids(qwen2_dir)[:5]
    llm = LLM(model=qwen2_dir, num_kv_blocks=64)
    k = 5
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=8, logprobs=k, prompt_logprobs=k),
        use_tqdm=False,
    )
    hf = _hf_model(qwen2_dir)
    for ids, out in zip(prompts, outs, strict=True):
        comp = out.outputs[0]
        with torch.inference_mode():
            gen = hf.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=8,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
        assert gen.sequences[0, len(ids) :].tolist() == comp.token_ids
        assert comp.logprobs is not None and len(comp.logprobs) == len(comp.token_ids)
        total = 0.0
        for step, (token, entry) in enumerate(zip(comp.token_ids, comp.logprobs, strict=True)):
            ref = gen.logits[step][0].float().log_softmax(-1)
            assert set(entry) == {token, *ref.topk(k).indices.tolist()}
            for t, lp in entry.items():
                assert abs(lp - ref[t].item()) < 1e-4
            total += ref[token].item()
        assert abs(comp.cumulative_logprob - total) < 1e-3
        # Prompt logprobs: position i scored by the logits at i - 1.
        with torch.inference_mode():
            logits = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(ids)
        assert out.prompt_logprobs[0] is None
        for i in range(1, len(ids)):
            entry = out.prompt_logprobs[i]
            assert ids[i] in entry
            assert set(entry) == {ids[i], *logits[i - 1].topk(k).indices.tolist()}
            for t, lp in entry.items():
                assert abs(lp - logits[i - 1, t].item()) < 1e-4
    llm.check_block_accounting()


def test_prompt_logprobs_survive_chunked_prefill(llama_dir: str) -> None:
    ids = prompt_ids(llama_dir)[12]
    p = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0)
    whole = LLM(model=llama_dir, num_kv_blocks=64).generate(
        {"prompt_token_ids": ids}, p, use_tqdm=False
    )[0]
    chunked = LLM(model=llama_dir, num_kv_blocks=64, max_num_batched_tokens=7)
    parts = chunked.generate({"prompt_token_ids": ids}, p, use_tqdm=False)[0]
    assert len(parts.prompt_logprobs) == len(ids)
    for a, b in zip(whole.prompt_logprobs[1:], parts.prompt_logprobs[1:], strict=True):
        assert a.keys() == b.keys()
        assert all(abs(a[t] - b[t]) < 1e-5 for t in a)
    chunked.check_block_accounting()
