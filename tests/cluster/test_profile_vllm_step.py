"""benchmarks/profile_vllm_step.py's reading of a profiled vLLM step into layer parts."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).parents[2] / "benchmarks" / "profile_vllm_step.py"


@pytest.fixture(scope="module")
def profile_vllm_step():
    spec = importlib.util.spec_from_file_location("profile_vllm_step", _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["profile_vllm_step"] = module
    spec.loader.exec_module(module)
    return module


def _layer(t: int) -> list[list]:
    """One decoder layer's events from time t (us): [name, start, end, self]."""
    return [
        ["_C::onednn_mm", t, t + 10, 10],  # QKV
        ["graph_0_cpp_fused_add_index_mul_sub_1", t + 10, t + 12, 2],  # rotary
        ["vllm::unified_attention_with_output", t + 12, t + 40, 3],
        ["_C::cpu_attention_with_kv_cache", t + 15, t + 38, 23],  # inside the op: not again
        ["_C::onednn_mm", t + 40, t + 45, 5],  # output projection
        ["graph_0_cpp_fused_add_mean_mul_rsqrt_2", t + 45, t + 46, 1],  # norm
        ["_C::onednn_mm", t + 46, t + 66, 20],  # gate/up
        ["graph_0_cpp_fused_mul_silu_split_3", t + 66, t + 69, 3],
        ["_C::onednn_mm", t + 69, t + 79, 10],  # down
    ]


def test_a_steps_events_are_read_into_exact_parts(profile_vllm_step) -> None:
    events = [
        ["llm_engine step: get_output", 0, 400, 50],  # a range around it all: not a part
        *_layer(100),
        *_layer(200),
        ["_C::onednn_mm", 300, 330, 30],  # the LM head, after the last layer
        ["aten::argmax", 340, 350, 4],  # sampling
        ["aten::max", 342, 348, 6],  # inside argmax: not again
    ]
    parts = profile_vllm_step.vllm_parts({"events": events, "profiled_s": 400e-6})
    assert parts == pytest.approx(
        {
            "QKV + output projections": 30e-6,
            "rotary": 4e-6,
            "attention (K/V store + paged attention)": 56e-6,
            "norms (+ residual add)": 2e-6,
            "MLP (gate/up + down GEMMs)": 60e-6,
            "MLP SiLU-and-mul": 6e-6,
            "LM head": 30e-6,
            "sampling": 10e-6,
            profile_vllm_step.REST: 202e-6,
        }
    )


def test_without_the_attention_op_its_two_kernels_count(profile_vllm_step) -> None:
    events = [
        ["_C::onednn_mm", 0, 10, 10],
        ["_C::cpu_attn_reshape_and_cache", 10, 12, 2],
        ["_C::cpu_attention_with_kv_cache", 12, 30, 18],
        ["_C::onednn_mm", 30, 35, 5],
        ["_C::onednn_mm", 35, 45, 10],
        ["_C::onednn_mm", 45, 50, 5],
        ["_C::onednn_mm", 50, 80, 30],
    ]
    parts = profile_vllm_step.vllm_parts({"events": events, "profiled_s": 100e-6})
    assert parts["attention (K/V store + paged attention)"] == pytest.approx(20e-6)
    assert parts["QKV + output projections"] == pytest.approx(15e-6)
    assert parts["MLP (gate/up + down GEMMs)"] == pytest.approx(15e-6)
    assert parts["LM head"] == pytest.approx(30e-6)
