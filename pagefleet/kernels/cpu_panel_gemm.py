"""The decode GEMM (`cpu_panel_gemm.c`): fp32 weights in panels, called by pointer.

Where it runs: fp32 weights on a CPU with AVX-512F or AVX2+FMA, for inputs of at most
`MAX_ROWS` rows (a decode step's batch). Larger inputs are arithmetic-bound
and oneDNN's packed GEMM is faster there (measured per shape in
BENCHMARKS.md, "the decode GEMM"), so `layers/cpu_gemm.py` keeps both.
"""

from __future__ import annotations

import torch

from . import cpu_build

# Up to this many rows the panel kernel beat oneDNN by 7-72% on a step's worth of
# SmolLM-135M's GEMMs at 1 and 2 threads, AVX-512 and AVX2 alike; at 128 rows they
# were level (benchmarks/decode_gemm.py).
MAX_ROWS = 64


def available() -> bool:
    """Whether this CPU and build have the kernel (building the library now)."""
    lib = cpu_build.library()
    return lib is not None and bool(lib.panel_gemm_supported())


def panel_width() -> int:
    """Floats per panel (one vector register: 16 on AVX-512, 8 on AVX2)."""
    lib = cpu_build.library()
    assert lib is not None
    return int(lib.panel_gemm_panel_width())


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` ([n, k] fp32) rearranged into the kernel's panels (a flat tensor)."""
    lib = cpu_build.library()
    assert lib is not None and weight.dtype == torch.float32 and weight.dim() == 2
    n, k = weight.shape
    dense = weight.detach().contiguous()
    # torch's CPU allocator aligns to 64 bytes: the kernel's aligned panel loads need it.
    packed = torch.empty(lib.panel_gemm_packed_floats(n, k), dtype=torch.float32)
    lib.panel_gemm_pack_f32(dense.data_ptr(), packed.data_ptr(), n, k)
    return packed


def linear(
    x: torch.Tensor,  # [m, k] fp32, rows contiguous
    packed: torch.Tensor,  # from pack(), for a weight of [n, k]
    n: int,
    bias: torch.Tensor | None,  # [n] fp32
) -> torch.Tensor:  # [m, n]
    lib = cpu_build.library()
    assert lib is not None
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    if bias is not None:
        bias = bias.contiguous()
    y = torch.empty(m, n, dtype=torch.float32)
    failed = lib.panel_gemm_f32(
        x.data_ptr(), x.stride(0), packed.data_ptr(),
        None if bias is None else bias.data_ptr(),
        y.data_ptr(), n, m, n, k, torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise MemoryError("the panel GEMM could not allocate its scratch")
    return y
