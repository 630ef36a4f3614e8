"""Triton kernels against the torch reference, in Triton's interpreter on CPU (TRITON_INTERPRET=1)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is in the dev extra")

from pagefleet.kernels import build_attention_metadata, triton_attention, triton_paged_attention
from pagefleet.kernels import paged_attention as torch_attention
from pagefleet.kernels import store_kv_cache as torch_store

pytestmark = pytest.mark.triton

TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _cache(num_blocks: int, block_size: int, kv_heads: int, d: int, dtype: torch.dtype):
    k = torch.randn(num_blocks, block_size, kv_heads, d).to(dtype)
    v = torch.randn(num_blocks, block_size, kv_heads, d).to(dtype)
    return k, v


def _tables(context_lens: list[int], block_size: int, num_blocks: int) -> list[list[int]]:
    free = torch.randperm(num_blocks).tolist()
    return [[free.pop() for _ in range(-(-c // block_size))] for c in context_lens]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_store_kv_cache(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    k_ref, v_ref = _cache(8, 16, 2, 64, dtype)
    k_tri, v_tri = k_ref.clone(), v_ref.clone()
    # A strided source, as the model's fused QKV output gives.
    qkv = torch.randn(5, 6, 64).to(dtype)
    key, value = qkv[:, 2:4], qkv[:, 4:6]
    slots = torch.tensor([0, 17, 31, 64, 127])
    torch_store(key, value, k_ref, v_ref, slots)
    triton_attention.store_kv_cache(key, value, k_tri, v_tri, slots)
    assert torch.equal(k_ref, k_tri) and torch.equal(v_ref, v_tri)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads, kv_heads, d", [(4, 4, 64), (6, 2, 64), (8, 2, 128), (12, 3, 64)])
def test_decode_matches_reference(
    dtype: torch.dtype, block_size: int, heads: int, kv_heads: int, d: int
) -> None:
    torch.manual_seed(1)
    # Ragged contexts: 1 token, exact block boundaries, one past, long.
    ctx = [1, block_size, block_size + 1, 2 * block_size, 3 * block_size - 1, 5 * block_size + 7]
    k_cache, v_cache = _cache(64, block_size, kv_heads, d, dtype)
    meta = build_attention_metadata([1] * len(ctx), ctx, _tables(ctx, block_size, 64), block_size)
    q = torch.randn(len(ctx), heads, d).to(dtype)
    ref = torch_attention(q.float(), k_cache.float(), v_cache.float(), meta, d**-0.5)
    for splits in (1, 2, 3):
        out = triton_attention.paged_decode_attention(
            q, k_cache, v_cache, meta.block_tables, meta.context_lens, d**-0.5, num_splits=splits
        )
        torch.testing.assert_close(out.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("block_n", [16, 64, 128])
@pytest.mark.parametrize("heads, kv_heads", [(24, 1), (32, 2)])
def test_decode_tiles_and_wide_groups(block_n: int, heads: int, kv_heads: int) -> None:
    """Any keys-per-tile setting gives the reference, for a group that fills tl.dot's 16
    rows exactly (32 heads over 2 KV heads) and one wider than 16 (24 heads over 1 KV
    head: 32 rows, 8 of them padding)."""
    torch.manual_seed(7)
    block_size, d, dtype = 16, 32, torch.bfloat16
    ctx = [1, 15, 64, 65, 200]
    k_cache, v_cache = _cache(40, block_size, kv_heads, d, dtype)
    meta = build_attention_metadata([1] * len(ctx), ctx, _tables(ctx, block_size, 40), block_size)
    q = torch.randn(len(ctx), heads, d).to(dtype)
    ref = torch_attention(q.float(), k_cache.float(), v_cache.float(), meta, d**-0.5)
    out = triton_attention.paged_decode_attention(
        q, k_cache, v_cache, meta.block_tables, meta.context_lens, d**-0.5, block_n=block_n
    )
    torch.testing.assert_close(out.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (6, 2), (8, 2)])
def test_mixed_step_matches_reference(block_size: int, heads: int, kv_heads: int) -> None:
    """Decodes plus prompt chunks over cached context (chunked prefill, prefix hits)."""
    torch.manual_seed(2)
    d = 64
    shapes = [
        (1, 1),
        (1, block_size),
        (1, 40),  # decodes
        (5, 5),
        (3, 2 * block_size),
        (block_size, block_size + 3),
        (20, 20),
        (17, 50),
    ]
    q_lens = [q for q, _ in shapes]
    ctx = [c for _, c in shapes]
    k_cache, v_cache = _cache(64, block_size, kv_heads, d, torch.float32)
    meta = build_attention_metadata(q_lens, ctx, _tables(ctx, block_size, 64), block_size)
    q = torch.randn(sum(q_lens), heads, d)
    ref = torch_attention(q, k_cache, v_cache, meta, d**-0.5)
    out = triton_paged_attention(q, k_cache, v_cache, meta, d**-0.5)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_wrappers_check_inputs() -> None:
    k_cache, v_cache = _cache(4, 16, 2, 64, torch.float32)
    q = torch.randn(2, 4, 64)
    tables = torch.zeros(2, 1, dtype=torch.int32)
    lens = torch.ones(2, dtype=torch.int32)
    with pytest.raises(AssertionError, match="multiple of KV heads"):
        triton_attention.paged_decode_attention(
            torch.randn(2, 3, 64), k_cache, v_cache, tables, lens, 1.0
        )
    with pytest.raises(AssertionError):
        triton_attention.paged_decode_attention(q.half(), k_cache, v_cache, tables, lens, 1.0)
    strided = torch.randn(4, 16, 2, 128)[..., :64]  # the cache's shape, not contiguous
    with pytest.raises(AssertionError, match="contiguous"):
        triton_attention.paged_decode_attention(q, strided, v_cache, tables, lens, 1.0)


@pytest.mark.parametrize("block_size", [4, 16, 64])
def test_cache_offsets_are_int64_past_two_to_the_31(block_size: int) -> None:
    """Block ids whose element offsets pass 2^31 (caches over 4 GiB per layer in bf16).

    The kernels' own address arithmetic (`_cache_rows`) is run and its
    offsets compared with exact integers; no such cache is allocated.
    """
    kv_heads, d, kv_head = 8, 128, 5
    row = kv_heads * d
    # 2^31 / (block_size * row) is the first block id whose offset overflows int32.
    first_big = 2**31 // (block_size * row)
    ids = [3, first_big, first_big + 1, 2**31 - 1]  # the last: the largest int32 block id
    table = torch.tensor(ids, dtype=torch.int32)
    ctx = len(ids) * block_size - 1
    got = triton_attention.cache_row_offsets(table, ctx, block_size, kv_heads, d, kv_head)
    want = [
        (ids[p // block_size] * block_size + p % block_size) * row + kv_head * d for p in range(ctx)
    ]
    assert got.dtype == torch.int64
    assert got.tolist() == want
    assert max(want) > 2**31


def test_slot_mapping_is_int64_past_two_to_the_31() -> None:
    meta = build_attention_metadata([1, 2], [5, 2], [[1, 2**31 - 1], [2**30]], block_size=4)
    assert meta.slot_mapping.dtype == torch.int64
    assert meta.slot_mapping.tolist() == [(2**31 - 1) * 4 + 0, 2**30 * 4, 2**30 * 4 + 1]


def _stored_step(
    shapes: list[tuple[int, int]],
    block_size: int,
    heads: int,
    kv_heads: int,
    d: int,
    dtype: torch.dtype,
):
    """A step's queries, a cache holding every sequence's K/V, and the step's metadata."""
    q_lens = [q for q, _ in shapes]
    ctx = [c for _, c in shapes]
    num_blocks = sum(-(-c // block_size) for c in ctx) + 8  # a few spare blocks
    k_cache, v_cache = _cache(num_blocks, block_size, kv_heads, d, dtype)
    meta = build_attention_metadata(q_lens, ctx, _tables(ctx, block_size, num_blocks), block_size)
    q = torch.randn(sum(q_lens), heads, d).to(dtype)
    return q, k_cache, v_cache, meta


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 8, 16, 128])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (6, 2), (12, 3)])
def test_prefill_matches_reference(
    dtype: torch.dtype, block_size: int, heads: int, kv_heads: int
) -> None:
    """Prompt chunks over cached context in the cache's dtype; block sizes below 16 included."""
    torch.manual_seed(3)
    d = 32
    # Chunks with and without cached context, crossing block and tile boundaries.
    shapes = [(5, 5), (3, 40), (17, 17), (20, 70)]
    q, k_cache, v_cache, meta = _stored_step(shapes, block_size, heads, kv_heads, d, dtype)
    ref = torch_attention(q.float(), k_cache.float(), v_cache.float(), meta, d**-0.5)
    out = triton_paged_attention(q, k_cache, v_cache, meta, d**-0.5)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("block_size", [1, 4])
def test_decode_with_small_blocks(block_size: int) -> None:
    torch.manual_seed(4)
    shapes = [(1, 1), (1, 9), (1, 33)]
    q, k_cache, v_cache, meta = _stored_step(shapes, block_size, 6, 2, 32, torch.float32)
    ref = torch_attention(q, k_cache, v_cache, meta, 32**-0.5)
    out = triton_paged_attention(q, k_cache, v_cache, meta, 32**-0.5)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


class _LaunchRecorder:
    """Stands in for a jitted kernel: records each launch's grid and keyword constants."""

    def __init__(self) -> None:
        self.launches: list[tuple[tuple[int, ...], dict[str, object]]] = []

    def __getitem__(self, grid: tuple[int, ...]):
        def launch(*args: object, **kwargs: object) -> None:
            self.launches.append((grid, kwargs))

        return launch


def test_decode_split_count_comes_from_fixed_buckets(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every batch size 1..256 and context 1..4096 compiles one of five split counts."""
    split = _LaunchRecorder()
    monkeypatch.setattr(triton_attention, "_decode_split_kernel", split)
    monkeypatch.setattr(triton_attention, "_decode_merge_kernel", _LaunchRecorder())
    k_cache, v_cache = _cache(1, 16, 2, 64, torch.float32)
    seen = set()
    for batch in range(1, 257):
        for ctx in (1, 100, 4096):
            q = torch.empty(batch, 8, 64)
            tables = torch.zeros(batch, -(-ctx // 16), dtype=torch.int32)
            lens = torch.full((batch,), ctx, dtype=torch.int32)
            triton_attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, 1.0)
            seen.add(split.launches[-1][1]["NUM_SPLITS"])
    assert seen == {1, 2, 4, 8, 16}
    # 2 KV heads: batch 1 wants 128 splits, capped at 16; batch 64 gives 128 programs: 2 splits.
    assert triton_attention.decode_num_splits(1, 2, 4096, 32) == 16
    assert triton_attention.decode_num_splits(64, 2, 4096, 32) == 2
    assert triton_attention.decode_num_splits(100, 2, 4096, 32) == 1
    assert triton_attention.decode_num_splits(1, 2, 40, 32) == 2  # 2 key tiles only


def test_prefill_loads_each_kv_block_once_per_kv_head(monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefill grid has one program per KV head (the GQA group shares it), not per query head."""
    prefill = _LaunchRecorder()
    monkeypatch.setattr(triton_attention, "_prefill_kernel", prefill)
    q, k_cache, v_cache, meta = _stored_step(
        [(1, 7), (20, 20), (5, 40)], 16, 12, 3, 32, torch.bfloat16
    )
    triton_paged_attention(q, k_cache, v_cache, meta, 1.0)
    ((grid, consts),) = prefill.launches
    # 2 chunks, 3 KV heads, 20 query tokens in tiles of 64 rows / 4 (padded) heads = 16 tokens.
    assert grid == (2, 3, 2)
    assert (consts["GROUP"], consts["GROUP_PAD"], consts["BLOCK_M"]) == (4, 4, 16)
    assert consts["DOT_PRECISION"] == "tf32"  # bf16 inputs: the tensor-core product
