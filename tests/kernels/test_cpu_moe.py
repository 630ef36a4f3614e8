"""The grouped experts kernel (`kernels/cpu_moe.c`), fp32 and bf16, against the torch
references it replaces (`layers/moe.py`'s `moe_experts` for the SiLU experts,
`clamped_swiglu_experts` for gpt-oss's biased clamped-SwiGLU ones), and the layers that pack
for it."""

from __future__ import annotations

import pytest
import torch

from pagefleet.engine.layers.moe import (
    ClampedSwigluMoE,
    FusedMoE,
    clamped_swiglu_experts,
    moe_experts,
)
from pagefleet.kernels import cpu_moe
from tests.kernels.threads import torch_threads

pytestmark = pytest.mark.skipif(
    not cpu_moe.available(torch.float32), reason="the kernel needs AVX-512F or AVX2+FMA, and gcc"
)


def _routing(
    tokens: int, experts: int, top_k: int, gen: torch.Generator, skew: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.randn(tokens, experts, generator=gen)
    if skew:  # most tokens on expert 0: blocks of many tiles, and experts with no rows
        logits[:, 0] += 10.0
        logits[:, experts // 2 :] -= 10.0
    weights, ids = torch.topk(logits.softmax(-1), top_k)
    return weights / weights.sum(-1, keepdim=True), ids


# The gated unit and whether the down projection's bias is added (rank 0's, under tensor
# parallelism): the SiLU experts have no biases.
UNITS = [("silu", False), ("clamped_swiglu", True), ("clamped_swiglu", False)]
# gpt-oss's alpha; a limit that the test's pre-activations cross, so both clamps bind.
LIMIT, ALPHA = 1.5, 1.702


def _kernel_and_reference(
    unit: str,
    down_bias: bool,
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    gen: torch.Generator,
    threads: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's output and its torch reference's, for the unit (with random biases for
    the clamped SwiGLU)."""
    experts, two_inter, _ = w13.shape
    gate_up, down = cpu_moe.pack(w13, w2)
    if unit == "silu":
        with torch_threads(threads):
            got = cpu_moe.experts(x, ids, weights, gate_up, down, two_inter // 2)
        return got, moe_experts(x.contiguous(), ids, weights, w13, w2)
    b13 = (torch.randn(experts, two_inter, generator=gen) * 0.5).to(w13.dtype)
    b2 = (torch.randn(experts, w2.shape[1], generator=gen) * 0.5).to(w13.dtype)
    gate_up_bias, down_b = cpu_moe.pack_biases(b13, b2, w13.dtype)
    with torch_threads(threads):
        got = cpu_moe.experts(
            x, ids, weights, gate_up, down, two_inter // 2,
            gate_up_bias, down_b if down_bias else None, unit, LIMIT, ALPHA,
        )  # fmt: skip
    expected = clamped_swiglu_experts(
        x.contiguous(), ids, weights, w13, b13, w2, b2, LIMIT, ALPHA, down_bias
    )
    return got, expected


SHAPES = [
    # experts, hidden, inter, top_k, tokens, skew
    (6, 32, 24, 2, 37, False),  # inter not a whole panel
    (8, 33, 17, 2, 5, False),  # odd hidden and inter (bf16 pairs padded)
    (4, 64, 32, 1, 1, False),  # one token
    (8, 96, 48, 2, 60, True),  # an expert with 50+ rows, several without
    (64, 256, 96, 8, 16, False),  # a decode step's shape, scaled down
]


@pytest.mark.parametrize(("unit", "down_bias"), UNITS)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", SHAPES)
def test_fp32_matches_the_reference(
    unit: str, down_bias: bool, threads: int, shape: tuple[int, int, int, int, int, bool]
) -> None:
    experts, hidden, inter, top_k, tokens, skew = shape
    gen = torch.Generator().manual_seed(experts * 100 + tokens)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.2
    w2 = torch.randn(experts, hidden, inter, generator=gen) * 0.2
    # Rows with a stride past hidden, as a view of a wider activation would give.
    x = torch.randn(tokens, hidden + 3, generator=gen)[:, :hidden]
    weights, ids = _routing(tokens, experts, top_k, gen, skew)
    got, expected = _kernel_and_reference(unit, down_bias, x, ids, weights, w13, w2, gen, threads)
    assert got.shape == expected.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not cpu_moe.available(torch.bfloat16), reason="needs AVX512-BF16")
@pytest.mark.parametrize(("unit", "down_bias"), UNITS)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", SHAPES)
def test_bf16_matches_the_reference(
    unit: str, down_bias: bool, threads: int, shape: tuple[int, int, int, int, int, bool]
) -> None:
    """The kernel rounds where the reference rounds; only each GEMM's summation order differs,
    so the outputs agree to a bf16 rounding or two."""
    experts, hidden, inter, top_k, tokens, skew = shape
    gen = torch.Generator().manual_seed(experts * 100 + tokens + 1)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.2).bfloat16()
    w2 = (torch.randn(experts, hidden, inter, generator=gen) * 0.2).bfloat16()
    x = torch.randn(tokens, hidden, generator=gen).bfloat16()
    weights, ids = _routing(tokens, experts, top_k, gen, skew)
    weights = weights.bfloat16()
    got, expected = _kernel_and_reference(unit, down_bias, x, ids, weights, w13, w2, gen, threads)
    assert got.dtype == torch.bfloat16
    scale = expected.float().abs().max().item()
    torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2 * scale)


def test_interleaved_gate_up_pairs_gate_and_up_columns() -> None:
    """Block b of the interleaved matrix: gate's rows of the block, then up's; padding zero."""
    inter, hidden, width = 5, 3, 4
    w13 = torch.arange(2 * inter * hidden, dtype=torch.float32).view(2 * inter, hidden)
    out = cpu_moe.interleave_gate_up(w13, width)
    assert out.shape == (16, hidden)
    gate, up = w13[:inter], w13[inter:]
    torch.testing.assert_close(out[0:4], gate[0:4])
    torch.testing.assert_close(out[4:8], up[0:4])
    torch.testing.assert_close(out[8], gate[4])
    torch.testing.assert_close(out[12], up[4])
    assert not out[9:12].any() and not out[13:16].any()


def test_an_expert_id_out_of_range_raises() -> None:
    w13, w2 = torch.randn(2, 16, 8), torch.randn(2, 8, 8)
    gate_up, down = cpu_moe.pack(w13, w2)
    ids = torch.tensor([[0, 2]])
    with pytest.raises(ValueError):
        cpu_moe.experts(torch.randn(1, 8), ids, torch.ones(1, 2), gate_up, down, 8)


LAYERS = {
    "silu": lambda: FusedMoE(64, 40, 8, 2, norm_topk_prob=True),
    "clamped_swiglu": lambda: ClampedSwigluMoE(64, 40, 8, 2, LIMIT, ALPHA),
}


@pytest.mark.parametrize("unit", sorted(LAYERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_packed_layer_runs_the_kernel(dtype: torch.dtype, unit: str) -> None:
    if not cpu_moe.available(dtype):
        pytest.skip(f"no kernel for {dtype} here")
    torch.manual_seed(0)
    layer = LAYERS[unit]().to(dtype)
    for p in layer.parameters():
        p.data.normal_(0, 0.2)
    x = torch.randn(21, 64, dtype=dtype)
    with torch.inference_mode():
        expected = layer(x)
        assert layer.pack(16)
        got = layer(x)
    assert layer.panels is not None and layer.w13.numel() == 0 and layer.w2.numel() == 0
    assert getattr(layer, "packed", None) is None
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    scale = expected.float().abs().max().item()
    torch.testing.assert_close(got.float(), expected.float(), rtol=tol, atol=tol * scale)


def test_panels_start_at_a_huge_page_boundary() -> None:
    t = cpu_moe.huge_page_empty(3, (2 << 20) // 4 + 5, torch.float32)
    assert t.shape == (3, (2 << 20) // 4 + 5) and t.is_contiguous()
    assert t.data_ptr() % (2 << 20) == 0
    t.fill_(1.0)
    assert t.sum().item() == t.numel()
