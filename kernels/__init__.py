"""Attention kernels: write K/V into the paged cache and attend through block tables.

Dispatch by device lives here and nowhere else: the torch implementation in
`paged_attention.py` is the CPU path and the reference every other kernel is
tested against.
"""

from __future__ import annotations

from .paged_attention import (
    AttentionMetadata,
    build_attention_metadata,
)
from .paged_attention import paged_attention as _torch_paged_attention
from .paged_attention import store_kv_cache as _torch_store_kv_cache

__all__ = ["AttentionMetadata", "build_attention_metadata", "paged_attention", "store_kv_cache"]


def store_kv_cache(key, value, k_cache, v_cache, slot_mapping) -> None:
    """Write this step's K/V ([num_tokens, kv_heads, head_dim]) into the cache."""
    _torch_store_kv_cache(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(query, k_cache, v_cache, meta: AttentionMetadata, scale: float):
    """Attend this step's queries ([num_tokens, heads, head_dim]) over their paged context."""
    return _torch_paged_attention(query, k_cache, v_cache, meta, scale)
