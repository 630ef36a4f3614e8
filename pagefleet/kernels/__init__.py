"""Attention kernels: write K/V into the paged cache and attend through block tables.

Dispatch by device lives here and nowhere else: CUDA tensors go to the Triton
kernels (`triton_attention.py`); everything else to the CPU path
(`cpu_attention.py`: C decode and prefill kernels that read the cache in place,
built on first use by `cpu_build.py`; torch's flash attention per prompt chunk
where the prefill kernel is not built), which falls back, part by part, to the torch
implementation (`paged_attention.py`): the reference every other path is
tested against.

`paged_attention`'s per-layer options, the same on every path:
`sliding_window` W (a query at position p sees keys p - W < j <= p, as
transformers' sliding masks), `logits_soft_cap` c (scaled scores become
c * tanh(s / c) before the softmax) and `sinks` ([num_heads] float32: a logit
per query head in the softmax's denominator, with no value; gpt-oss).
"""

from __future__ import annotations

import torch

from . import paged_attention as _torch_impl
from .cpu_attention import cpu_paged_attention
from .paged_attention import AttentionMetadata, build_attention_metadata

__all__ = ["AttentionMetadata", "build_attention_metadata", "paged_attention", "store_kv_cache"]


def store_kv_cache(
    key: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    value: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens]
) -> None:
    if key.is_cuda:
        from . import triton_attention

        triton_attention.store_kv_cache(key, value, k_cache, v_cache, slot_mapping)
    else:
        _torch_impl.store_kv_cache(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_tokens, heads, head_dim]
    opts = (sliding_window, logits_soft_cap, sinks)
    if query.is_cuda:
        return triton_paged_attention(query, k_cache, v_cache, meta, scale, *opts)
    return cpu_paged_attention(query, k_cache, v_cache, meta, scale, *opts)


def triton_paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The Triton path for a whole step: decodes with the split-K kernel, chunks with the prefill kernel."""
    from . import triton_attention

    nd = meta.num_decode_tokens
    # One output buffer: decodes write its first rows, chunks the rest (no concatenation).
    out = torch.empty_like(query)
    if nd:
        triton_attention.paged_decode_attention(
            query,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.context_lens,
            scale,
            out=out,
            num_seqs=nd,
            max_context_len=meta.max_decode_context_len,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
            sinks=sinks,
        )
    if meta.num_prefills:
        triton_attention.paged_prefill_attention(
            query,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.query_start_loc,
            meta.context_lens,
            meta.max_query_len,
            scale,
            out=out,
            first_seq=nd,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
            sinks=sinks,
        )
    return out
