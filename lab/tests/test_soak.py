"""The soak benchmark's pure helpers: process roles, fits, window statistics, the metrics
page, the request mix, the client's cancels and disconnects."""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import AsyncIterator

import httpx
import pytest

from pagefleet.bench.stats import percentile, slope
from pagefleet_lab.bench.soak_load import Plan, Record, make_plan, request_body, send
from pagefleet_lab.bench.soak_report import Sample, fifths, rss_growth, window_stats
from pagefleet_lab.bench.soak_watch import (
    ProcSample,
    leaked_blocks,
    parse_replicas,
    process_role,
)

VENV = "/work/.venv/lib/python3.11/site-packages/ray"


def test_roles_from_the_command_lines_ray_and_serve_give_their_processes() -> None:
    def role(cmd: str, parent: str | None = "pagefleet serve") -> str:
        return process_role(cmd.split(), cmd.split()[0].rsplit("/", 1)[-1], parent)

    assert role("/venv/bin/python -m pagefleet.cli serve x.yaml", None) == "pagefleet serve"
    assert role(f"{VENV}/core/src/ray/gcs/gcs_server --log_dir=/tmp") == "ray gcs"
    assert role(f"{VENV}/core/src/ray/raylet/raylet --raylet_socket_name=/tmp/x") == "ray raylet"
    assert role("ray::ServeController") == "serve controller"
    assert role("ray::ProxyActor") == "serve proxy"
    # Ray retitles an actor's process with the method it is running.
    assert role("ray::ServeReplica:pagefleet:EngineReplica", "ray raylet") == "engine replica"
    assert (
        role("ray::ServeReplica:pagefleet:EngineReplica.handle_request_with_rejection")
        == "engine replica"
    )
    assert role("ray::ServeReplica:pagefleet:Ingress.check_health") == "ingress"
    assert role("ray::ServeReplica:pagefleet:MetricsHubDeployment") == "metrics hub"
    assert role("ray::ServeReplica:other:Thing.run") == "serve replica Thing"
    assert role(f"/venv/bin/python {VENV}/dashboard/dashboard.py --host=x") == "ray support"
    assert role("ray::DashboardAgent") == "ray support"
    assert role("ray::IDLE") == "ray idle worker"
    spawn = "/venv/bin/python -B -c from multiprocessing.spawn import spawn_main; spawn_main()"
    assert role(spawn, "engine replica") == "engine core"
    assert role(spawn, "engine core") == "engine TP rank"
    tracker = "/venv/bin/python -B -c from multiprocessing.resource_tracker import main;main(63)"
    assert role(tracker, "engine replica") == "mp resource tracker"
    assert role("ray::RayWorker.run", "ray raylet") == "ray actor RayWorker.run"


def _record(start: float, e2e: float, outcome: str = "ok", ttft: float | None = None) -> Record:
    plan = Plan(False, True, 8, 1, 0, 0, "finish")
    return Record(start, start + e2e, outcome, plan, ttft)


def test_window_p99_is_the_toolkits_interpolated_percentile() -> None:
    # Nearest rank would say 99 for the e2e p99 here; linear interpolation says 99.01,
    # as the router's, autoscale's and serve's p99 do.
    recs = [_record(0.0, float(e), ttft=e / 10) for e in range(1, 101)]
    recs.append(_record(0.0, 500.0, outcome="cancelled"))  # only ok requests count
    counts, e2e_p99, ttft_p99 = window_stats(recs)
    assert counts == {"ok": 100, "cancelled": 1}
    assert e2e_p99 == pytest.approx(99.01)
    assert e2e_p99 == percentile([float(e) for e in range(1, 101)], 0.99)
    assert ttft_p99 == pytest.approx(9.901)
    assert all(math.isnan(v) for v in window_stats([])[1:])


def test_fifths_go_by_start_time() -> None:
    recs = [_record(t, 100.0) for t in (0, 10, 19.9, 20, 79.9, 80, 99)]
    first, last = fifths(recs, 100.0)
    assert [r.start for r in first] == [0, 10, 19.9]
    assert [r.start for r in last] == [80, 99]


def test_request_bodies_for_chat_and_completions() -> None:
    path, body = request_body(Plan(True, True, 16, 2, 3, 1, "finish"), "m", 7)
    assert path == "/v1/chat/completions"
    assert (body["n"], body["seed"], body["max_tokens"], body["ignore_eos"]) == (2, 7, 16, True)
    assert body["stream_options"] == {"include_usage": True}
    assert [m["role"] for m in body["messages"]] == ["system", "user"]
    path, body = request_body(Plan(False, False, 8, 1, 0, 0, "finish"), "m", 1)
    assert path == "/v1/completions" and "stream_options" not in body
    assert body["prompt"] == "def quicksort(items):"


def test_slope_is_least_squares_and_nan_without_enough_points() -> None:
    assert slope([0, 1, 2, 3], [1, 3, 5, 7]) == 2
    assert math.isnan(slope([0, 1], [0, 1]))
    assert math.isnan(slope([5, 5, 5], [1, 2, 3]))


def _sample(t: float, finished: int, procs: list[tuple[int, str, float]]) -> Sample:
    return Sample(t, finished, [ProcSample(*p) for p in procs], {}, None)


def test_rss_growth_fits_each_process_and_ignores_the_warm_up() -> None:
    samples = [
        # warm-up: the replica grows fast while it loads (not counted)
        _sample(0, 0, [(1, "engine replica", 100), (2, "ingress", 50)]),
        _sample(10, 1000, [(1, "engine replica", 400), (2, "ingress", 50)]),
        # after it: the replica grows 1 MiB per 1,000 requests, the ingress is flat
        _sample(20, 2000, [(1, "engine replica", 400), (2, "ingress", 50)]),
        _sample(30, 3000, [(1, "engine replica", 401), (2, "ingress", 50)]),
        _sample(40, 4000, [(1, "engine replica", 402), (2, "ingress", 50), (3, "ingress", 70)]),
        _sample(50, 5000, [(1, "engine replica", 403), (3, "ingress", 70)]),
        _sample(60, 6000, [(1, "engine replica", 404), (3, "ingress", 70)]),
    ]
    growth = {g.role: g for g in rss_growth(samples, warmup_s=20)}
    replica = growth["engine replica"]
    assert math.isclose(replica.per_1k, 1.0)
    assert (replica.rss_start, replica.rss_end, replica.processes, replica.churn) == (
        400,
        404,
        1,
        0,
    )
    # A process that replaced another is not growth: each is fitted on its own (both flat).
    ingress = growth["ingress"]
    assert math.isclose(ingress.per_1k, 0.0, abs_tol=1e-9)
    assert (ingress.rss_start, ingress.rss_end, ingress.processes, ingress.churn) == (
        50,
        70,
        1,
        2,
    )


METRICS = """\
# TYPE pagefleet:kv_blocks_free gauge
pagefleet:kv_blocks_free{model_name="tiny",replica="a"} 512.0
pagefleet:kv_blocks_free{model_name="tiny",replica="b"} 500.0
# TYPE pagefleet:kv_blocks_total gauge
pagefleet:kv_blocks_total{model_name="tiny",replica="a"} 512.0
pagefleet:kv_blocks_total{model_name="tiny",replica="b"} 512.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="tiny",replica="b"} 1.0
# TYPE pagefleet:replicas gauge
pagefleet:replicas{model_name="tiny"} 2.0
"""


def test_parse_replicas_and_leaked_blocks() -> None:
    replicas, fleet = parse_replicas(METRICS)
    assert fleet == 2
    assert set(replicas) == {"a", "b"}
    assert (replicas["b"].free, replicas["b"].total, replicas["b"].running) == (500, 512, 1)
    assert leaked_blocks(replicas) == 12


def test_the_plan_sequence_is_fixed_by_the_seed() -> None:
    a = [make_plan(random.Random(7), 0.1, 0.05) for _ in range(3)]
    b = [make_plan(random.Random(7), 0.1, 0.05) for _ in range(3)]
    assert a == b
    plans = [make_plan(r, 0.1, 0.05) for r in [random.Random(1)] for _ in range(4000)]
    actions = {k: sum(p.action == k for p in plans) / len(plans) for k in ("cancel", "disconnect")}
    assert 0.05 < actions["cancel"] < 0.09  # 10 % of the 70 % streamed
    assert 0.06 < actions["disconnect"] < 0.11  # 5 % + the 3 % non-streamed cancels
    assert all(p.after >= 1 for p in plans if p.action == "cancel")


class _Slow(httpx.AsyncByteStream):
    """An event stream of `n` one-token chunks, `gap_s` apart, then usage and [DONE]."""

    def __init__(self, n: int, gap_s: float, chat: bool) -> None:
        self.n, self.gap_s, self.chat = n, gap_s, chat

    async def __aiter__(self) -> AsyncIterator[bytes]:
        def event(chunk: dict | str) -> bytes:
            return f"data: {chunk if isinstance(chunk, str) else json.dumps(chunk)}\n\n".encode()

        if self.chat:
            yield event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        for _ in range(self.n):
            await asyncio.sleep(self.gap_s)
            choice = {"index": 0, "delta": {"content": "x"}} if self.chat else {"text": "x"}
            yield event({"choices": [choice]})
        yield event({"choices": [], "usage": {"completion_tokens": self.n}})
        yield event("[DONE]")


def _send(plan: Plan, status: int = 200, gap_s: float = 0.0) -> Record:
    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        n = body["max_tokens"] * body["n"]
        if status != 200:
            return httpx.Response(status, json={"error": {"message": "too many requests"}})
        if not body["stream"]:
            return httpx.Response(200, json={"usage": {"completion_tokens": n}})
        return httpx.Response(200, stream=_Slow(n, gap_s, "messages" in body))

    async def go() -> Record:
        transport = httpx.MockTransport(handler)
        async with httpx.AsyncClient(transport=transport) as client:
            return await send(client, "http://soak.invalid", "m", plan, 1, time.monotonic())

    return asyncio.run(go())


def test_the_client_finishes_cancels_and_disconnects_as_planned() -> None:
    for chat in (False, True):
        rec = _send(Plan(chat, True, 4, 2, 0, 0, "finish"))
        assert (rec.outcome, rec.tokens, rec.reason) == ("ok", 8, "")
        assert rec.ttft is not None and rec.end >= rec.start
    assert _send(Plan(False, False, 4, 1, 0, 0, "finish")).outcome == "ok"
    rec = _send(Plan(True, True, 8, 1, 0, 0, "cancel", after=3))
    assert rec.outcome == "cancelled" and rec.ttft is not None
    # Gone before the first token (the server is slower than the client's patience).
    rec = _send(Plan(False, True, 8, 1, 0, 0, "disconnect", delay_s=0.05), gap_s=1.0)
    assert rec.outcome == "disconnected" and rec.ttft is None
    rec = _send(Plan(False, True, 8, 1, 0, 0, "finish"), status=429)
    assert (rec.outcome, rec.reason) == ("rejected", "HTTP 429: too many requests")
