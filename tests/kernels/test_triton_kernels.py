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
