"""The decode GEMM (`kernels/cpu_panel_gemm.c`), fp32 and its bf16 twin, against a float64
reference, and the layer that routes a decode step's few rows to it and prefill's many to
oneDNN."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagefleet.engine.layers.cpu_gemm import PackedWeight
from pagefleet.kernels import cpu_build, cpu_panel_gemm
from tests.kernels.threads import torch_threads

pytestmark = pytest.mark.skipif(
    not cpu_panel_gemm.available(), reason="the panel GEMM needs AVX-512F or AVX2+FMA, and gcc"
)


def _reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), w.double(), None if bias is None else bias.double())


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    ("m", "n", "k"),
    [
        (1, 576, 576),  # one sequence
        (12, 32, 64),  # one tile, one panel pair exactly
        (13, 32, 64),  # a second tile of one row
        (20, 960, 576),  # SmolLM-135M's QKV at a 20-sequence step
        (64, 1536, 576),  # MAX_ROWS: six tiles
        (5, 17, 33),  # a second panel of one column, odd k
        (7, 8, 9),  # fewer columns than one panel
        (3, 49, 1536),  # 1 pair + a pair whose second panel holds one column
    ],
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_kernel_matches_float64(threads: int, m: int, n: int, k: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=gen)
    # Rows with a stride past k: the kernel reads x by its row stride, as a view of a wider
    # activation would give it.
    x = torch.randn(m, k + 5, generator=gen)[:, :k]
    bias = torch.randn(n, generator=gen) if with_bias else None
    with torch_threads(threads):
        y = cpu_panel_gemm.linear(x, cpu_panel_gemm.pack(w), n, bias)
    assert y.shape == (m, n) and y.dtype == torch.float32
    ref = _reference(x, w, bias)
    # fp32 sums of k products: the error grows like sqrt(k) times the products' size.
    assert (y.double() - ref).abs().max().item() < 2e-6 * k**0.5 * 4


def test_padding_columns_are_zero() -> None:
    """The packed weight pads to whole panel pairs with zeros."""
    width = cpu_panel_gemm.panel_width()
    n, k = width + 1, 4
    w = torch.arange(n * k, dtype=torch.float32).reshape(n, k)
    packed = cpu_panel_gemm.pack(w)
    assert packed.numel() == 2 * width * k  # one pair of panels
    panels = packed.view(2, k, width)  # [panel][k][column]
    assert torch.equal(panels[0].T, w[:width])
    assert torch.equal(panels[1][:, 0], w[width])
    assert torch.count_nonzero(panels[1][:, 1:]) == 0
    x = torch.ones(2, k)
    assert torch.equal(cpu_panel_gemm.linear(x, packed, n, None), x @ w.T)


@pytest.mark.parametrize("n", [1, 17, 40, 64])
def test_outputs_past_n_are_never_written(n: int) -> None:
    """A partial panel pair stores under a column mask: in an output whose rows are wider
    than n, the columns past n keep what the caller had there."""
    lib = cpu_build.library()
    assert lib is not None
    m, k, pad = 13, 24, 8
    gen = torch.Generator().manual_seed(n)
    w, x = torch.randn(n, k, generator=gen), torch.randn(m, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    packed = cpu_panel_gemm.pack(w)
    y = torch.full((m, n + pad), float("nan"))
    failed = lib.panel_gemm_f32(
        x.data_ptr(), k, packed.data_ptr(), bias.data_ptr(), y.data_ptr(), n + pad, m, n, k, 1
    )
    assert failed == 0
    assert torch.isnan(y[:, n:]).all()
    assert (y[:, :n].double() - _reference(x, w, bias)).abs().max().item() < 1e-4


def test_no_rows_gives_no_rows() -> None:
    w = torch.randn(40, 8)
    y = cpu_panel_gemm.linear(torch.empty(0, 8), cpu_panel_gemm.pack(w), 40, None)
    assert y.shape == (0, 40)


def test_the_layer_sends_few_rows_to_the_panels_and_many_to_onednn() -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=gen)
    packed = PackedWeight.try_pack(w, 16)
    assert packed is not None
    panels = cpu_panel_gemm.pack(w)
    few = torch.randn(cpu_panel_gemm.MAX_ROWS, 64, generator=gen)
    many = torch.randn(cpu_panel_gemm.MAX_ROWS + 1, 64, generator=gen)
    # Bit for bit the kernel's result at MAX_ROWS rows; oneDNN's (torch's packed op) past it.
    assert torch.equal(packed.linear(few, None), cpu_panel_gemm.linear(few, panels, 96, None))
    onednn = PackedWeight.try_pack(w, 16)
    assert onednn is not None
    onednn._panels = None
    assert torch.equal(packed.linear(many, None), onednn.linear(many, None))


bf16_kernel = pytest.mark.skipif(
    not cpu_panel_gemm.available(torch.bfloat16), reason="the bf16 panel GEMM needs AVX512-BF16"
)


@bf16_kernel
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    ("m", "n", "k"),
    [
        (1, 576, 576),  # one sequence
        (12, 32, 64),  # one tile, one panel pair exactly
        (13, 32, 64),  # a second tile of one row
        (20, 960, 576),  # SmolLM-135M's QKV at a 20-sequence step
        (64, 576, 1536),  # MAX_ROWS: six tiles; the down projection's k
        (5, 17, 33),  # a second panel of one column, odd k (a zero-padded k pair)
        (7, 8, 9),  # fewer columns than one panel
        (3, 49, 1),  # k of one: a single, half-padded pair
    ],
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_bf16_kernel_is_the_float64_product_rounded_once(
    threads: int, m: int, n: int, k: int, with_bias: bool
) -> None:
    """bf16 products summed in fp32, the bias added, one rounding to bf16: within half a
    bf16 ulp of the exact result, plus fp32's summation error."""
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=gen).bfloat16()
    x = torch.randn(m, k + 6, generator=gen).bfloat16()[:, :k]
    bias = torch.randn(n, generator=gen).bfloat16() if with_bias else None
    with torch_threads(threads):
        y = cpu_panel_gemm.linear(x, cpu_panel_gemm.pack(w), n, bias)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    ref = _reference(x, w, bias)
    bound = ref.abs() * 2.0**-8 + 2e-6 * k**0.5 * 4
    assert ((y.double() - ref).abs() <= bound).all()
    # And torch's own bf16 GEMM, within bf16's tolerance.
    torch.testing.assert_close(y, F.linear(x, w, bias), atol=2e-2, rtol=1.6e-2)


@bf16_kernel
def test_bf16_packing_interleaves_k_pairs_and_pads_with_zero() -> None:
    n, k = 17, 3
    w = torch.arange(1, n * k + 1, dtype=torch.float32).reshape(n, k).bfloat16()
    packed = cpu_panel_gemm.pack(w)
    assert packed.dtype == torch.bfloat16 and packed.numel() == 2 * 16 * 2 * 2
    panels = packed.view(2, 2, 16, 2)  # [panel][k pair][column][k within the pair]
    assert torch.equal(panels[0, 0, :, 0], w[:16, 0]) and torch.equal(panels[0, 0, :, 1], w[:16, 1])
    assert torch.equal(panels[0, 1, :, 0], w[:16, 2])
    assert torch.count_nonzero(panels[0, 1, :, 1]) == 0  # k = 3 is past k
    assert torch.equal(panels[1, :, 0].flatten()[:3], w[16])
    assert torch.count_nonzero(panels[1, :, 1:]) == 0  # columns past n


@bf16_kernel
@pytest.mark.parametrize("n", [1, 17, 40, 64])
def test_bf16_outputs_past_n_are_never_written(n: int) -> None:
    lib = cpu_build.library()
    assert lib is not None
    m, k, pad = 13, 24, 8
    gen = torch.Generator().manual_seed(n)
    w, x = torch.randn(n, k, generator=gen).bfloat16(), torch.randn(m, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16()
    packed = cpu_panel_gemm.pack(w)
    y = torch.full((m, n + pad), float("nan"), dtype=torch.bfloat16)
    failed = lib.panel_gemm_bf16(
        x.data_ptr(), k, packed.data_ptr(), bias.data_ptr(), y.data_ptr(), n + pad, m, n, k, 1
    )
    assert failed == 0
    assert torch.isnan(y[:, n:]).all()
    torch.testing.assert_close(y[:, :n], F.linear(x, w, bias), atol=2e-2, rtol=1.6e-2)


def test_bf16_weights_keep_a_panel_copy_only_where_the_cpu_has_avx512_bf16() -> None:
    packed = PackedWeight.try_pack(torch.randn(32, 32).bfloat16(), 8)
    has_panels = packed is not None and packed._panels is not None
    assert has_panels == cpu_panel_gemm.available(torch.bfloat16)


@bf16_kernel
def test_the_layer_sends_few_bf16_rows_to_the_panels_and_many_to_onednn() -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=gen).bfloat16()
    packed = PackedWeight.try_pack(w, 16)
    assert packed is not None and not packed.emulated
    panels = cpu_panel_gemm.pack(w)
    few = torch.randn(cpu_panel_gemm.MAX_ROWS, 64, generator=gen).bfloat16()
    many = torch.randn(cpu_panel_gemm.MAX_ROWS + 1, 64, generator=gen).bfloat16()
    assert torch.equal(packed.linear(few, None), cpu_panel_gemm.linear(few, panels, 96, None))
    onednn = PackedWeight.try_pack(w, 16)
    assert onednn is not None
    onednn._panels = None
    assert torch.equal(packed.linear(many, None), onednn.linear(many, None))
