"""Sliding windows and logit soft-capping on every attention path, against dense float64.

Each path (the torch reference, the CPU C kernels, the Triton kernels in Triton's
interpreter) runs the same ragged steps: decodes and prompt chunks, with and without
cached context, across block boundaries, with windows smaller than, equal to and
larger than the contexts. The C and Triton kernels must also never read a block
wholly before a sequence's window: those table entries point at a block of NaNs.
"""

from __future__ import annotations

import pytest
import torch

from pagefleet.kernels import (
    build_attention_metadata,
    cpu_attention,
    cpu_paged_decode,
    cpu_paged_prefill,
    store_kv_cache,
)
from pagefleet.kernels import paged_attention as attention_entry
from pagefleet.kernels.paged_attention import paged_attention as reference

# (query_len, context_len): decodes first, then chunks (fresh, and over cached context).
SHAPES = [
    (1, 1),
    (1, 16),
    (1, 17),
    (1, 40),
    (1, 300),
    (5, 5),
    (40, 40),
    (3, 33),
    (16, 19),
    (70, 130),
]
WINDOWS = [1, 7, 16, 40, 1000]  # under, at a block size, equal to a context, over all


def dense(q, k, v, q_len, ctx, scale, window, cap):
    """q [q_len, H, D]; k, v [ctx, Hkv, D]; query i at position ctx - q_len + i."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1).double()
    v = v.repeat_interleave(group, dim=1).double()
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if cap is not None:
        scores = torch.tanh(scores / cap) * cap
    q_pos = torch.arange(ctx - q_len, ctx).view(-1, 1)
    key_pos = torch.arange(ctx).view(1, -1)
    visible = key_pos <= q_pos
    if window is not None:
        visible &= key_pos > q_pos - window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def _step(heads, kv_heads, d, block_size, dtype, window=None, poison=False, seed=0):
    """The cache with every sequence's K/V, the step's layout and the dense inputs.

    poison: the table entries of blocks wholly before each sequence's first query's
    window name one block full of NaNs (what a freed block may hold for all a kernel knows).
    """
    torch.manual_seed(seed)
    num_blocks = sum(-(-c // block_size) for _, c in SHAPES) + 2
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, d, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    free = torch.randperm(num_blocks - 1).tolist()
    tables = [[free.pop() for _ in range(-(-c // block_size))] for _, c in SHAPES]
    full_k = [torch.randn(c, kv_heads, d).to(dtype) for _, c in SHAPES]
    full_v = [torch.randn(c, kv_heads, d).to(dtype) for _, c in SHAPES]
    queries = [torch.randn(q, heads, d).to(dtype) for q, _ in SHAPES]
    slots = [
        table[i // block_size] * block_size + i % block_size
        for (_, c), table in zip(SHAPES, tables, strict=True)
        for i in range(c)
    ]
    store_kv_cache(torch.cat(full_k), torch.cat(full_v), k_cache, v_cache, torch.tensor(slots))
    if poison:
        nan = num_blocks - 1
        k_cache[nan] = float("nan")
        v_cache[nan] = float("nan")
        for (q_len, ctx), table in zip(SHAPES, tables, strict=True):
            first_seen = max(ctx - q_len - window + 1, 0)  # the first query's first key
            for b in range(first_seen // block_size):
                table[b] = nan
    meta = build_attention_metadata(
        [q for q, _ in SHAPES], [c for _, c in SHAPES], tables, block_size
    )
    return k_cache, v_cache, meta, queries, full_k, full_v


def _check(out, queries, full_k, full_v, d, window, cap, tol):
    start = 0
    for (q_len, ctx), q, k, v in zip(SHAPES, queries, full_k, full_v, strict=True):
        ref = dense(q, k, v, q_len, ctx, d**-0.5, window, cap)
        torch.testing.assert_close(out[start : start + q_len].double(), ref, atol=tol, rtol=tol)
        start += q_len


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("window", [None, *WINDOWS])
@pytest.mark.parametrize("cap", [None, 3.0])
def test_reference_matches_dense(block_size: int, window: int | None, cap: float | None) -> None:
    heads, kv_heads, d = 6, 2, 16
    k_cache, v_cache, meta, queries, full_k, full_v = _step(
        heads, kv_heads, d, block_size, torch.float32
    )
    out = reference(torch.cat(queries), k_cache, v_cache, meta, d**-0.5, window, cap)
    _check(out, queries, full_k, full_v, d, window, cap, 1e-5)


def test_reference_masks_per_window_are_built_once() -> None:
    meta = build_attention_metadata([1, 3], [6, 5], [[7, 2], [5, 4]], block_size=4)
    assert meta.decode_window_mask(2) is meta.decode_window_mask(2)
    assert meta.decode_window_mask(2).view(-1).tolist() == [False] * 4 + [True] * 2 + [False] * 2
    assert meta.decode_window_mask(None) is meta.decode_mask
    # Chunk: queries at 2, 3, 4 with a window of 2 see {1, 2}, {2, 3}, {3, 4}.
    rows = meta.prefill_window_mask(2)[0, 0, :, :5].int().tolist()
    assert rows == [[0, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]]


@pytest.mark.parametrize("path", ["C kernels", "C decode, reference chunks"])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("window", [None, *WINDOWS])
@pytest.mark.parametrize("cap", [None, 3.0])
def test_cpu_kernels_match_dense(path, dtype, tol, window, cap, monkeypatch) -> None:
    heads, kv_heads, d, block_size = 8, 2, 64, 16
    assert cpu_paged_decode.supports(
        torch.empty(1, heads, d, dtype=dtype), torch.empty(1, dtype=dtype)
    )
    if path != "C kernels":
        monkeypatch.setattr(cpu_paged_prefill, "supports", lambda query, k_cache: False)
    k_cache, v_cache, meta, queries, full_k, full_v = _step(heads, kv_heads, d, block_size, dtype)
    out = cpu_attention.cpu_paged_attention(
        torch.cat(queries), k_cache, v_cache, meta, d**-0.5, window, cap
    )
    _check(out, queries, full_k, full_v, d, window, cap, tol)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("block_size", [4, 16, 32])
@pytest.mark.parametrize("window", [1, 7, 16, 40])
def test_cpu_kernels_never_read_blocks_before_the_window(
    dtype: torch.dtype, tol: float, block_size: int, window: int
) -> None:
    heads, kv_heads, d = 4, 2, 32
    k_cache, v_cache, meta, queries, full_k, full_v = _step(
        heads, kv_heads, d, block_size, dtype, window=window, poison=True
    )
    out = cpu_attention.cpu_paged_attention(
        torch.cat(queries), k_cache, v_cache, meta, d**-0.5, window
    )
    _check(out, queries, full_k, full_v, d, window, None, tol)


def test_the_public_entry_point_passes_the_options() -> None:
    heads, kv_heads, d = 4, 4, 32
    k_cache, v_cache, meta, queries, full_k, full_v = _step(heads, kv_heads, d, 16, torch.float32)
    out = attention_entry(torch.cat(queries), k_cache, v_cache, meta, d**-0.5, 7, 2.0)
    _check(out, queries, full_k, full_v, d, 7, 2.0, 1e-5)


@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [4, 16, 32])
@pytest.mark.parametrize(
    "window, cap", [(None, 3.0), (1, None), (7, None), (16, 3.0), (40, None), (1000, None)]
)
def test_triton_kernels_match_reference(dtype, block_size, window, cap) -> None:
    pytest.importorskip("triton", reason="triton is in the dev extra")
    from pagefleet.kernels import triton_paged_attention

    heads, kv_heads, d = 6, 2, 32
    k_cache, v_cache, meta, queries, full_k, full_v = _step(
        heads, kv_heads, d, block_size, dtype, window=window, poison=window is not None
    )
    out = triton_paged_attention(torch.cat(queries), k_cache, v_cache, meta, d**-0.5, window, cap)
    _check(out, queries, full_k, full_v, d, window, cap, 1e-5 if dtype == torch.float32 else 3e-2)


def dense_with_sinks(q, k, v, q_len, ctx, scale, window, sinks):
    """`dense`, with each head's sink logit in the softmax's denominator (no value)."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1).double()
    v = v.repeat_interleave(group, dim=1).double()
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    q_pos = torch.arange(ctx - q_len, ctx).view(-1, 1)
    key_pos = torch.arange(ctx).view(1, -1)
    visible = key_pos <= q_pos
    if window is not None:
        visible &= key_pos > q_pos - window
    scores = scores.masked_fill(~visible, float("-inf"))
    sink = sinks.double().view(-1, 1, 1).expand(-1, q_len, 1)
    weights = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    return torch.einsum("hqk,khd->qhd", weights, v)


def _check_sinks(out, queries, full_k, full_v, d, window, sinks, tol):
    start = 0
    for (q_len, ctx), q, k, v in zip(SHAPES, queries, full_k, full_v, strict=True):
        ref = dense_with_sinks(q, k, v, q_len, ctx, d**-0.5, window, sinks)
        torch.testing.assert_close(out[start : start + q_len].double(), ref, atol=tol, rtol=tol)
        start += q_len


SINK_PATHS = ["reference", "C kernels", "triton"]


@pytest.mark.parametrize("path", SINK_PATHS)
@pytest.mark.parametrize("window", [None, 7, 40])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_sinks_on_every_path(path: str, window: int | None, dtype: torch.dtype, tol: float) -> None:
    """gpt-oss's attention sinks: a logit per query head with no value, large enough
    (up to 4) to take a real share of the softmax."""
    heads, kv_heads, d = 8, 2, 32
    k_cache, v_cache, meta, queries, full_k, full_v = _step(
        heads,
        kv_heads,
        d,
        16,
        dtype,
        window=window,
        poison=path != "reference" and window is not None,
    )
    sinks = torch.linspace(-2.0, 4.0, heads)
    q = torch.cat(queries)
    if path == "reference":
        out = reference(q, k_cache, v_cache, meta, d**-0.5, window, None, sinks)
    elif path == "C kernels":
        out = cpu_attention.cpu_paged_attention(
            q, k_cache, v_cache, meta, d**-0.5, window, None, sinks
        )
    else:
        pytest.importorskip("triton", reason="triton is in the dev extra")
        from pagefleet.kernels import triton_paged_attention

        out = triton_paged_attention(q, k_cache, v_cache, meta, d**-0.5, window, None, sinks)
    _check_sinks(out, queries, full_k, full_v, d, window, sinks, tol)
