"""The decode GEMM (`cpu_panel_gemm.c`): weights in panels, called by pointer.

Where it runs: fp32 weights on a CPU with AVX-512F or AVX2+FMA, and bf16 weights
on a CPU with AVX512-BF16 (vdpbf16ps: bf16 products summed in fp32), for inputs
of at most `MAX_ROWS` rows (a decode step's batch) in the weight's dtype. Larger
inputs are arithmetic-bound and oneDNN's packed GEMM is faster there (measured
per shape in BENCHMARKS.md, "the decode GEMM"), so `layers/cpu_gemm.py` keeps
both. bf16 on a CPU without AVX512-BF16 has no panels: oneDNN (or torch) serves.
"""

from __future__ import annotations

import torch

from . import cpu_build

# Up to this many rows the panel kernel beat oneDNN on a step's worth of SmolLM-135M's
# GEMMs at 1 and 2 threads, fp32 and bf16 alike (benchmarks/decode_gemm.py).
MAX_ROWS = 64

DTYPES = (torch.float32, torch.bfloat16)


def available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this CPU and build have the kernel for `dtype` (building the library now)."""
    lib = cpu_build.library()
    if lib is None or dtype not in DTYPES:
        return False
    if dtype == torch.bfloat16:
        return bool(lib.panel_gemm_bf16_supported())
    return bool(lib.panel_gemm_supported())


def instructions(dtype: torch.dtype) -> str:
    """The instructions the kernel for `dtype` multiplies with on this build."""
    if dtype == torch.bfloat16:
        return "AVX512-BF16 vdpbf16ps, fp32 sums"
    return "AVX-512F FMA" if panel_width() == 16 else "AVX2 FMA"


def panel_width() -> int:
    """fp32 values per panel (one vector register: 16 on AVX-512, 8 on AVX2); bf16: 16."""
    lib = cpu_build.library()
    assert lib is not None
    return int(lib.panel_gemm_panel_width())


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` ([n, k], fp32 or bf16) rearranged into the kernel's panels (a flat tensor)."""
    lib = cpu_build.library()
    assert lib is not None and weight.dtype in DTYPES and weight.dim() == 2
    n, k = weight.shape
    dense = weight.detach().contiguous()
    # torch's CPU allocator aligns to 64 bytes: the kernel's aligned panel loads need it.
    if weight.dtype == torch.bfloat16:
        packed = torch.empty(lib.panel_gemm_packed_bf16(n, k), dtype=torch.bfloat16)
        lib.panel_gemm_pack_bf16(dense.data_ptr(), packed.data_ptr(), n, k)
    else:
        packed = torch.empty(lib.panel_gemm_packed_floats(n, k), dtype=torch.float32)
        lib.panel_gemm_pack_f32(dense.data_ptr(), packed.data_ptr(), n, k)
    return packed


def linear(
    x: torch.Tensor,  # [m, k] in the packed weight's dtype, rows contiguous
    packed: torch.Tensor,  # from pack(), for a weight of [n, k]
    n: int,
    bias: torch.Tensor | None,  # [n], the same dtype
) -> torch.Tensor:  # [m, n], the same dtype
    lib = cpu_build.library()
    assert lib is not None and x.dtype == packed.dtype
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    if bias is not None:
        bias = bias.to(x.dtype).contiguous()
    y = torch.empty(m, n, dtype=x.dtype)
    gemm = lib.panel_gemm_bf16 if x.dtype == torch.bfloat16 else lib.panel_gemm_f32
    failed = gemm(
        x.data_ptr(), x.stride(0), packed.data_ptr(),
        None if bias is None else bias.data_ptr(),
        y.data_ptr(), n, m, n, k, torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise MemoryError("the panel GEMM could not allocate its scratch")
    return y
