"""bfloat16 on the CPU, end to end: the engine's greedy tokens against transformers' on
the same bf16 checkpoint (Llama, and gpt-oss with its windows, sinks and grouped biased
experts), and the decode GEMM and attention products the start-up log names.

Decode steps of a few rows go through the bf16 panel kernel where the CPU has
AVX512-BF16 (`kernels/cpu_panel_gemm.c`), prompts through oneDNN, attention through
the C kernels over a bf16 cache: every product in bf16, every sum in fp32, as
transformers' bf16 forward."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from pagefleet.engine import LLM, SamplingParams
from pagefleet.kernels import cpu_build, cpu_panel_gemm
from tests.conftest import prompt_ids
from tests.engine.test_checkpoint import copy_checkpoint, resave
from tests.engine.test_model_families import family_checkpoint

MAX_NEW = 8


@pytest.fixture(scope="module")
def bf16_dir(llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = copy_checkpoint(llama_dir, tmp_path_factory.mktemp("bf16") / "llama")
    return str(resave(folder, torch.bfloat16))


@pytest.fixture(scope="module")
def gpt_oss_bf16_dir(model_root: Path) -> str:
    path = family_checkpoint(model_root, "gpt_oss")
    folder = copy_checkpoint(str(path), model_root / "tiny-gpt_oss-bf16")
    return str(resave(folder, torch.bfloat16))


def _hf_bf16_logits(path: str, ids: list[int]) -> torch.Tensor:  # [len(ids), vocab] fp32
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


def _generate_bf16(path: str, prompts: list[list[int]]) -> list[list[int]]:
    with LLM(model=path, dtype="bfloat16", num_kv_blocks=64, max_num_seqs=16) as llm:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0.0, max_tokens=MAX_NEW),
            use_tqdm=False,
        )
        llm.check_block_accounting()
    return [list(o.outputs[0].token_ids) for o in outs]


def assert_transformers_bf16_choices(path: str, prompts: list[list[int]]) -> None:
    """Each greedy token is transformers' bf16 argmax on the same context, or ties it
    within bf16's rounding: bf16 keeps 8 bits of mantissa, so two logits closer than a
    few of their ulps may swap order between any two summation orders (transformers'
    own bf16 GEMMs against oneDNN's or the panels')."""
    exact = 0
    for prompt, tokens in zip(prompts, _generate_bf16(path, prompts), strict=True):
        assert len(tokens) == MAX_NEW
        logits = _hf_bf16_logits(path, prompt + tokens)[len(prompt) - 1 : -1]
        best = logits.max(dim=-1).values
        chosen = logits.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1)
        ulp = best.abs() * 2.0**-8
        assert ((best - chosen) <= 4 * ulp).all(), (prompt, tokens)
        exact += bool((chosen == best).all())
    assert exact >= len(prompts) - 2  # ties are rare: most prompts match token for token


def test_bf16_greedy_tokens_are_transformers_bf16_choices(
    bf16_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="pagefleet"):
        assert_transformers_bf16_choices(bf16_dir, prompt_ids(bf16_dir))
    gemm = [r.getMessage() for r in caplog.records if r.getMessage().startswith("CPU GEMM")]
    path = "the panel kernel (AVX512-BF16" if cpu_panel_gemm.available(torch.bfloat16) else "oneDNN"
    assert len(gemm) == 1 and f"decode steps of up to 64 rows: {path}" in gemm[0]
    attention = [
        r.getMessage() for r in caplog.records if r.getMessage().startswith("CPU attention")
    ]
    products = "bf16 pairs (AVX512-BF16" if cpu_build.attention_bf16_pairs() else "widened to fp32"
    assert len(attention) == 1 and products in attention[0]


def test_gpt_oss_bf16_greedy_tokens_are_transformers_bf16_choices(gpt_oss_bf16_dir: str) -> None:
    """Prompts past the sliding window (12), the sinks, and the experts in the grouped
    kernel's bf16 unit with their biases and clamped SwiGLU."""
    assert_transformers_bf16_choices(gpt_oss_bf16_dir, prompt_ids(gpt_oss_bf16_dir))
