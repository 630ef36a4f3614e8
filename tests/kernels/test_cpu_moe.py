"""The grouped experts kernel (`kernels/cpu_moe.c`), fp32 and bf16, against the torch
reference it replaces (`layers/moe.py`'s `moe_experts`), and the layer that packs for it."""

from __future__ import annotations

import pytest
import torch

from pagefleet.engine.layers.moe import FusedMoE, moe_experts
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


SHAPES = [
    # experts, hidden, inter, top_k, tokens, skew
    (6, 32, 24, 2, 37, False),  # inter not a whole panel
    (8, 33, 17, 2, 5, False),  # odd hidden and inter (bf16 pairs padded)
    (4, 64, 32, 1, 1, False),  # one token
    (8, 96, 48, 2, 60, True),  # an expert with 50+ rows, several without
    (64, 256, 96, 8, 16, False),  # a decode step's shape, scaled down
]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("experts", "hidden", "inter", "top_k", "tokens", "skew"), SHAPES)
def test_fp32_matches_the_reference(
    threads: int, experts: int, hidden: int, inter: int, top_k: int, tokens: int, skew: bool
) -> None:
    gen = torch.Generator().manual_seed(experts * 100 + tokens)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.2
    w2 = torch.randn(experts, hidden, inter, generator=gen) * 0.2
    # Rows with a stride past hidden, as a view of a wider activation would give.
    x = torch.randn(tokens, hidden + 3, generator=gen)[:, :hidden]
    weights, ids = _routing(tokens, experts, top_k, gen, skew)
    gate_up, down = cpu_moe.pack(w13, w2)
    with torch_threads(threads):
        got = cpu_moe.experts(x, ids, weights, gate_up, down, inter)
    expected = moe_experts(x.contiguous(), ids, weights, w13, w2)
    assert got.shape == expected.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not cpu_moe.available(torch.bfloat16), reason="needs AVX512-BF16")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("experts", "hidden", "inter", "top_k", "tokens", "skew"), SHAPES)
def test_bf16_matches_the_reference(
    threads: int, experts: int, hidden: int, inter: int, top_k: int, tokens: int, skew: bool
) -> None:
    """The kernel rounds where the reference rounds; only each GEMM's summation order differs,
    so the outputs agree to a bf16 rounding or two."""
    gen = torch.Generator().manual_seed(experts * 100 + tokens + 1)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.2).bfloat16()
    w2 = (torch.randn(experts, hidden, inter, generator=gen) * 0.2).bfloat16()
    x = torch.randn(tokens, hidden, generator=gen).bfloat16()
    weights, ids = _routing(tokens, experts, top_k, gen, skew)
    weights = weights.bfloat16()
    gate_up, down = cpu_moe.pack(w13, w2)
    with torch_threads(threads):
        got = cpu_moe.experts(x, ids, weights, gate_up, down, inter)
    expected = moe_experts(x, ids, weights, w13, w2)
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_packed_layer_runs_the_kernel(dtype: torch.dtype) -> None:
    if not cpu_moe.available(dtype):
        pytest.skip(f"no kernel for {dtype} here")
    torch.manual_seed(0)
    layer = FusedMoE(64, 40, 8, 2, norm_topk_prob=True).to(dtype)
    for p in layer.parameters():
        p.data.normal_(0, 0.2)
    x = torch.randn(21, 64, dtype=dtype)
    with torch.inference_mode():
        expected = layer(x)
        assert layer.pack(16)
        got = layer(x)
    assert layer.panels is not None and layer.packed is None and layer.w13.numel() == 0
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    scale = expected.float().abs().max().item()
    torch.testing.assert_close(got.float(), expected.float(), rtol=tol, atol=tol * scale)


def test_panels_start_at_a_huge_page_boundary() -> None:
    t = cpu_moe.huge_page_empty(3, (2 << 20) // 4 + 5, torch.float32)
    assert t.shape == (3, (2 << 20) // 4 + 5) and t.is_contiguous()
    assert t.data_ptr() % (2 << 20) == 0
    t.fill_(1.0)
    assert t.sum().item() == t.numel()
