"""Triton kernels for the paged KV cache (the CUDA path).

- `store_kv_cache`: one program per token copies its K and V rows into the
  cache slot its slot mapping names.
- `paged_decode_attention`: one query token per sequence. A program takes
  one (sequence, KV head, context split): it loads the queries of every head
  in that KV head's group at once (grouped-query attention without repeating
  K/V), walks its share of the sequence's keys through the block table with
  an online softmax, and writes a partial result (accumulator, running max,
  running sum). Its products run on `tl.dot` too, the group's rows padded to
  16: on an H200 that streams the cache at 89-94% of a device-to-device copy
  for 64-256 sequences (70% for 8 of 8k tokens), where products taken
  elementwise in fp32 registers reached 12-13% (benchmarks/results/gpu.md).
  A second small kernel merges the splits. Splitting the
  context (split-K) keeps the GPU busy when there are few sequences with long
  contexts. The split count is a compile-time constant, so it is picked from
  a few fixed buckets (`decode_num_splits`): a serving engine whose batch
  size changes every step compiles each bucket once and then never again.
- `paged_prefill_attention`: a chunk of queries per sequence (chunked
  prefill, prefix-cache hits) attending causally over the sequence's whole
  paged context, which already holds the chunk's own K/V. A program takes
  one (sequence, KV head, tile of query tokens) and stacks the queries of the
  whole GQA group into the rows of one tile (row r is query token
  r // GROUP_PAD, head r % GROUP_PAD of the group), so each K/V tile is loaded
  once per KV head rather than once per query head. Both products run on
  `tl.dot` with the cache's own dtype as input (tensor cores for bf16/fp16)
  and fp32 accumulation; fp32 caches use full-precision ("ieee") products, not
  TF32, so the fp32 path matches the reference.

Keys are walked in tiles of BLOCK_N consecutive positions, independent of the
cache block size: each key's cache row is found through the block table
entry of its own position (`_cache_rows`). A tile may span several small
blocks (block_size < 16 still gives `tl.dot` its 16-wide tiles) or lie inside
one large block.

Addressing: cache offsets are computed in int64. A block id from the int32
block table times the block's element count (block_size * kv_heads *
head_dim) passes 2^31 for caches above 2^31 elements per layer (4 GiB in
bf16), which real GPU caches reach; in int32 the product would wrap and
reads would land elsewhere than the store kernel (int64 slots) wrote.

Options (the reference's meanings, `paged_attention.py`): a sliding window W
(`window` > 0, USE_WINDOW) makes a program start at the key tile holding its
first query's first key (p - W + 1), mask keys at or before p - W row by row,
and load nothing before that first key (those blocks may be back in the
pool); a logit soft-cap c (USE_SOFT_CAP) maps scaled scores to
c * tanh(s / c) before the mask; attention sinks (USE_SINKS, one logit per
query head) start each row's running max and sum at (sink, 1), so the sink
joins the softmax's denominator with no value (in the decode, only the first
context split starts there: the merge then counts it once). All are off (and
compiled out) by default.

Accumulation is in fp32 whatever the cache dtype. The torch implementation in
`paged_attention.py` is the reference these are tested against (on CPU with
TRITON_INTERPRET=1).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Decode split counts the kernels are ever compiled for (NUM_SPLITS is a
# tl.constexpr): at most len(SPLIT_BUCKETS) variants per model shape.
SPLIT_BUCKETS = (1, 2, 4, 8, 16)
# Programs the split decode aims for: about two per SM of a large GPU (an
# H100/H200 has 132), so small batches with long contexts still fill it.
_DECODE_TARGET_PROGRAMS = 256
# Triton's CPU interpreter multiplies bf16 tiles as their raw uint16 bits
# (triton 3.9 `create_dot`), so under it bf16 products are taken in fp32 from
# the same bf16 values: the result a bf16 tensor-core product with fp32
# accumulation gives. On a GPU the bf16 tiles go to tl.dot as they are.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _dot_settings(dtype: torch.dtype) -> dict[str, object]:
    """`_dot`'s constants for a cache dtype: full-precision fp32 products (not TF32, so the
    fp32 path matches the reference); bf16 widened first under the interpreter."""
    return {
        "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32",
        "DOT_UPCAST": _INTERPRETED and dtype == torch.bfloat16,
    }


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b with fp32 accumulation; UPCAST: inputs widened to fp32 first (interpreter)."""
    if UPCAST:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b, input_precision=PRECISION)
    return out


@triton.jit
def _soft_cap(s, cap):
    """cap * tanh(s / cap), tanh written with exp (the interpreter has no libdevice)."""
    x = s / cap
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return cap * tl.where(x < 0, -t, t)


@triton.jit
def _cache_rows(
    table_ptr,  # this sequence's row of the block table
    pos,  # [BLOCK_N] key positions
    valid,  # [BLOCK_N] positions inside the context
    kv_head,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """Element offset (int64) of each key's row for `kv_head` in a [blocks, block_size, kv_heads, d] cache."""
    block = tl.load(table_ptr + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    slot = block * BLOCK_SIZE + pos % BLOCK_SIZE
    return slot * (NUM_KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM


@triton.jit
def _cache_rows_probe_kernel(
    table_ptr,
    out_ptr,
    ctx,
    kv_head,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # Only for tests: the attention kernels' cache addressing, written out.
    pos = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    valid = pos < ctx
    rows = _cache_rows(table_ptr, pos, valid, kv_head, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    tl.store(out_ptr + pos, rows, mask=valid)


def cache_row_offsets(
    block_table: torch.Tensor,  # [blocks] int32: one sequence's table
    context_len: int,
    block_size: int,
    kv_heads: int,
    head_dim: int,
    kv_head: int,
    block_n: int = 16,
) -> torch.Tensor:  # [context_len] int64
    """The element offset at which the kernels read each key of `kv_head` (for tests)."""
    out = torch.empty(context_len, dtype=torch.int64, device=block_table.device)
    _cache_rows_probe_kernel[(triton.cdiv(context_len, block_n),)](
        block_table,
        out,
        context_len,
        kv_head,
        BLOCK_SIZE=block_size,
        NUM_KV_HEADS=kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_N=block_n,
    )
    return out


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
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)  # int64 slots: offsets past 2^31 elements
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


def _check_shapes(query: torch.Tensor, k_cache: torch.Tensor) -> None:
    _check_cache(k_cache, k_cache)
    _, heads, d = query.shape
    _, block_size, kv_heads, cache_d = k_cache.shape
    assert cache_d == d and heads % kv_heads == 0, "query heads must be a multiple of KV heads"
    assert d & (d - 1) == 0 and d >= 16, "head_dim: a power of two >= 16"
    assert block_size & (block_size - 1) == 0, "block_size: a power of two"
    assert query.stride(2) == 1 and query.dtype == k_cache.dtype


def store_kv_cache(
    key: torch.Tensor,  # [num_tokens, kv_heads, d]
    value: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, d]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64
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


def decode_num_splits(num_seqs: int, kv_heads: int, max_context_len: int, block_n: int) -> int:
    """The context split count for a decode batch: always one of SPLIT_BUCKETS.

    As many splits as bring the launch to about _DECODE_TARGET_PROGRAMS
    programs, but no more than there are key tiles in the longest context.
    """
    programs = max(1, num_seqs * kv_heads)
    tiles = max(1, -(-max_context_len // block_n))
    want = min(_DECODE_TARGET_PROGRAMS // programs, tiles)
    return max(b for b in SPLIT_BUCKETS if b <= max(1, want))


# Decode keys per tile. Each tile is two tensor-core products, [ROWS, HEAD_DIM] x
# [HEAD_DIM, BLOCK_N] and back; 64 keys keep enough bytes in flight per program to stream
# the cache near its bandwidth (benchmarks/results/gpu.md, section 4).
DECODE_BLOCK_N = 64


def decode_rows(group_pad: int) -> int:
    """Rows of a decode program's query tile: the group's heads, padded to tl.dot's 16."""
    return max(16, group_pad)


# bt_stride is the block table's width, which changes from step to step:
# without do_not_specialize Triton would compile variants for its value's
# divisibility by 16 (and == 1).
@triton.jit(do_not_specialize=["bt_stride", "window"])
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
    window,
    soft_cap,
    sinks_ptr,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr,
    USE_SINKS: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(context_lens_ptr + seq)
    g = tl.arange(0, ROWS)
    d = tl.arange(0, HEAD_DIM)
    n = tl.arange(0, BLOCK_N)
    g_valid = g < GROUP
    heads = kv_head * GROUP + g
    # [ROWS, HEAD_DIM] in the cache dtype: the queries sharing this KV head, zero rows
    # below (tl.dot's tiles are at least 16 rows; a zero query row scores 0, stays finite
    # and is never stored).
    q = tl.load(
        q_ptr + seq.to(tl.int64) * q_stride_tok + heads[:, None] * q_stride_head + d[None, :],
        mask=g_valid[:, None],
        other=0.0,
    )
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    if USE_SINKS:  # the first split starts from the sink
        sink = tl.load(sinks_ptr + heads, mask=g_valid, other=0.0).to(tl.float32)
        m_i = tl.where(split == 0, sink, m_i)
        l_i = tl.where(split == 0, 1.0, l_i)
    acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
    # This split's share of this sequence's key tiles, from the one holding the
    # window's first key (an empty share leaves max -inf and sum 0, which the
    # merge weighs 0).
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(ctx - window, 0)
    first_tile = lo // BLOCK_N
    end_tile = tl.cdiv(ctx, BLOCK_N)
    per_split = tl.cdiv(end_tile - first_tile, NUM_SPLITS)
    first = first_tile + split * per_split
    last = tl.minimum(first + per_split, end_tile)
    table = block_tables_ptr + seq.to(tl.int64) * bt_stride
    for tile in range(first, last):
        pos = tile * BLOCK_N + n
        valid = (pos < ctx) & (pos >= lo)
        rows = _cache_rows(table, pos, valid, kv_head, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        k = tl.load(k_cache_ptr + rows[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(v_cache_ptr + rows[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        s = _dot(q, tl.trans(k), DOT_PRECISION, DOT_UPCAST) * scale  # fp32 [ROWS, BLOCK_N]
        if USE_SOFT_CAP:
            s = _soft_cap(s, soft_cap)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        # P in the cache dtype for the tensor cores, as the prefill kernel does.
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION, DOT_UPCAST)
        m_i = m_new
    # Only the group's GROUP_PAD rows go out (the partial buffers are laid out by them).
    out = ((seq * NUM_KV_HEADS + kv_head) * NUM_SPLITS + split) * GROUP_PAD
    keep = g < GROUP_PAD
    tl.store(part_acc_ptr + (out + g)[:, None] * HEAD_DIM + d[None, :], acc, mask=keep[:, None])
    tl.store(part_max_ptr + out + g, m_i, mask=keep)
    tl.store(part_sum_ptr + out + g, l_i, mask=keep)


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
        out_ptr + seq.to(tl.int64) * out_stride_tok + heads[:, None] * out_stride_head + d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=(g < GROUP)[:, None],
    )


def paged_decode_attention(
    query: torch.Tensor,  # [num_seqs, heads, d]: one query token per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, d]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32 or int64
    context_lens: torch.Tensor,  # [num_seqs] int32, >= 1
    scale: float,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,  # [>= num_seqs, heads, d]: rows 0..num_seqs-1 are written
    num_seqs: int | None = None,  # the first num_seqs rows of query/tables/lens (default: all)
    max_context_len: int | None = None,  # for the split count (default: the table's width)
    block_n: int = DECODE_BLOCK_N,  # keys per tile: a power of 2, >= 16
    num_warps: int = 4,
    num_stages: int = 2,
    sliding_window: int | None = None,  # keys p - W < j <= p only
    logits_soft_cap: float | None = None,  # scores -> cap * tanh(scores / cap)
    sinks: torch.Tensor | None = None,  # [heads] float32: a logit per head with no value
) -> torch.Tensor:  # out
    _check_cache(k_cache, v_cache)
    _check_shapes(query, k_cache)
    num_seqs = query.shape[0] if num_seqs is None else num_seqs
    _, heads, d = query.shape
    _, block_size, kv_heads, _ = k_cache.shape
    assert block_tables.shape[0] >= num_seqs and context_lens.shape[0] >= num_seqs
    assert block_tables.stride(1) == 1
    if out is None:
        out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    group = heads // kv_heads
    group_pad = triton.next_power_of_2(group)
    if num_splits is None:
        if max_context_len is None:
            max_context_len = block_tables.shape[1] * block_size
        if sliding_window is not None:
            max_context_len = min(max_context_len, sliding_window + block_n)
        num_splits = decode_num_splits(num_seqs, kv_heads, max_context_len, block_n)
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
        sliding_window or 0,
        logits_soft_cap or 0.0,
        part_max if sinks is None else sinks.float().contiguous(),
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
        USE_WINDOW=sliding_window is not None,
        USE_SOFT_CAP=logits_soft_cap is not None,
        USE_SINKS=sinks is not None,
        ROWS=decode_rows(group_pad),
        **_dot_settings(query.dtype),
        num_warps=num_warps,
        num_stages=num_stages,
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


# first_seq is the number of decodes before the chunks in the step's tables;
# like the table width it changes every step and must not be specialized on.
@triton.jit(do_not_specialize=["bt_stride", "first_seq", "window"])
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
    first_seq,
    window,
    soft_cap,
    sinks_ptr,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,  # query tokens per tile; the tile has BLOCK_M * GROUP_PAD rows
    BLOCK_N: tl.constexpr,  # keys per tile
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr,
    USE_SINKS: tl.constexpr,
):
    seq = first_seq + tl.program_id(0)
    kv_head = tl.program_id(1)
    m_block = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if m_block * BLOCK_M >= q_len:
        return
    ctx = tl.load(context_lens_ptr + seq)
    r = tl.arange(0, BLOCK_M * GROUP_PAD)
    tok = m_block * BLOCK_M + r // GROUP_PAD  # query token (within the chunk) of each row
    g = r % GROUP_PAD  # and its head within the group
    row_valid = (tok < q_len) & (g < GROUP)
    q_pos = ctx - q_len + tok  # absolute positions of the rows' queries
    head = kv_head * GROUP + g
    d = tl.arange(0, HEAD_DIM)
    n = tl.arange(0, BLOCK_N)
    token = (q_start + tok).to(tl.int64)
    # [BLOCK_M * GROUP_PAD, HEAD_DIM] in the cache dtype: tl.dot's input.
    q = tl.load(
        q_ptr + token[:, None] * q_stride_tok + head[:, None] * q_stride_head + d[None, :],
        mask=row_valid[:, None],
        other=0.0,
    )
    m_i = tl.full([BLOCK_M * GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M * GROUP_PAD], tl.float32)
    if USE_SINKS:
        m_i = tl.load(sinks_ptr + head, mask=g < GROUP, other=0.0).to(tl.float32)
        l_i = tl.full([BLOCK_M * GROUP_PAD], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_M * GROUP_PAD, HEAD_DIM], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * bt_stride
    # Keys up to the last query of this tile (causal), from the first query's window.
    last_pos = tl.minimum(ctx - q_len + (m_block + 1) * BLOCK_M, ctx)
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(ctx - q_len + m_block * BLOCK_M - window + 1, 0)
    for tile in range(lo // BLOCK_N, tl.cdiv(last_pos, BLOCK_N)):
        pos = tile * BLOCK_N + n
        valid = (pos < ctx) & (pos >= lo)
        rows = _cache_rows(table, pos, valid, kv_head, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        k = tl.load(k_cache_ptr + rows[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(v_cache_ptr + rows[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        s = _dot(q, tl.trans(k), DOT_PRECISION, DOT_UPCAST) * scale  # fp32 [rows, BLOCK_N]
        if USE_SOFT_CAP:
            s = _soft_cap(s, soft_cap)
        visible = (pos[None, :] <= q_pos[:, None]) & valid[None, :]
        if USE_WINDOW:
            visible = visible & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        # P in the cache dtype for the tensor cores, as FlashAttention does.
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION, DOT_UPCAST)
        m_i = m_new
    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr + token[:, None] * o_stride_tok + head[:, None] * o_stride_head + d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None],
    )


def prefill_block_m(group_pad: int) -> int:
    """Query tokens per prefill tile: the tile stacks the group's heads, 64 rows in all."""
    return max(1, 64 // group_pad)


def paged_prefill_attention(
    query: torch.Tensor,  # [num_tokens, heads, d]: each sequence's chunk, back to back
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, d], chunk K/V already stored
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [first_seq + num_seqs, max_blocks]
    query_start_loc: torch.Tensor,  # [first_seq + num_seqs + 1]: rows of query
    context_lens: torch.Tensor,  # [first_seq + num_seqs]: cached context + chunk
    max_query_len: int,
    scale: float,
    block_m: int | None = None,
    out: torch.Tensor | None = None,  # [num_tokens, heads, d]: the chunks' rows are written
    first_seq: int = 0,  # sequences before this one (decodes) are skipped
    sliding_window: int | None = None,  # keys p - W < j <= p only
    logits_soft_cap: float | None = None,  # scores -> cap * tanh(scores / cap)
    sinks: torch.Tensor | None = None,  # [heads] float32: a logit per head with no value
) -> torch.Tensor:  # out
    _check_cache(k_cache, v_cache)
    _check_shapes(query, k_cache)
    _, heads, d = query.shape
    _, block_size, kv_heads, _ = k_cache.shape
    num_seqs = context_lens.shape[0] - first_seq
    assert query_start_loc.shape == (context_lens.shape[0] + 1,)
    assert block_tables.shape[0] == context_lens.shape[0] and block_tables.stride(1) == 1
    if out is None:
        out = torch.empty_like(query)
    if num_seqs <= 0:
        return out
    group = heads // kv_heads
    group_pad = triton.next_power_of_2(group)
    block_m = block_m or prefill_block_m(group_pad)
    assert block_m & (block_m - 1) == 0 and block_m * group_pad >= 16, (
        "tl.dot tiles need block_m * group_pad >= 16 rows"
    )
    # Keys per tile: tl.dot needs >= 16; up to 64 (a tile may lie inside a larger block).
    block_n = min(max(block_size, 16), 64)
    grid = (num_seqs, kv_heads, triton.cdiv(max_query_len, block_m))
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
        first_seq,
        sliding_window or 0,
        logits_soft_cap or 0.0,
        out if sinks is None else sinks.float().contiguous(),
        NUM_KV_HEADS=kv_heads,
        GROUP=group,
        GROUP_PAD=group_pad,
        HEAD_DIM=d,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        USE_WINDOW=sliding_window is not None,
        USE_SOFT_CAP=logits_soft_cap is not None,
        USE_SINKS=sinks is not None,
        **_dot_settings(query.dtype),
    )
    return out
