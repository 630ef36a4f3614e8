"""The compiled path's switches and custom ops, without compiling a model (cheap).

The compiled engine itself is checked against transformers in
tests/engine/test_oracle.py (`test_compiled_greedy_equals_transformers`), and on a
GPU, with CUDA graphs, in tests/gpu.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagefleet.engine.config import EngineConfig
from pagefleet.engine.cuda_graphs import DecodeGraphs, bucket_sizes
from pagefleet.engine.custom_ops import attention, packed_linear
from pagefleet.engine.layers.attention import ForwardContext, attend, forward_context
from pagefleet.engine.layers.cpu_gemm import PackedWeight
from pagefleet.kernels import build_attention_metadata


def test_enforce_eager_defaults_to_the_environment(
    llama_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PAGEFLEET_ENFORCE_EAGER", "1")
    assert EngineConfig(model=llama_dir).eager
    assert not EngineConfig(model=llama_dir, enforce_eager=False).eager
    monkeypatch.delenv("PAGEFLEET_ENFORCE_EAGER")
    assert not EngineConfig(model=llama_dir).eager  # compiled is the default
    assert EngineConfig(model=llama_dir, enforce_eager=True).eager


def test_serve_config_takes_enforce_eager(llama_dir: str) -> None:
    from pagefleet.cluster.config import EngineSettings

    assert EngineSettings(enforce_eager=True).to_engine_config(llama_dir).eager
    assert EngineSettings().enforce_eager is None


def test_cuda_graph_buckets() -> None:
    assert bucket_sizes(1) == (1,)
    assert bucket_sizes(20) == (1, 2, 4, 8, 16, 24)
    assert bucket_sizes(64)[-1] == 64
    assert bucket_sizes(1000)[-1] == 256
    assert DecodeGraphs.capture  # importable on a machine without CUDA


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 5])
def test_packed_linear_op_equals_the_layer(bias: bool, rows: int) -> None:
    torch.manual_seed(0)
    weight = torch.randn(24, 16)
    b = torch.randn(24) if bias else None
    packed = PackedWeight.try_pack(weight, 8)
    if packed is None:
        pytest.skip("this CPU has no oneDNN packing")
    packed.slot = 0
    x = torch.randn(rows, 16)
    with forward_context(ForwardContext(None, [], [packed])):  # type: ignore[arg-type]
        got = packed_linear(x, b, 0)
        torch.library.opcheck(packed_linear, (x, b, 0))
    torch.testing.assert_close(got, F.linear(x, weight, b))


def test_attention_op_equals_the_layer() -> None:
    torch.manual_seed(0)
    heads, kv_heads, d, bs = 4, 2, 16, 4
    caches = [(torch.zeros(8, bs, kv_heads, d), torch.zeros(8, bs, kv_heads, d))]
    # One decode (context 3) and one chunk of 3 tokens (context 5).
    meta = build_attention_metadata([1, 3], [3, 5], [[0], [1, 2]], bs)
    q, k, v = torch.randn(4, heads, d), torch.randn(4, kv_heads, d), torch.randn(4, kv_heads, d)
    ctx = ForwardContext(meta, caches)
    want = attend(0, q, k, v, ctx, d**-0.5)
    with forward_context(ctx):
        got = attention(q, k, v, 0, d**-0.5)
        torch.library.opcheck(attention, (q, k, v, 0, d**-0.5), test_utils="test_schema")
    torch.testing.assert_close(got, want)
