"""The CPU path (C kernels reading the cache in place; torch's flash per chunk without the
prefill kernel) against dense attention in float64."""

from __future__ import annotations

import pytest
import torch

from pagefleet.kernels import (
    build_attention_metadata,
    cpu_attention,
    cpu_build,
    cpu_paged_decode,
    cpu_paged_prefill,
    store_kv_cache,
)
from tests.kernels.threads import torch_threads

from .test_paged_attention import dense_reference


def _step(shapes, heads, kv_heads, d, block_size, dtype, seed=0):
    """A cache holding each sequence's context, the step's layout, queries and full K/V."""
    torch.manual_seed(seed)
    num_blocks = sum(-(-c // block_size) for _, c in shapes) + 8
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, d, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    free = torch.randperm(num_blocks).tolist()
    tables = [[free.pop() for _ in range(-(-c // block_size))] for _, c in shapes]
    full_k = [torch.randn(c, kv_heads, d).to(dtype) for _, c in shapes]
    full_v = [torch.randn(c, kv_heads, d).to(dtype) for _, c in shapes]
    queries = [torch.randn(q, heads, d).to(dtype) for q, _ in shapes]
    # Every token's K/V in place, as `attend` leaves them before attending.
    slots = [
        table[i // block_size] * block_size + i % block_size
        for (_, c), table in zip(shapes, tables, strict=True)
        for i in range(c)
    ]
    store_kv_cache(torch.cat(full_k), torch.cat(full_v), k_cache, v_cache, torch.tensor(slots))
    meta = build_attention_metadata(
        [q for q, _ in shapes], [c for _, c in shapes], tables, block_size
    )
    return k_cache, v_cache, meta, queries, full_k, full_v


def _check(out, shapes, queries, full_k, full_v, d, tol):
    start = 0
    for (q_len, ctx), q, k, v in zip(shapes, queries, full_k, full_v, strict=True):
        ref = dense_reference(q, k, v, q_len, ctx, d**-0.5)
        torch.testing.assert_close(out[start : start + q_len].double(), ref, atol=tol, rtol=tol)
        start += q_len


@pytest.fixture
def prefill_calls(monkeypatch) -> list[int]:
    """Counts the prefill kernel's calls (one per attention call with prompt chunks)."""
    calls: list[int] = []
    kernel = cpu_paged_prefill.paged_prefill

    def counted(*args: object) -> None:
        calls.append(1)
        kernel(*args)

    monkeypatch.setattr(cpu_paged_prefill, "paged_prefill", counted)
    return calls


def _without_prefill_kernel(monkeypatch) -> None:
    monkeypatch.setattr(cpu_paged_prefill, "supports", lambda query, k_cache: False)


@pytest.mark.parametrize("path", ["prefill kernel", "torch flash"])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads, kv_heads, d", [(9, 3, 64), (4, 4, 32), (8, 2, 128)])
def test_chunks_and_decodes_match_dense_attention(
    path, dtype, tol, heads, kv_heads, d, prefill_calls, monkeypatch
) -> None:
    """Decodes through the C kernel; chunks with and without cache through the prefill
    kernel, or, without it, long ones by torch's flash (short ones beside them too)."""
    assert cpu_paged_decode.supports(
        torch.empty(1, heads, d, dtype=dtype), torch.empty(1, dtype=dtype)
    )
    if path == "torch flash":
        _without_prefill_kernel(monkeypatch)
    block_size = 16
    shapes = [
        (1, 1), (1, 17), (1, 300), (70, 70), (64, 64 + 33), (100, 100 + 2 * block_size),
        (5, 5), (3, 40),
    ]  # fmt: skip
    k_cache, v_cache, meta, queries, full_k, full_v = _step(
        shapes, heads, kv_heads, d, block_size, dtype
    )
    assert meta.max_query_len >= cpu_attention.FLASH_MIN_CHUNK
    out = cpu_attention.cpu_paged_attention(torch.cat(queries), k_cache, v_cache, meta, d**-0.5)
    assert out.dtype == dtype
    _check(out, shapes, queries, full_k, full_v, d, tol)
    assert len(prefill_calls) == (1 if path == "prefill kernel" else 0)


@pytest.mark.parametrize(
    "heads, kv_heads, d, block_size, threads",
    [
        (9, 3, 64, 4, 1),  # blocks smaller than the kernel's 32-key steps
        (9, 3, 64, 32, 2),
        (7, 1, 64, 8, 2),  # an odd query-head group
        (32, 1, 64, 16, 1),  # a group over 8 heads: fewer tokens per work item
        (6, 2, 96, 16, 2),  # a head size without its own specialisation
        (2, 2, 16, 16, 1),
    ],
)
def test_the_prefill_kernel_over_block_sizes_groups_and_head_sizes(
    heads, kv_heads, d, block_size, threads, prefill_calls
) -> None:
    """Chunks starting mid-block, ending mid-block, two tokens long and hundreds long,
    with and without cached context, in one call."""
    shapes = [(1, 1), (1, 90), (37, 37), (200, 200 + 45), (13, 13 + 3), (64, 64 + 64), (2, 9)]
    k_cache, v_cache, meta, queries, full_k, full_v = _step(
        shapes, heads, kv_heads, d, block_size, torch.float32
    )
    with torch_threads(threads):
        out = cpu_attention.cpu_paged_attention(torch.cat(queries), k_cache, v_cache, meta, d**-0.5)
    _check(out, shapes, queries, full_k, full_v, d, 1e-5)
    assert prefill_calls == [1]


def test_without_the_prefill_kernel_short_chunks_go_through_the_reference(
    prefill_calls, monkeypatch
) -> None:
    _without_prefill_kernel(monkeypatch)
    shapes = [(1, 5), (1, 40), (5, 5), (7, 20)]
    k_cache, v_cache, meta, queries, full_k, full_v = _step(shapes, 6, 2, 16, 4, torch.float32)
    assert meta.max_query_len < cpu_attention.FLASH_MIN_CHUNK
    out = cpu_attention.cpu_paged_attention(torch.cat(queries), k_cache, v_cache, meta, 0.25)
    _check(out, shapes, queries, full_k, full_v, 16, 1e-5)
    assert prefill_calls == []


@pytest.mark.parametrize("threads", [1, 2])
def test_few_sequences_split_by_kv_head(threads: int) -> None:
    """Fewer than two sequences a thread: the kernel's items are single KV heads."""
    shapes = [(1, 300), (1, 45), (1, 1)]
    k_cache, v_cache, meta, queries, full_k, full_v = _step(shapes, 8, 4, 64, 16, torch.float32)
    with torch_threads(threads):
        out = cpu_attention.cpu_paged_attention(torch.cat(queries), k_cache, v_cache, meta, 0.125)
    _check(out, shapes, queries, full_k, full_v, 64, 1e-5)


def test_a_query_that_is_a_strided_view() -> None:
    """Queries split out of a fused QKV projection are views with a wider row stride."""
    shapes = [(1, 30), (1, 9)]
    k_cache, v_cache, meta, queries, full_k, full_v = _step(shapes, 4, 2, 16, 8, torch.float32)
    fused = torch.cat([torch.cat(queries), torch.randn(2, 4, 16)], dim=1)  # [2, 8, 16]
    q = fused[:, :4]
    assert not q.is_contiguous()
    out = cpu_attention.cpu_paged_attention(q, k_cache, v_cache, meta, 0.25)
    _check(out, shapes, queries, full_k, full_v, 16, 1e-5)


def test_without_a_compiler_the_reference_serves(monkeypatch, tmp_path) -> None:
    shapes = [(1, 30), (80, 80)]
    k_cache, v_cache, meta, queries, full_k, full_v = _step(shapes, 4, 2, 16, 8, torch.float32)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv(cpu_build.CACHE_ENV, str(tmp_path / "kernels"))
    cpu_build.library.cache_clear()
    try:
        assert not cpu_paged_decode.supports(torch.cat(queries), k_cache)
        out = cpu_attention.cpu_paged_attention(torch.cat(queries), k_cache, v_cache, meta, 0.25)
        _check(out, shapes, queries, full_k, full_v, 16, 1e-5)
    finally:
        cpu_build.library.cache_clear()


def test_the_kernel_is_built_once_into_its_cache(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv(cpu_build.CACHE_ENV, str(tmp_path))
    cpu_build.library.cache_clear()
    try:
        assert cpu_build.library() is not None
        built = sorted(p.name for p in tmp_path.iterdir())
        assert len(built) == 1 and built[0].startswith("cpu_kernels-") and built[0].endswith(".so")
        mtime = (tmp_path / built[0]).stat().st_mtime_ns
        cpu_build.library.cache_clear()
        assert cpu_build.library() is not None
        assert (tmp_path / built[0]).stat().st_mtime_ns == mtime  # loaded, not rebuilt
    finally:
        cpu_build.library.cache_clear()


def _times(a: float, b: float) -> float:
    return a * b  # at run time: the operands are arguments, nothing to fold


def test_loading_the_kernel_leaves_the_process_floats_alone(monkeypatch, tmp_path) -> None:
    """Built with -ffast-math but not linked with it: loading the library must not turn on
    flush-to-zero for the process (gcc's crtfastmath.o would, as its constructor)."""
    monkeypatch.setenv(cpu_build.CACHE_ENV, str(tmp_path))
    cpu_build.library.cache_clear()
    try:
        assert cpu_build.library() is not None
        assert _times(5e-324, 1.0) == 5e-324  # the smallest subnormal survives
        tiny = torch.tensor([1e-40], dtype=torch.float32)
        assert (tiny * 1.0).item() > 0
    finally:
        cpu_build.library.cache_clear()
