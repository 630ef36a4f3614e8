"""The CPU decode-attention kernel (`cpu_paged_decode.c`), called by pointer.

Built with the prefill kernel into one library (`cpu_build.py`); where that
library is not built, the torch path serves.

Why C and not torch: every torch formulation of paged decode gathers the
context out of the cache before attending over it, which triples the memory
traffic of what is, at long contexts, a memory-bound step (BENCHMARKS.md, the
step profile).
"""

from __future__ import annotations

import torch

from . import cpu_build

# The dtypes the kernel has entry points for (others take the torch path).
_SYMBOLS = {torch.float32: "paged_decode_f32", torch.bfloat16: "paged_decode_bf16"}


def available(dtype: torch.dtype) -> bool:
    """Whether decodes of this dtype will read the cache in place (building the kernel now)."""
    return dtype in _SYMBOLS and cpu_build.library() is not None


def supports(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the kernel can serve this layer's decodes (and is built)."""
    return cpu_build.reads_in_place(query, k_cache)


def paged_decode(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]: one token per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [>= num_seqs, max_blocks] int32
    context_lens: torch.Tensor,  # [>= num_seqs] int32
    scale: float,
    out: torch.Tensor,  # [num_seqs, num_heads, head_dim], contiguous: written
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads]: a logit per head with no value
) -> None:
    """Attend each sequence's one query over its cached context, in place in the cache.

    `sliding_window`: only the last that many keys of each context are read.
    `logits_soft_cap`: scores become cap * tanh(scores / cap) before the softmax.
    """
    lib = cpu_build.library()
    assert lib is not None, "call supports() first"
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert block_tables.dtype == torch.int32 and context_lens.dtype == torch.int32
    assert block_tables.stride(-1) == 1 and context_lens.is_contiguous() and out.is_contiguous()
    assert v_cache.is_contiguous() and v_cache.shape == k_cache.shape
    sinks = None if sinks is None else sinks.float().contiguous()
    failed = getattr(lib, _SYMBOLS[query.dtype])(
        query.data_ptr(), query.stride(0), query.stride(1),
        k_cache.data_ptr(), v_cache.data_ptr(),
        block_tables.data_ptr(), block_tables.stride(0), context_lens.data_ptr(),
        out.data_ptr(),
        num_seqs, num_heads, num_kv_heads, head_dim, block_size,
        scale, sliding_window or 0, logits_soft_cap or 0.0,
        None if sinks is None else sinks.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise MemoryError("the CPU decode kernel could not allocate its score buffer")
