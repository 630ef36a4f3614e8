"""The CPU prompt-chunk attention kernel (`cpu_paged_prefill.c`), called by pointer.

Every prompt chunk of a step in one call: each chunk's queries over its
sequence's cached context and, causally, its own tokens, reading K/V in place
in the paged cache (the step's own K/V are stored before attention runs). The
algorithm is described where it lives, at the top of the C source. Built with
the decode kernel into one library (`cpu_build.py`); where that library is not
built, torch's flash attention serves (`cpu_attention.py`).
"""

from __future__ import annotations

import torch

from . import cpu_build

_SYMBOLS = {torch.float32: "paged_prefill_f32", torch.bfloat16: "paged_prefill_bf16"}
# Rows of one work item: query heads per KV head times at least one token (the C's MAX_ROWS).
_MAX_GROUP = 128


def available(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether prompt chunks of this dtype and head size will go through the kernel
    (building it now)."""
    return dtype in _SYMBOLS and head_dim % 16 == 0 and cpu_build.library() is not None


def supports(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the kernel can serve this layer's prompt chunks (and is built)."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    return (
        head_dim % 16 == 0
        and num_heads % num_kv_heads == 0
        and num_heads // num_kv_heads <= _MAX_GROUP
        and cpu_build.reads_in_place(query, k_cache)
    )


def paged_prefill(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    starts: torch.Tensor,  # [num_chunks] int32: each chunk's first row in query and out
    lens: torch.Tensor,  # [num_chunks] int32: its tokens
    cached: torch.Tensor,  # [num_chunks] int32: its sequence's tokens cached before it
    block_tables: torch.Tensor,  # [num_chunks, max_blocks] int32: its sequence's blocks
    scale: float,
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim], contiguous: the chunks' rows written
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads]: a logit per head with no value
) -> None:
    """Attend each chunk's queries over its context and itself, in place in the cache.

    `sliding_window` W: the query at position p reads keys p - W < j <= p only.
    `logits_soft_cap`: scores become cap * tanh(scores / cap) before the softmax.
    """
    lib = cpu_build.library()
    assert lib is not None, "call supports() first"
    _, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    for t in (starts, lens, cached):
        assert t.dtype == torch.int32 and t.is_contiguous()
    assert block_tables.dtype == torch.int32 and block_tables.stride(-1) == 1
    assert out.is_contiguous() and v_cache.is_contiguous() and v_cache.shape == k_cache.shape
    sinks = None if sinks is None else sinks.float().contiguous()
    failed = getattr(lib, _SYMBOLS[query.dtype])(
        query.data_ptr(), query.stride(0), query.stride(1),
        k_cache.data_ptr(), v_cache.data_ptr(),
        starts.data_ptr(), lens.data_ptr(), cached.data_ptr(),
        block_tables.data_ptr(), block_tables.stride(0),
        out.data_ptr(),
        starts.shape[0], num_heads, num_kv_heads, head_dim, block_size,
        scale, sliding_window or 0, logits_soft_cap or 0.0,
        None if sinks is None else sinks.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise MemoryError("the CPU prefill kernel could not allocate its buffers")
