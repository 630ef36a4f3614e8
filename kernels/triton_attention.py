"""Triton kernels for the paged KV cache (the CUDA path).

- `store_kv_cache`: one program per token copies its K and V rows into the
  cache slot its slot mapping names.
- `paged_decode_attention`: one query token per sequence. A program takes
  one (sequence, KV head, context split): it loads the queries of every head
  in that KV head's group at once (grouped-query attention without repeating
  K/V), walks its share of the sequence's blocks through the block table
  with an online softmax, and writes a partial result (accumulator, running
  max, running sum). A second small kernel merges the splits. Splitting the
  context (split-K) keeps the GPU busy when there are few sequences with long
  contexts.
- `paged_prefill_attention`: a chunk of queries per sequence (chunked
  prefill, prefix-cache hits) attending causally over the sequence's whole
  paged context, which already holds the chunk's own K/V.

Accumulation is in fp32 whatever the cache dtype. The torch implementation in
`paged_attention.py` is the reference these are tested against (on CPU with
TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    row_stride_k,
    row_stride_v,
    ROW: tl.constexpr,
    ROW_PAD: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token)
    offs = tl.arange(0, ROW_PAD)
    mask = offs < ROW
    k = tl.load(key_ptr + token * row_stride_k + offs, mask=mask)
    v = tl.load(value_ptr + token * row_stride_v + offs, mask=mask)
    tl.store(k_cache_ptr + slot * ROW + offs, k, mask=mask)
    tl.store(v_cache_ptr + slot * ROW + offs, v, mask=mask)


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    assert k_cache.shape == v_cache.shape and k_cache.dim() == 4, (
        "cache: [blocks, block_size, kv_heads, d]"
    )
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "caches must be contiguous"
    assert k_cache.dtype == v_cache.dtype


def store_kv_cache(
    key: torch.Tensor,  # [num_tokens, kv_heads, d]
    value: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, d]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens]
) -> None:
    _check_cache(k_cache, v_cache)
    n, kv_heads, d = key.shape
    assert value.shape == key.shape and k_cache.shape[2:] == (kv_heads, d), (
        "K/V shape does not match the cache"
    )
    assert key.dtype == k_cache.dtype and value.dtype == v_cache.dtype, (
        "K/V dtype must match the cache"
    )
    assert (
        key.stride(2) == 1 and key.stride(1) == d and value.stride(2) == 1 and value.stride(1) == d
    )
    assert slot_mapping.shape == (n,)
    if n == 0:
        return
    row = kv_heads * d
    _store_kv_kernel[(n,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        value.stride(0),
        ROW=row,
        ROW_PAD=triton.next_power_of_2(row),
    )


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    scale,
    q_stride_tok,
    q_stride_head,
    bt_stride,
    max_blocks,
    blocks_per_split,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(context_lens_ptr + seq)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    t = tl.arange(0, BLOCK_SIZE)
    g_valid = g < GROUP
    heads = kv_head * GROUP + g
    # [GROUP_PAD, HEAD_DIM]: the queries sharing this KV head.
    q = tl.load(
        q_ptr + seq * q_stride_tok + heads[:, None] * q_stride_head + d[None, :],
        mask=g_valid[:, None],
        other=0.0,
    ).to(tl.float32)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    first = split * blocks_per_split
    num_blocks = tl.cdiv(ctx, BLOCK_SIZE)
    last = tl.minimum(first + blocks_per_split, num_blocks)
    for b in range(first, last):
        block = tl.load(block_tables_ptr + seq * bt_stride + b)
        pos = b * BLOCK_SIZE + t
        valid = pos < ctx
        base = (
            (block * BLOCK_SIZE + t)[:, None] * (NUM_KV_HEADS * HEAD_DIM)
            + kv_head * HEAD_DIM
            + d[None, :]
        )
        k = tl.load(k_cache_ptr + base, mask=valid[:, None], other=0.0).to(tl.float32)  # [BS, D]
        v = tl.load(v_cache_ptr + base, mask=valid[:, None], other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [GROUP_PAD, BS]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new
    out = ((seq * NUM_KV_HEADS + kv_head) * NUM_SPLITS + split) * GROUP_PAD
    tl.store(part_acc_ptr + (out + g)[:, None] * HEAD_DIM + d[None, :], acc)
    tl.store(part_max_ptr + out + g, m_i)
    tl.store(part_sum_ptr + out + g, l_i)


@triton.jit
def _decode_merge_kernel(
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    out_ptr,
    out_stride_tok,
    out_stride_head,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    base = (seq * NUM_KV_HEADS + kv_head) * NUM_SPLITS * GROUP_PAD
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    for s in range(NUM_SPLITS):
        m = tl.maximum(m, tl.load(part_max_ptr + base + s * GROUP_PAD + g))
    total = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for s in range(NUM_SPLITS):
        row = base + s * GROUP_PAD + g
        m_s = tl.load(part_max_ptr + row)
        # Empty splits have max -inf and sum 0: weight 0.
        w = tl.where(m_s == float("-inf"), 0.0, tl.exp(m_s - m))
        total += w * tl.load(part_sum_ptr + row)
        acc += w[:, None] * tl.load(part_acc_ptr + row[:, None] * HEAD_DIM + d[None, :])
    o = acc / total[:, None]
    heads = kv_head * GROUP + g
    tl.store(
        out_ptr + seq * out_stride_tok + heads[:, None] * out_stride_head + d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=(g < GROUP)[:, None],
    )


def paged_decode_attention(
    query: torch.Tensor,  # [num_seqs, heads, d]: one query token per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, d]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int
    context_lens: torch.Tensor,  # [num_seqs] int, >= 1
    scale: float,
    num_splits: int | None = None,
) -> torch.Tensor:  # [num_seqs, heads, d]
    _check_cache(k_cache, v_cache)
    num_seqs, heads, d = query.shape
    _, block_size, kv_heads, cache_d = k_cache.shape
    assert cache_d == d and heads % kv_heads == 0, "query heads must be a multiple of KV heads"
    assert d & (d - 1) == 0 and block_size & (block_size - 1) == 0, (
        "head_dim and block_size: powers of two"
    )
    assert query.stride(2) == 1 and query.dtype == k_cache.dtype
    assert block_tables.shape[0] == num_seqs and context_lens.shape == (num_seqs,)
    assert block_tables.stride(1) == 1
    out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    max_blocks = block_tables.shape[1]
    if num_splits is None:
        # Enough programs to fill a GPU's SMs when the batch is small.
        num_splits = max(1, min(max_blocks, 128 // max(1, num_seqs * kv_heads)))
    blocks_per_split = -(-max_blocks // num_splits)
    group = heads // kv_heads
    group_pad = max(triton.next_power_of_2(group), 1)
    parts = num_seqs * kv_heads * num_splits * group_pad
    part_acc = torch.empty(parts, d, dtype=torch.float32, device=query.device)
    part_max = torch.empty(parts, dtype=torch.float32, device=query.device)
    part_sum = torch.empty(parts, dtype=torch.float32, device=query.device)
    meta = dict(NUM_KV_HEADS=kv_heads, GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=d)
    _decode_split_kernel[(num_seqs, kv_heads, num_splits)](
        query,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        part_acc,
        part_max,
        part_sum,
        scale,
        query.stride(0),
        query.stride(1),
        block_tables.stride(0),
        max_blocks,
        blocks_per_split,
        BLOCK_SIZE=block_size,
        NUM_SPLITS=num_splits,
        **meta,
    )
    _decode_merge_kernel[(num_seqs, kv_heads)](
        part_acc,
        part_max,
        part_sum,
        out,
        out.stride(0),
        out.stride(1),
        NUM_SPLITS=num_splits,
        **meta,
    )
    return out


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    query_start_ptr,
    context_lens_ptr,
    scale,
    q_stride_tok,
    q_stride_head,
    o_stride_tok,
    o_stride_head,
    bt_stride,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    m_block = tl.program_id(2)
    kv_head = head // GROUP
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if m_block * BLOCK_M >= q_len:
        return
    ctx = tl.load(context_lens_ptr + seq)
    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_valid = rows < q_len
    q_pos = ctx - q_len + rows  # absolute positions of these queries
    d = tl.arange(0, HEAD_DIM)
    t = tl.arange(0, BLOCK_SIZE)
    q = tl.load(
        q_ptr + (q_start + rows)[:, None] * q_stride_tok + head * q_stride_head + d[None, :],
        mask=row_valid[:, None],
        other=0.0,
    ).to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # Keys up to the last query of this tile (causal).
    last_pos = tl.minimum(ctx - q_len + (m_block + 1) * BLOCK_M, ctx)
    for b in range(0, tl.cdiv(last_pos, BLOCK_SIZE)):
        block = tl.load(block_tables_ptr + seq * bt_stride + b)
        pos = b * BLOCK_SIZE + t
        base = (
            (block * BLOCK_SIZE + t)[:, None] * (NUM_KV_HEADS * HEAD_DIM)
            + kv_head * HEAD_DIM
            + d[None, :]
        )
        k = tl.load(k_cache_ptr + base, mask=(pos < ctx)[:, None], other=0.0).to(tl.float32)
        v = tl.load(v_cache_ptr + base, mask=(pos < ctx)[:, None], other=0.0).to(tl.float32)
        # Full fp32 products ("ieee"), not TF32: this path must match the reference.
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [BLOCK_M, BS]
        visible = (pos[None, :] <= q_pos[:, None]) & (pos[None, :] < ctx)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new
    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr + (q_start + rows)[:, None] * o_stride_tok + head * o_stride_head + d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None],
    )


def paged_prefill_attention(
    query: torch.Tensor,  # [num_tokens, heads, d]: each sequence's chunk, back to back
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, d], chunk K/V already stored
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks]
    query_start_loc: torch.Tensor,  # [num_seqs + 1]
    context_lens: torch.Tensor,  # [num_seqs]: cached context + chunk
    max_query_len: int,
    scale: float,
    block_m: int = 16,
) -> torch.Tensor:
    _check_cache(k_cache, v_cache)
    _, heads, d = query.shape
    _, block_size, kv_heads, cache_d = k_cache.shape
    num_seqs = context_lens.shape[0]
    assert cache_d == d and heads % kv_heads == 0, "query heads must be a multiple of KV heads"
    assert d & (d - 1) == 0 and block_size & (block_size - 1) == 0, (
        "head_dim and block_size: powers of two"
    )
    assert query.stride(2) == 1 and query.dtype == k_cache.dtype
    assert query_start_loc.shape == (num_seqs + 1,) and block_tables.shape[0] == num_seqs
    assert block_size >= 16 and block_m >= 16, "tl.dot tiles need block_size and block_m >= 16"
    out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    grid = (num_seqs, heads, triton.cdiv(max_query_len, block_m))
    _prefill_kernel[grid](
        query,
        k_cache,
        v_cache,
        out,
        block_tables,
        query_start_loc,
        context_lens,
        scale,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        NUM_KV_HEADS=kv_heads,
        GROUP=heads // kv_heads,
        HEAD_DIM=d,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
    )
    return out
