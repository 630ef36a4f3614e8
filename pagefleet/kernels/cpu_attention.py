"""Paged attention on the CPU: C kernels reading the cache in place, torch where not built.

The torch reference (`paged_attention.py`) attends every group in one padded,
masked call over K/V gathered out of the cache. That is simple and exact, but
at long contexts it spends most of a step on work that is not attention (the
step profile in BENCHMARKS.md: 68% of a decode step at 1,230 tokens of
context, 39% of a 1,200-token prefill):

- Decodes: the gather copies each sequence's whole context in every layer.
  Here the C kernel (`cpu_paged_decode.c`) walks the block table and reads each
  cached row once; where it is not built, the reference serves.
- Prompt chunks: a padded mask makes SDPA compute the masked-out half of the
  causal product too, and the mask itself is as large as the scores. Here
  every chunk of the step goes through one call of the prefill C kernel
  (`cpu_paged_prefill.c`: flash style, over the cached context and the chunk
  in one pass, reading the cache in place, the upper triangle skipped; 1.4x
  torch's flash on a 1,200-token prompt, BENCHMARKS.md). Where it is not
  built, each chunk is attended on its own through torch's CPU flash-attention
  kernel, in two parts: its queries over the context cached before it (no
  mask: every cached key is visible to every query) and over the chunk itself
  (causal, so the kernel skips the upper triangle). The two partial results
  are merged by their log-sum-exps, which makes the result exactly the softmax
  over both:

      m = max(lse_a, lse_b);  w_x = exp(lse_x - m)
      out = (out_a * w_a + out_b * w_b) / (w_a + w_b)

  A chunk with nothing cached before it (a fresh prompt) is one causal call.
  Steps whose chunks are all very short (a burst of prompts of a few tokens)
  are cheaper in the reference's one batched call than in a call each, so they
  go there.

The step's K/V are already in the cache when this runs (`attend` stores them
first), so a chunk's own keys are read back by slot: O(chunk), not O(context).

A sliding window, a logit soft-cap or attention sinks (the options of
`paged_attention.py`) are taken by both C kernels; where the prefill kernel is
not built, chunks with any of them go to the reference (torch's flash kernel
takes none).
"""

from __future__ import annotations

import torch

from . import cpu_paged_decode, cpu_paged_prefill
from . import paged_attention as reference
from .paged_attention import AttentionMetadata

# Without the prefill kernel, a step's chunks go through the per-chunk flash path
# when the longest is at least this long; below it, a call per chunk costs more than
# the padded batched call of the reference. The prefill kernel takes every chunk,
# short ones too: one call for all of them.
FLASH_MIN_CHUNK = 16

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def cpu_paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    nd = meta.num_decode_tokens
    opts = (sliding_window, logits_soft_cap, sinks)
    plain = sliding_window is None and logits_soft_cap is None and sinks is None
    in_place = nd > 0 and cpu_paged_decode.supports(query, k_cache)
    kernel = meta.num_prefills > 0 and cpu_paged_prefill.supports(query, k_cache)
    flash = plain and meta.num_prefills > 0 and not kernel and meta.max_query_len >= FLASH_MIN_CHUNK
    if not in_place and not kernel and not flash:
        return reference.paged_attention(query, k_cache, v_cache, meta, scale, *opts)
    out = torch.empty(query.shape, dtype=query.dtype)
    if nd:
        if in_place:
            cpu_paged_decode.paged_decode(
                query[:nd], k_cache, v_cache, meta.block_tables, meta.context_lens, scale,
                out[:nd], *opts,
            )  # fmt: skip
        else:
            out[:nd] = reference.attend_decodes(query, k_cache, v_cache, meta, scale, *opts)
    if meta.num_prefills:
        if kernel:
            starts, lens, cached = meta.chunk_arrays()
            tables = meta.block_tables[nd:]
            cpu_paged_prefill.paged_prefill(
                query, k_cache, v_cache, starts, lens, cached, tables, scale, out, *opts
            )
        elif flash:
            _chunks_by_flash(query, k_cache, v_cache, meta, scale, out)
        else:
            out[nd:] = reference.attend_chunks(query, k_cache, v_cache, meta, scale, *opts)
    return out


def _chunks_by_flash(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]: the chunks' rows written
) -> None:
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    k_rows = k_cache.view(-1, num_kv_heads, head_dim)  # [slots, kv_heads, d]
    v_rows = v_cache.view(-1, num_kv_heads, head_dim)
    for i, (start, end, cached) in enumerate(meta.chunk_spans(), meta.num_decode_tokens):
        # [1, heads, q_len, d] and [1, kv_heads, len, d] views (the kernel reads strides).
        q = query[start:end].transpose(0, 1).unsqueeze(0)
        slots = meta.slot_mapping[start:end]
        k_own = k_rows.index_select(0, slots).transpose(0, 1).unsqueeze(0)
        v_own = v_rows.index_select(0, slots).transpose(0, 1).unsqueeze(0)
        o, lse = _flash(q, k_own, v_own, 0.0, True, scale=scale)  # lse: [1, heads, q_len]
        if cached:
            blocks = meta.block_tables[i, : -(-cached // block_size)].to(torch.int64)
            k_ctx = _context(k_cache, blocks, cached)
            v_ctx = _context(v_cache, blocks, cached)
            o_ctx, lse_ctx = _flash(q, k_ctx, v_ctx, 0.0, False, scale=scale)
            o = _merge(o, lse, o_ctx, lse_ctx)
        out[start:end] = o[0].transpose(0, 1)


def _context(cache: torch.Tensor, blocks: torch.Tensor, length: int) -> torch.Tensor:
    # [blocks, block_size, kv_heads, d] -> [1, kv_heads, length, d]
    rows = cache.index_select(0, blocks).flatten(0, 1)[:length]
    return rows.transpose(0, 1).unsqueeze(0)


def _merge(
    o_a: torch.Tensor,  # [1, heads, q_len, d]
    lse_a: torch.Tensor,  # [1, heads, q_len] float32
    o_b: torch.Tensor,
    lse_b: torch.Tensor,
) -> torch.Tensor:
    m = torch.maximum(lse_a, lse_b)
    w_a = (lse_a - m).exp_().unsqueeze(-1)
    w_b = (lse_b - m).exp_().unsqueeze(-1)
    merged = (o_a.float() * w_a + o_b.float() * w_b) / (w_a + w_b)
    return merged.to(o_a.dtype)
