"""The replica's series from engine snapshots: structured-output counters, the hot-block gauge."""

from __future__ import annotations

from prometheus_client import generate_latest

from pagefleet.cluster.metrics import EXPORTED, ReplicaMetrics
from pagefleet.engine import EngineStats


def _stats(**grammar: float) -> EngineStats:
    return EngineStats(64, 60, 16, 0, 0, 0, 0, 0, **grammar)  # type: ignore[arg-type]


def test_grammar_counters_are_exported_as_pagefleet_series() -> None:
    m = ReplicaMetrics("tiny", "r0")
    m.update(_stats())
    m.update(
        _stats(
            grammar_compiles=2,
            grammar_compile_seconds=0.25,
            grammar_cache_hits=7,
            grammar_cache_misses=2,
        )
    )
    m.update(  # totals only move forward: a counter advances by what they moved
        _stats(
            grammar_compiles=3,
            grammar_compile_seconds=0.5,
            grammar_cache_hits=9,
            grammar_cache_misses=3,
        )
    )
    text = generate_latest(m.registry).decode()
    labels = '{model_name="tiny",replica="r0"}'
    for line in (
        f"pagefleet:structured_output_compiles_total{labels} 3.0",
        f"pagefleet:structured_output_compile_seconds_total{labels} 0.5",
        f"pagefleet:structured_output_cache_hits_total{labels} 9.0",
        f"pagefleet:structured_output_cache_misses_total{labels} 3.0",
    ):
        assert line in text.splitlines()
        assert line.split("_total")[0] in EXPORTED


def test_hot_blocks_are_a_gauge_of_the_latest_snapshot() -> None:
    m = ReplicaMetrics("tiny", "r0")
    m.update(EngineStats(64, 60, 16, 0, 0, 0, 0, 0, num_hot_cached_blocks=12))
    m.update(EngineStats(64, 60, 16, 0, 0, 0, 0, 0, num_hot_cached_blocks=5))
    text = generate_latest(m.registry).decode()
    assert 'pagefleet:kv_blocks_hot{model_name="tiny",replica="r0"} 5.0' in text.splitlines()
    assert "pagefleet:kv_blocks_hot" in EXPORTED
