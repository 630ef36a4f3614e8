"""Beam search: the top beam equals transformers' beam search; blocks are shared, not leaked."""

from __future__ import annotations

import pytest
import torch

from pagefleet.engine import LLM, BeamSearchParams
from pagefleet.engine.scheduler import SchedulerOutput
from tests.conftest import _hf_model, prompt_ids


def hf_beam(
    path: str, ids: list[int], width: int, max_new: int, length_penalty: float
) -> list[int]:
    with torch.inference_mode():
        out = _hf_model(path).generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=max_new,
            num_beams=width,
            do_sample=False,
            early_stopping=True,
            length_penalty=length_penalty,
        )
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize("width, length_penalty", [(2, 1.0), (4, 1.0), (3, 0.5)])
def test_top_beam_equals_transformers(llama_dir: str, width: int, length_penalty: float) -> None:
    prompts = prompt_ids(llama_dir)[:6]
    llm = LLM(model=llama_dir, num_kv_blocks=256, block_size=8)
    copies = count_copies(llm)
    outs = llm.beam_search(
        [{"prompt_token_ids": p} for p in prompts],
        BeamSearchParams(beam_width=width, max_tokens=10, length_penalty=length_penalty),
    )
    for ids, out in zip(prompts, outs, strict=True):
        best = out.sequences[0]
        assert best.tokens[: len(ids)] == ids
        assert best.output_token_ids == hf_beam(llama_dir, ids, width, 10, length_penalty)
        assert len(out.sequences) <= width
        assert [s.score for s in out.sequences] == sorted(
            (s.score for s in out.sequences), reverse=True
        )
    assert copies  # beams forked from one parent wrote into a shared block
    llm.check_block_accounting()


def test_beam_search_with_eos_matches_transformers(eos_first_llama: str) -> None:
    prompts = prompt_ids(eos_first_llama)[:4]
    llm = LLM(model=eos_first_llama, num_kv_blocks=256, block_size=8)
    # No length normalisation, so short hypotheses ended by EOS compete with long ones.
    outs = llm.beam_search(
        [{"prompt_token_ids": p} for p in prompts],
        BeamSearchParams(beam_width=3, max_tokens=8, length_penalty=0.0),
    )
    for ids, out in zip(prompts, outs, strict=True):
        assert out.sequences[0].output_token_ids == hf_beam(eos_first_llama, ids, 3, 8, 0.0)
    # EOS did end hypotheses early in this search.
    assert any(s.finish_reason == "stop" for out in outs for s in out.sequences)
    llm.check_block_accounting()


def test_refuses_what_cannot_fit(llama_dir: str) -> None:
    llm = LLM(model=llama_dir, num_kv_blocks=4, block_size=8, max_model_len=32)
    with pytest.raises(ValueError, match="KV blocks"):
        llm.beam_search("import os", BeamSearchParams(beam_width=4, max_tokens=8))


def count_copies(llm: LLM) -> list[tuple[int, int]]:
    """Record the copy-on-write block copies the scheduler orders."""
    copies: list[tuple[int, int]] = []
    schedule = llm.engine.token_engine.scheduler.schedule

    def spy() -> SchedulerOutput:
        out = schedule()
        copies.extend(out.blocks_to_copy)
        return out

    llm.engine.token_engine.scheduler.schedule = spy
    return copies
