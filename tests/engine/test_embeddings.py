"""Embedding requests: the pooled, normalized final hidden states transformers computes."""

from __future__ import annotations

import pytest
import torch

from pagefleet.engine import LLM, SamplingParams
from tests.conftest import _hf_model, prompt_ids


def hf_embedding(path: str, ids: list[int], pooling: str) -> torch.Tensor:
    """Transformers' last hidden state (after the final norm), pooled and L2-normalized."""
    with torch.inference_mode():
        out = _hf_model(path)(torch.tensor([ids]), output_hidden_states=True)
    states = out.hidden_states[-1][0].float()
    vec = states[-1] if pooling == "last" else states.mean(dim=0)
    return torch.nn.functional.normalize(vec, dim=0)


@pytest.mark.parametrize("pooling", ["last", "mean"])
@pytest.mark.parametrize("batched_tokens", [None, 7])
def test_embed_matches_transformers(
    llama_dir: str, pooling: str, batched_tokens: int | None
) -> None:
    prompts = prompt_ids(llama_dir)[:6]
    llm = LLM(
        model=llama_dir, num_kv_blocks=64, pooling=pooling, max_num_batched_tokens=batched_tokens
    )
    embed = SamplingParams(embed=True)
    greedy = SamplingParams(temperature=0, max_tokens=4)
    # Embedding and generation requests share steps; each gets its own kind of output.
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], [embed, greedy] * 3, use_tqdm=False
    )
    for i, (ids, out) in enumerate(zip(prompts, outs, strict=True)):
        if i % 2:
            assert out.embedding is None and len(out.outputs[0].token_ids) == 4
            continue
        assert out.finished and out.outputs[0].token_ids == []
        assert out.outputs[0].finish_reason == "stop"
        got = torch.tensor(out.embedding)
        assert got.shape == (llm.engine.config.hf_config()["hidden_size"],)
        torch.testing.assert_close(got, hf_embedding(llama_dir, ids, pooling), atol=1e-5, rtol=1e-4)
        assert abs(got.norm().item() - 1.0) < 1e-5
    llm.check_block_accounting()
    assert llm.stats().num_free_blocks == llm.stats().num_total_blocks


def test_embed_refuses_samples() -> None:
    with pytest.raises(ValueError, match="one sample"):
        SamplingParams(embed=True, n=2)


def test_two_ranks_pool_on_rank_zero(llama_dir: str) -> None:
    prompts = prompt_ids(llama_dir)[:3]
    with LLM(model=llama_dir, tensor_parallel_size=2, num_kv_blocks=64, pooling="mean") as llm:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], SamplingParams(embed=True), use_tqdm=False
        )
        for ids, out in zip(prompts, outs, strict=True):
            want = hf_embedding(llama_dir, ids, "mean")
            torch.testing.assert_close(torch.tensor(out.embedding), want, atol=1e-5, rtol=1e-4)
        llm.check_block_accounting()


def test_mean_survives_preemption(llama_dir: str) -> None:
    """A prefill preempted part-way restarts from token 0, and so does its sum. (In this
    order the two generating requests' growth preempts the embedding requests' prefills
    part-way: 8 and 5 of 13 tokens computed.)"""
    prompts = [p for p in prompt_ids(llama_dir) if 9 < len(p) <= 16][:4]
    llm = LLM(
        model=llama_dir, num_kv_blocks=8, block_size=4, max_num_batched_tokens=6, pooling="mean"
    )
    greedy = SamplingParams(temperature=0, max_tokens=12)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        [greedy, greedy, SamplingParams(embed=True), SamplingParams(embed=True)],
        use_tqdm=False,
    )
    assert llm.stats().num_preemptions >= 2
    for i in (2, 3):
        want = hf_embedding(llama_dir, prompts[i], "mean")
        torch.testing.assert_close(torch.tensor(outs[i].embedding), want, atol=1e-5, rtol=1e-4)
    llm.check_block_accounting()
