"""The torch paged-attention path against dense per-sequence attention in float64."""

from __future__ import annotations

import pytest
import torch

from pagefleet.kernels import build_attention_metadata, paged_attention, store_kv_cache


def dense_reference(q, k, v, q_len, ctx_len, scale):
    # q: [q_len, H, D]; k, v: [ctx_len, Hkv, D]; query i sits at position ctx_len - q_len + i.
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1).double()
    v = v.repeat_interleave(group, dim=1).double()
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    q_pos = torch.arange(ctx_len - q_len, ctx_len).view(-1, 1)
    causal = torch.arange(ctx_len).view(1, -1) <= q_pos
    scores = scores.masked_fill(~causal, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (6, 2), (8, 2)])
def test_matches_dense_attention_on_ragged_batches(
    block_size: int, heads: int, kv_heads: int
) -> None:
    torch.manual_seed(0)
    d = 16
    # (query_len, context_len): decodes first, then prompt chunks with and without cached context.
    shapes = [
        (1, 1),
        (1, block_size),
        (1, block_size + 1),
        (1, 37),
        (5, 5),
        (3, 2 * block_size),
        (block_size, block_size + 3),
        (9, 9),
    ]
    num_blocks = 64
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, d)
    v_cache = torch.zeros(num_blocks, block_size, kv_heads, d)
    free = torch.randperm(num_blocks).tolist()
    tables, full_k, full_v, queries = [], [], [], []
    for q_len, ctx in shapes:
        tables.append([free.pop() for _ in range(-(-ctx // block_size))])
        full_k.append(torch.randn(ctx, kv_heads, d))
        full_v.append(torch.randn(ctx, kv_heads, d))
        queries.append(torch.randn(q_len, heads, d))
    # The cached context (all but each chunk) is already in the cache.
    prior = build_attention_metadata(
        [c - q for q, c in shapes if c > q],
        [c - q for q, c in shapes if c > q],
        [t for (q, c), t in zip(shapes, tables, strict=True) if c > q],
        block_size,
    )
    store_kv_cache(
        torch.cat([k[: c - q] for (q, c), k in zip(shapes, full_k, strict=True)]),
        torch.cat([v[: c - q] for (q, c), v in zip(shapes, full_v, strict=True)]),
        k_cache,
        v_cache,
        prior.slot_mapping,
    )
    meta = build_attention_metadata(
        [q for q, _ in shapes], [c for _, c in shapes], tables, block_size
    )
    new_k = torch.cat([k[c - q :] for (q, c), k in zip(shapes, full_k, strict=True)])
    new_v = torch.cat([v[c - q :] for (q, c), v in zip(shapes, full_v, strict=True)])
    store_kv_cache(new_k, new_v, k_cache, v_cache, meta.slot_mapping)
    out = paged_attention(torch.cat(queries), k_cache, v_cache, meta, scale=d**-0.5)
    start = 0
    for (q_len, ctx), q, k, v in zip(shapes, queries, full_k, full_v, strict=True):
        ref = dense_reference(q, k, v, q_len, ctx, d**-0.5)
        torch.testing.assert_close(out[start : start + q_len].double(), ref, atol=1e-5, rtol=1e-5)
        start += q_len


def test_slot_mapping_follows_block_tables() -> None:
    meta = build_attention_metadata([1, 3], [6, 3], [[7, 2], [5]], block_size=4)
    # seq 0 writes position 5 -> block 2, offset 1; seq 1 writes positions 0..2 of block 5.
    assert meta.slot_mapping.tolist() == [2 * 4 + 1, 20, 21, 22]
    assert meta.num_decode_tokens == 1


def test_single_token_sequences_must_come_first() -> None:
    with pytest.raises(ValueError, match="first"):
        build_attention_metadata([3, 1], [3, 4], [[0], [1]], block_size=4)


def test_plain_layout_without_padded_layouts() -> None:
    """`padded=False` (the CUDA path) builds only what the Triton kernels read."""
    meta = build_attention_metadata(
        [1, 1, 3, 2], [6, 1, 3, 7], [[7, 2], [4], [5], [0, 1]], 4, padded=False
    )
    assert meta.slot_mapping.tolist() == [2 * 4 + 1, 4 * 4, 20, 21, 22, 1 * 4 + 1, 1 * 4 + 2]
    assert meta.block_tables.dtype == torch.int32
    assert meta.block_tables.tolist() == [[7, 2], [4, 0], [5, 0], [0, 1]]
    assert meta.context_lens.tolist() == [6, 1, 3, 7]
    assert meta.query_start_loc.tolist() == [0, 1, 2, 5, 7]
    assert (meta.num_decode_tokens, meta.num_prefills) == (2, 2)
    assert (meta.max_query_len, meta.max_decode_context_len) == (3, 6)
    assert not meta.padded
    assert meta.decode_mask is None and meta.prefill_mask is None
    assert meta.decode_block_tables is None and meta.prefill_block_tables is None


def test_padded_layouts() -> None:
    meta = build_attention_metadata([1, 3, 2], [6, 3, 7], [[7, 2], [5], [0, 1]], block_size=4)
    assert meta.padded
    assert meta.decode_block_tables.tolist() == [[7, 2]]
    assert meta.decode_mask.view(-1).tolist() == [True] * 6 + [False] * 2
    assert meta.prefill_block_tables.tolist() == [[5, 0], [0, 1]]
    assert meta.prefill_query_index.tolist() == [[0, 1, 2], [3, 4, 0]]
    assert meta.prefill_query_valid.tolist() == [[True, True, True], [True, True, False]]
    mask = meta.prefill_mask[:, 0].int().tolist()
    # Chunk 0: positions 0..2 causal. Chunk 1: queries at 5 and 6, then a padding query
    # (position 7, past the context: it sees every real key; its output is discarded).
    assert mask[0] == [[1, 0, 0, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0, 0]]
    assert mask[1] == [[1, 1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1, 0]]
