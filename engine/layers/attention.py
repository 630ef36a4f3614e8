from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagefleet.kernels import AttentionMetadata, paged_attention, store_kv_cache


@dataclass
class ForwardContext:
    """What every attention layer needs for one step besides its inputs."""

    meta: AttentionMetadata
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (k_cache, v_cache)


class Attention(nn.Module):
    """Writes this step's K/V into layer `layer_idx`'s paged cache, then attends."""

    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        # q: [num_tokens, heads, head_dim]; k, v: [num_tokens, kv_heads, head_dim]
        k_cache, v_cache = ctx.kv_caches[self.layer_idx]
        store_kv_cache(k, v, k_cache, v_cache, ctx.meta.slot_mapping)
        return paged_attention(q, k_cache, v_cache, ctx.meta, self.scale)
