"""Sampling: the batched sampler's math, and the engine's sampling behaviour end to end."""

from __future__ import annotations

import pytest
import torch

from pagefleet.engine import LLM, SamplingParams
from pagefleet.engine.sampler import Sampler, SamplingBatch, _apply_penalties
from pagefleet.engine.sequence import token_seed
from tests.conftest import PROMPT_TEXTS, eos_of

PROMPTS = ["def run(self):", "import re", "x = {", "class Node:"]


def batch(params: list[SamplingParams]) -> SamplingBatch:
    seeds = [token_seed(p.seed, 0, 0) if p.seed is not None else None for p in params]
    return SamplingBatch(params=params, seeds=seeds, banned=[])


def test_filters_that_keep_one_token_equal_argmax() -> None:
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(0))
    greedy = logits.argmax(-1).tolist()
    for p in (
        SamplingParams(temperature=1.0, top_k=1, seed=1),
        SamplingParams(temperature=1.5, top_p=1e-6, seed=2),
        SamplingParams(temperature=0.7, min_p=1.0, seed=3),
    ):
        assert Sampler(0)(logits.clone(), batch([p] * 6)).token_ids == greedy


def test_top_k_keeps_only_the_k_best() -> None:
    logits = torch.tensor([[0.0, 5.0, 4.0, 3.0, -1.0]])
    seen = {
        Sampler(s)(
            logits.clone(), batch([SamplingParams(temperature=5.0, top_k=2, seed=s)])
        ).token_ids[0]
        for s in range(60)
    }
    assert seen == {1, 2}


def test_top_p_keeps_the_smallest_prefix_reaching_p() -> None:
    # probabilities 0.5, 0.3, 0.2: top_p=0.6 keeps the first two.
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    seen = {
        Sampler(s)(logits.clone(), batch([SamplingParams(top_p=0.6, seed=s)])).token_ids[0]
        for s in range(80)
    }
    assert seen == {0, 1}


def test_penalties_exact_values() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    p = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    b = SamplingBatch(
        params=[p],
        seeds=[None],
        banned=[],
        prompt_token_ids=[[0]],
        output_token_ids=[[1, 1, 2]],
    )
    out = _apply_penalties(logits, b)
    # token 0: prompt only -> 2/2; token 1: twice in output -> -2*2 - 0.5*2 - 0.25;
    # token 2: once -> 1/2 - 0.5 - 0.25; token 3: untouched.
    assert out.tolist() == [[1.0, -5.25, -0.25, 0.5]]


def test_seeded_rows_do_not_depend_on_batch_mates() -> None:
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(1))
    p = SamplingParams(temperature=1.0, seed=42)
    alone = Sampler(0)(logits[1:2].clone(), batch([p])).token_ids
    mixed = Sampler(7)(
        logits.clone(), batch([SamplingParams(temperature=0.9), p, SamplingParams(temperature=0)])
    ).token_ids
    assert mixed[1] == alone[0]
    assert mixed[2] == logits[2].argmax().item()


def test_device_noise_scheme(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU's sampling scheme, run on CPU tensors: no [rows, vocab] draw on the CPU."""
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(1))
    p = SamplingParams(temperature=1.0, seed=42)
    cpu_draws: list[tuple[int, ...]] = []
    empty = torch.empty

    def recording_empty(*size: object, **kw: object) -> torch.Tensor:
        if kw.get("device") is None:
            cpu_draws.append(tuple(size))
        return empty(*size, **kw)

    sampler = Sampler(7, noise_on_device=True)
    monkeypatch.setattr(torch, "empty", recording_empty)
    mixed = sampler(
        logits.clone(), batch([SamplingParams(temperature=0.9), p, SamplingParams(temperature=0)])
    ).token_ids
    monkeypatch.undo()
    assert cpu_draws == []  # all noise from device-side generators
    alone = Sampler(0, noise_on_device=True)(logits[1:2].clone(), batch([p])).token_ids
    assert mixed[1] == alone[0]  # a seeded row is independent of its batch-mates
    assert mixed[2] == logits[2].argmax().item()
    # The same engine seed gives the same unseeded draws.
    again = Sampler(7, noise_on_device=True)(
        logits.clone(), batch([SamplingParams(temperature=0.9), p, SamplingParams(temperature=0)])
    ).token_ids
    assert again == mixed


@pytest.fixture(scope="module")
def llm(llama_dir: str) -> LLM:
    return LLM(model=llama_dir, num_kv_blocks=128, max_num_seqs=8)


def _gen(llm: LLM, prompts: list[str], **kw: object) -> list:
    outs = llm.generate(prompts, SamplingParams(**kw), use_tqdm=False)
    llm.check_block_accounting()
    return outs


def test_fixed_seed_reproduces_whatever_the_batch(llm: LLM) -> None:
    kw = dict(temperature=1.0, top_p=0.9, max_tokens=16, seed=1234)
    first = _gen(llm, PROMPTS[:1], **kw)[0].outputs[0].token_ids
    again = _gen(llm, PROMPTS[:1], **kw)[0].outputs[0].token_ids
    params = [SamplingParams(**kw)] + [SamplingParams(temperature=1.0, max_tokens=16)] * 3
    in_batch = llm.generate(PROMPTS, params, use_tqdm=False)[0].outputs[0].token_ids
    other_seed = _gen(llm, PROMPTS[:1], **{**kw, "seed": 99})[0].outputs[0].token_ids
    assert first == again == in_batch
    assert other_seed != first
    llm.check_block_accounting()


def test_top_k_one_equals_greedy(llm: LLM) -> None:
    greedy = [o.outputs[0].token_ids for o in _gen(llm, PROMPTS, temperature=0, max_tokens=12)]
    top1 = [
        o.outputs[0].token_ids
        for o in _gen(llm, PROMPTS, temperature=0.8, top_k=1, seed=5, max_tokens=12)
    ]
    assert top1 == greedy


def test_max_tokens_ends_with_length(llm: LLM) -> None:
    out = _gen(llm, PROMPTS[:1], temperature=0, max_tokens=7, ignore_eos=True)[0].outputs[0]
    assert len(out.token_ids) == 7 and out.finish_reason == "length"


def test_stop_token_ids_end_generation(llm: LLM) -> None:
    base = _gen(llm, PROMPTS[:1], temperature=0, max_tokens=20, ignore_eos=True)[0].outputs[0]
    stop_id = base.token_ids[4]
    first = base.token_ids.index(stop_id)
    out = _gen(
        llm, PROMPTS[:1], temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop_id]
    )
    comp = out[0].outputs[0]
    assert comp.token_ids == base.token_ids[: first + 1]
    assert comp.finish_reason == "stop" and comp.stop_reason == stop_id


def test_stop_strings_end_generation_and_are_cut(llm: LLM) -> None:
    prompt = PROMPTS[3]
    base = _gen(llm, [prompt], temperature=0, max_tokens=24, ignore_eos=True)[0].outputs[0]
    assert len(base.text) > 8
    stop = base.text[5:8]
    cut = base.text.index(stop)
    out = _gen(llm, [prompt], temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])[
        0
    ].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == base.text[:cut]
    assert base.token_ids[: len(out.token_ids)] == out.token_ids
    kept = _gen(
        llm,
        [prompt],
        temperature=0,
        max_tokens=24,
        ignore_eos=True,
        stop=stop,
        include_stop_str_in_output=True,
    )[0].outputs[0]
    assert kept.text == base.text[: cut + len(stop)]


def test_eos_stops_and_min_tokens_holds_it_off(eos_first_llama: str) -> None:
    path, eos = eos_first_llama, eos_of(eos_first_llama)
    llm = LLM(model=path, num_kv_blocks=32)
    plain = _gen(llm, [PROMPT_TEXTS[0]], temperature=0, max_tokens=10)[0].outputs[0]
    assert plain.token_ids == [eos] and plain.finish_reason == "stop"
    held = _gen(llm, [PROMPT_TEXTS[0]], temperature=0, max_tokens=10, min_tokens=4)[0].outputs[0]
    assert len(held.token_ids) >= 4
    assert eos not in held.token_ids[:4]
    assert held.finish_reason == "stop" if eos in held.token_ids else held.finish_reason == "length"
    ignored = _gen(llm, [PROMPT_TEXTS[0]], temperature=0, max_tokens=6, ignore_eos=True)[0].outputs[
        0
    ]
    assert ignored.token_ids[0] == eos and len(ignored.token_ids) == 6
