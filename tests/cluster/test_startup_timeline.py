"""A replica's start-up timeline: every phase, in the order it ran, in its `EngineInfo`, its
log and `/metrics` (`pagefleet:replica_startup_seconds{phase}`), through the real engine
process a Serve replica runs (`LLMReplica`, its engine core in a child process)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from pagefleet.cluster.config import ServeConfig
from pagefleet.cluster.replica import LLMReplica
from pagefleet.cluster.replica_messages import ReplicaRequest
from pagefleet.engine import SamplingParams
from pagefleet.engine.startup import PHASES, StartupTimeline, process_start_time

EAGER = [p for p in PHASES if p not in ("compile", "warm_up")]


async def _start_and_serve(config: ServeConfig, startup: StartupTimeline) -> dict[str, Any]:
    replica = LLMReplica(config, "r0", startup=startup)
    try:
        info = await replica.info()
        request = ReplicaRequest("a", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=4))
        async for _ in replica.generate(request):
            pass
        families = {f.name: f for f in replica.metric_families()}
        return {
            "info": info,
            "timeline": replica.startup.durations(),
            "phases": [
                s.labels["phase"] for s in families["pagefleet:replica_startup_seconds"].samples
            ],
            "start": families["pagefleet:replica_start_time_seconds"].samples[0].value,
            "blocks": await replica.check_block_accounting(),
        }
    finally:
        await replica.shutdown()


@pytest.mark.parametrize(
    ("engine", "phases"),
    [
        pytest.param({"enforce_eager": True}, EAGER, id="eager"),
        pytest.param(
            {"enforce_eager": False}, list(PHASES), id="compiled", marks=pytest.mark.compile
        ),
        pytest.param(
            {"enforce_eager": False, "compile_in_background": True},
            EAGER,
            id="compiled-in-background",
            marks=pytest.mark.compile,
        ),
    ],
)
def test_replica_reports_every_phase_of_its_start_up_in_order(
    llama_dir: str, engine: dict[str, Any], phases: list[str]
) -> None:
    config = ServeConfig.model_validate(
        {
            "model": llama_dir,
            "served_model_name": "tiny",
            "engine": {"dtype": "float32", "block_size": 8, "num_kv_blocks": 16, **engine},
        }
    )
    started = process_start_time()
    assert started is not None  # Linux: /proc says when this process began
    startup = StartupTimeline(started)
    startup.mark("process")
    got = asyncio.run(_start_and_serve(config, startup))
    # Up to readiness in EngineInfo (what the ingress reads), then the first request.
    assert list(got["info"].startup_seconds) == phases[:-1]
    assert list(got["timeline"]) == phases
    assert all(seconds >= 0 for seconds in got["timeline"].values())
    assert got["phases"] == phases
    assert got["start"] == started
    assert got["blocks"]["free"] == got["blocks"]["total"] == 16
