from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from pagefleet.kernels import AttentionMetadata, paged_attention, store_kv_cache

if TYPE_CHECKING:
    from .cpu_gemm import PackedWeight


@dataclass
class ForwardContext:
    """What every attention layer needs for one step besides its inputs.

    `packed_weights` are the model's pre-packed CPU GEMM weights by slot
    (`PackedWeight.slot`): a compiled forward reaches them, like the KV
    caches, through this context rather than as graph inputs (see
    `pagefleet/engine/custom_ops.py`).
    """

    meta: AttentionMetadata
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (k_cache, v_cache)
    packed_weights: list[PackedWeight] = field(default_factory=list)


_current: ForwardContext | None = None


@contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[None]:
    """Make `ctx` the step's context for the custom ops a compiled forward calls."""
    global _current
    previous, _current = _current, ctx
    try:
        yield
    finally:
        _current = previous


def current_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("no forward context: a compiled forward runs inside forward_context()")
    return _current


def attend(
    layer_idx: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ctx: ForwardContext,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Store this step's K/V in layer `layer_idx`'s paged cache, then attend over it."""
    k_cache, v_cache = ctx.kv_caches[layer_idx]
    store_kv_cache(k, v, k_cache, v_cache, ctx.meta.slot_mapping)
    return paged_attention(
        q, k_cache, v_cache, ctx.meta, scale, sliding_window, logits_soft_cap, sinks
    )


class Attention(nn.Module):
    """Writes this step's K/V into layer `layer_idx`'s paged cache, then attends.

    Eager (a context given): the kernels are called directly. Compiled (no
    context: the model runs under `forward_context`): through the
    `pagefleet::attention` custom op, which the compiler keeps as one opaque
    call, so the step's layout never enters the graph.

    Per layer: `scale` (head_dim ** -0.5 unless given: Gemma's
    query_pre_attn_scalar ** -0.5), `sliding_window` (a query at position p
    sees keys p - W < j <= p; None: all before it) and `logits_soft_cap`
    (scores -> cap * tanh(scores / cap); None: off). `forward`'s `sinks`
    ([this rank's heads] float32, the model's parameter; None: off): a logit per
    head in the softmax's denominator with no value (gpt-oss).
    """

    def __init__(
        self,
        layer_idx: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float | None = None,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ctx: ForwardContext | None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # q: [num_tokens, heads, head_dim]; k, v: [num_tokens, kv_heads, head_dim]
        opts = (self.sliding_window, self.logits_soft_cap, sinks)
        if ctx is None:
            return torch.ops.pagefleet.attention(q, k, v, self.layer_idx, self.scale, *opts)
        return attend(self.layer_idx, q, k, v, ctx, self.scale, *opts)
