"""Grouped experts on the CPU (`cpu_moe.c`): a mixture-of-experts layer's experts in one call.

`experts(x, topk_ids, topk_weights, gate_up, down, inter)` computes
sum_j topk_weights[t, j] * down_e(unit(gate_e(x[t]), up_e(x[t]))), e = topk_ids[t, j], for
every token t: the routing is sorted by expert in C, each expert with rows runs its gate/up
GEMM, gated unit and down GEMM over its block of rows in the decode GEMM's register tiles
(`cpu_panel_gemm.c`), and each token sums its experts' rows in ascending expert order, as
`layers/moe.py`'s torch references do. The engine's threads split the experts' panels.

The gated unit (`UNITS`): "silu", silu(gate) * up (Qwen3-MoE, Mixtral), or
"clamped_swiglu", gpt-oss's (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with
g = min(gate, limit). Biases are optional: gate/up's and down's (`pack_biases`, fp32 for
either dtype), each added where the reference adds it, before any rounding.

Weights are packed once (`pack`): every expert's gate/up as one panel matrix whose panel
pairs hold gate and up of the same intermediate columns (so the tile applies SiLU-and-mul
as it stores), and every expert's down in the decode GEMM's panels; one tensor each,
[experts, packed size], ordinary tensors a compiled forward can take as arguments. Both
are allocated in memory advised for transparent huge pages (`madvise(MADV_HUGEPAGE)`, on
Linux where the libc has it) before they are written: a decode step streams every active
expert's panels once, and with 4 KiB pages that stream pays a TLB miss every 4 KiB and the
hardware prefetcher stops at each page boundary.

Where it runs: where the decode GEMM does (`cpu_panel_gemm.available`): fp32 on AVX-512F or
AVX2+FMA, bf16 on AVX512-BF16. bf16 rounds where the reference rounds (the module docstring
of `cpu_moe.c`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from collections.abc import Callable
from functools import cache

import torch
import torch.nn.functional as F

from . import cpu_build, cpu_panel_gemm

DTYPES = cpu_panel_gemm.DTYPES
# The gated units, by `cpu_moe.c`'s numbering.
UNITS = {"silu": 0, "clamped_swiglu": 1}


def available(dtype: torch.dtype) -> bool:
    """Whether this CPU and build have the grouped experts for `dtype`."""
    return cpu_panel_gemm.available(dtype)


def _panel_width(dtype: torch.dtype) -> int:
    return 16 if dtype == torch.bfloat16 else cpu_panel_gemm.panel_width()


def interleave_gate_up(w13: torch.Tensor, width: int) -> torch.Tensor:
    """[2 * inter, hidden] (gate rows, then up rows) -> [2 * IP, hidden]: per block of `width`
    intermediate columns, its gate rows then its up rows (IP: inter rounded up to `width`,
    the added rows zero)."""
    two_inter, hidden = w13.shape
    inter = two_inter // 2
    padded = -(-inter // width) * width
    gate, up = (F.pad(h, (0, 0, 0, padded - inter)) for h in w13.chunk(2, dim=0))
    blocks = padded // width
    both = torch.stack((gate.view(blocks, width, hidden), up.view(blocks, width, hidden)), dim=1)
    return both.reshape(2 * padded, hidden)


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


@cache
def _madvise() -> Callable[[int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def huge_page_empty(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised [rows, cols] tensor at a huge-page boundary, advised for transparent
    huge pages (plain memory where that cannot be asked)."""
    size = rows * cols * dtype.itemsize
    base = torch.empty(size + _HUGE_PAGE, dtype=torch.uint8)
    offset = -base.data_ptr() % _HUGE_PAGE
    madvise = _madvise()
    if madvise is not None and size >= _HUGE_PAGE:
        madvise(base.data_ptr() + offset, size - size % _HUGE_PAGE, _MADV_HUGEPAGE)
    return base[offset : offset + size].view(dtype).view(rows, cols)


def pack_biases(
    b13: torch.Tensor, b2: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every expert's biases for the kernel of `dtype`, in fp32.

    b13: [experts, 2 * inter] (gate, then up), returned in `pack`'s gate/up row order
    ([experts, 2 * IP], the padding zero); b2: [experts, hidden], returned as it is.
    """
    width = _panel_width(dtype)
    gate_up = torch.stack([interleave_gate_up(b.unsqueeze(1), width).squeeze(1) for b in b13])
    return gate_up.float().contiguous(), b2.float().contiguous()


def pack(w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every expert's weights in the kernel's panels.

    w13: [experts, 2 * inter, hidden] (gate rows, then up rows); w2: [experts, hidden, inter].
    Returns (gate/up panels, down panels), each [experts, packed size] in the weights' dtype.
    """
    width = _panel_width(w13.dtype)
    packed = []
    for weights in ([interleave_gate_up(w, width) for w in w13], list(w2)):
        first = cpu_panel_gemm.pack(weights[0])
        out = huge_page_empty(len(weights), first.numel(), first.dtype)
        out[0] = first
        for e in range(1, len(weights)):
            out[e] = cpu_panel_gemm.pack(weights[e])
        packed.append(out)
    return packed[0], packed[1]


def _pointer(bias: torch.Tensor | None) -> tuple[int | None, int]:
    return (None, 0) if bias is None else (bias.data_ptr(), bias.stride(0))


def experts(
    x: torch.Tensor,  # [tokens, hidden], fp32 or bf16, rows contiguous
    topk_ids: torch.Tensor,  # [tokens, top_k], integer
    topk_weights: torch.Tensor,  # [tokens, top_k], any float dtype
    gate_up: torch.Tensor,  # from pack()
    down: torch.Tensor,  # from pack()
    inter: int,  # the experts' intermediate size
    gate_up_bias: torch.Tensor | None = None,  # from pack_biases()
    down_bias: torch.Tensor | None = None,  # from pack_biases()
    unit: str = "silu",  # a name in UNITS
    limit: float = 0.0,  # the clamped SwiGLU's limit and alpha
    alpha: float = 0.0,
) -> torch.Tensor:  # [tokens, hidden], x's dtype
    lib = cpu_build.library()
    assert lib is not None and x.dtype == gate_up.dtype == down.dtype
    kernel = lib.moe_gated_experts_bf16 if x.dtype == torch.bfloat16 else lib.moe_gated_experts_f32
    if x.stride(-1) != 1:
        x = x.contiguous()
    tokens, hidden = x.shape
    ids = topk_ids.to(torch.int64).contiguous()
    weights = topk_weights.to(torch.float32).contiguous()
    out = torch.empty(tokens, hidden, dtype=x.dtype)
    failed = kernel(
        x.data_ptr(), x.stride(0), ids.data_ptr(), weights.data_ptr(),
        gate_up.data_ptr(), gate_up.stride(0), down.data_ptr(), down.stride(0),
        *_pointer(gate_up_bias), *_pointer(down_bias),
        out.data_ptr(), tokens, ids.shape[1], gate_up.shape[0], hidden, inter,
        UNITS[unit], limit, alpha, torch.get_num_threads(),
    )  # fmt: skip
    if failed == 1:
        raise MemoryError("the grouped experts could not allocate their scratch")
    if failed:
        raise ValueError(f"the grouped experts failed (code {failed}): an expert id out of range?")
    return out
