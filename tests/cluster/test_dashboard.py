"""The dashboard's numbers (pagefleet/cluster/dashboard.py) and its routes on the in-process app.

The arithmetic is checked exactly on hand-made prometheus-client families (rates,
Prometheus' counter-reset and histogram_quantile rules, the smoothing window, the
replica count); the routes on `create_app` over a real engine replica (no Ray) and
uvicorn: the page and its files, the API key on `/dashboard/data`, and the JSON's
newest values equal to `/metrics` sample for sample.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from pagefleet.bench.launcher import first_free_port
from pagefleet.cluster.config import ServeConfig
from pagefleet.cluster.dashboard import (
    FLEET_SERIES,
    READ,
    REPLICA_SERIES,
    Dashboard,
    histogram_quantile,
)
from pagefleet.cluster.http import create_app
from pagefleet.cluster.metrics import EXPORTED
from pagefleet.cluster.replica import LLMReplica, LocalBackend
from tests.conftest import tokenizer_for

# Servers the dashboard tests start listen in this range (other suites use ephemeral ports).
PORTS = range(8200, 8300)
KEY = "sk-dashboard-test"
ENGINE = {"num_kv_blocks": 64, "block_size": 8, "max_num_seqs": 16, "max_model_len": 128}
LABELS = ["model_name", "replica"]


def port_in_range() -> int:
    port = first_free_port(PORTS)
    if port is None:
        raise RuntimeError(f"no free port in {PORTS}")
    return port


# -- hand-made families -------------------------------------------------------------------

TTFT_LE = ("0.1", "0.5", "1.0", "+Inf")


@dataclass
class Rep:
    """One replica's cumulative values at one instant."""

    tokens: float = 0.0
    finished: float = 0.0
    ttft: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)  # cumulative, per TTFT_LE
    running: float = 0.0
    waiting: float = 0.0
    kv: float = 0.0
    blocks: float = 64.0
    routed: float | None = None


def families(reps: dict[str, Rep], fleet: dict[str, float] | None = None) -> list[Any]:
    """What merge_families hands the dashboard, for these replicas (and fleet gauges)."""
    tokens = CounterMetricFamily("vllm:generation_tokens", "", labels=LABELS)
    success = CounterMetricFamily("vllm:request_success", "", labels=[*LABELS, "finished_reason"])
    routed = CounterMetricFamily("pagefleet:routed_requests", "", labels=["replica", "policy"])
    ttft = HistogramMetricFamily("vllm:time_to_first_token_seconds", "", labels=LABELS)
    gauges = {
        "vllm:num_requests_running": GaugeMetricFamily(
            "vllm:num_requests_running", "", labels=LABELS
        ),
        "vllm:num_requests_waiting": GaugeMetricFamily(
            "vllm:num_requests_waiting", "", labels=LABELS
        ),
        "vllm:kv_cache_usage_perc": GaugeMetricFamily(
            "vllm:kv_cache_usage_perc", "", labels=LABELS
        ),
        "pagefleet:kv_blocks_total": GaugeMetricFamily(
            "pagefleet:kv_blocks_total", "", labels=LABELS
        ),
    }
    for name, r in reps.items():
        tokens.add_metric(["tiny", name], r.tokens)
        # Two finish reasons: the dashboard sums a replica's requests over them.
        success.add_metric(["tiny", name, "length"], r.finished - 1 if r.finished else 0.0)
        success.add_metric(["tiny", name, "stop"], 1.0 if r.finished else 0.0)
        if r.routed is not None:
            routed.add_metric([name, "most_free_blocks"], r.routed)
        ttft.add_metric(
            ["tiny", name], buckets=list(zip(TTFT_LE, r.ttft, strict=True)), sum_value=0.0
        )
        for fam, value in zip(gauges.values(), (r.running, r.waiting, r.kv, r.blocks), strict=True):
            fam.add_metric(["tiny", name], value)
    out: list[Any] = [tokens, success, routed, ttft, *gauges.values()]
    for name, value in (fleet or {}).items():
        out.append(GaugeMetricFamily(name, "", value=value))
    return out


def migrated(by_reason: dict[str, float]) -> Any:
    """An ingress's `pagefleet:migrated_requests` (no replica label)."""
    fam = CounterMetricFamily("pagefleet:migrated_requests", "", labels=["ingress", "reason"])
    for reason, value in by_reason.items():
        fam.add_metric(["ingress-a", reason], value)
    return fam


def test_migrations_per_second_sum_every_reason() -> None:
    dash = new_dashboard()
    reps = {"r0": Rep()}
    dash.add([*families(reps), migrated({"replica_failed": 2, "scale_in": 0})], 1000.0, 0.0)
    dash.add([*families(reps), migrated({"replica_failed": 5, "scale_in": 3})], 1002.0, 2.0)
    d = dash.data()
    assert d["fleet"]["migrated_per_s"] == [None, 3.0]
    assert d["latest"]["counters"]["pagefleet:migrated_requests_total"] == {"": 8.0}


def feed(dash: Dashboard, timeline: list[tuple[float, dict[str, Rep]]]) -> None:
    for t, reps in timeline:
        dash.add(families(reps), wall=1000.0 + t, mono=t)


class NoSource:
    async def metric_snapshots(self) -> list[list[Any]]:
        raise AssertionError("these tests add families by hand")


def new_dashboard(**kw: float) -> Dashboard:
    return Dashboard(NoSource(), **kw)


# -- the arithmetic ---------------------------------------------------------------------


def test_reads_only_exported_series() -> None:
    assert set(READ) <= set(EXPORTED)


def test_rates_and_percentiles_from_counter_and_bucket_increases() -> None:
    dash = new_dashboard()
    feed(
        dash,
        [
            (0.0, {"a": Rep(), "b": Rep()}),
            (2.0, {"a": Rep(tokens=10, finished=2, ttft=(1, 3, 4, 4)), "b": Rep(tokens=6)}),
            (4.0, {"a": Rep(tokens=30, finished=4, ttft=(1, 3, 4, 4)), "b": Rep(tokens=6)}),
        ],
    )
    d = dash.data()
    assert d["t"] == [1000.0, 1002.0, 1004.0]
    f = d["fleet"]
    assert f["output_tokens_per_s"] == [None, 8.0, 9.0]  # 16 / 2 s; 36 / 4 s (both steps)
    assert f["requests_per_s"] == [None, 1.0, 1.0]  # 2 / 2 s; 4 / 4 s
    # Four TTFTs: one <= 0.1, two in (0.1, 0.5], one in (0.5, 1]. p50: rank 2 in the
    # second bucket, halfway from 1 to 3 -> 0.1 + 0.4 * 1/2. p99: rank 3.96 in the third.
    assert f["ttft_p50_s"] == [None, 0.3, 0.3]
    assert f["ttft_p99_s"] == [None, 0.98, 0.98]
    assert f["itl_p50_s"] == [None, None, None]  # no ITL family at all
    assert f["replicas"] == [2, 2, 2]  # distinct replicas of pagefleet:kv_blocks_total
    assert f["target_replicas"] == [None, None, None]
    assert d["replicas"] == ["a", "b"]
    assert d["per_replica"]["routed_per_s"] == {"a": [None, None, None], "b": [None, None, None]}
    assert d["latest"]["replicas"] == 2
    assert d["latest"]["replicas_source"] == "pagefleet:kv_blocks_total"
    assert d["latest"]["counters"]["vllm:generation_tokens_total"] == {"a": 30.0, "b": 6.0}
    assert d["latest"]["counters"]["vllm:request_success_total"] == {"a": 4.0, "b": 0.0}
    assert d["latest"]["histogram_counts"]["vllm:time_to_first_token_seconds_count"] == {
        "a": 4.0,
        "b": 0.0,
    }


def test_rates_cover_the_last_smooth_s_seconds() -> None:
    dash = new_dashboard(smooth_s=4.0)
    # 2 tokens/s for 6 s, then 10 tokens/s.
    tokens = [0, 4, 8, 12, 32, 52]
    feed(dash, [(2.0 * i, {"a": Rep(tokens=v)}) for i, v in enumerate(tokens)])
    # Each point from 4 s back (two steps) once there are two: (12-4)/4, (32-8)/4, (52-12)/4.
    assert dash.data()["fleet"]["output_tokens_per_s"] == [None, 2.0, 2.0, 2.0, 6.0, 10.0]


def test_a_restarted_replica_counts_from_zero_and_a_new_one_from_its_first_sample() -> None:
    dash = new_dashboard(smooth_s=2.0)
    feed(
        dash,
        [
            (0.0, {"a": Rep(tokens=100, ttft=(0, 2, 2, 2))}),
            # a restarted (100 -> 6 tokens: 6 since); b appears with 50 already counted.
            (2.0, {"a": Rep(tokens=6, ttft=(1, 1, 1, 1)), "b": Rep(tokens=50)}),
            (4.0, {"a": Rep(tokens=10, ttft=(1, 1, 1, 1)), "b": Rep(tokens=54)}),
        ],
    )
    f = dash.data()["fleet"]
    assert f["output_tokens_per_s"] == [None, 3.0, 4.0]  # 6 / 2; (4 + 4) / 2
    # After the reset a's histogram restarts too: one TTFT <= 0.1 -> p50 at half of 0.1.
    assert f["ttft_p50_s"] == [None, 0.05, None]


def test_fleet_gauges_when_the_autoscaler_exports_them() -> None:
    dash = new_dashboard()
    reps = {"a": Rep(routed=0), "b": Rep(routed=0)}
    dash.add(families(reps), 1000.0, 0.0)
    gauges = {
        "pagefleet:replicas": 3.0,
        "pagefleet:target_replicas": 4.0,
        "pagefleet:autoscaler_kv_utilization": 0.75,
        "pagefleet:autoscaler_compute_utilization": 0.375,
    }
    reps = {"a": Rep(routed=6, kv=0.5), "b": Rep(routed=2, kv=0.25)}
    dash.add(families(reps, gauges), 1002.0, 2.0)
    d = dash.data()
    # pagefleet:replicas wins over the count of replicas that report (a third is starting).
    assert d["fleet"]["replicas"] == [2, 3]
    assert d["fleet"]["target_replicas"] == [None, 4.0]
    assert d["fleet"]["autoscaler_kv_utilization"] == [None, 0.75]
    assert d["fleet"]["autoscaler_compute_utilization"] == [None, 0.375]
    assert d["per_replica"]["routed_per_s"] == {"a": [None, 3.0], "b": [None, 1.0]}
    assert d["per_replica"]["kv_cache_usage"] == {"a": [0.0, 0.5], "b": [0.0, 0.25]}
    latest = d["latest"]
    assert (latest["replicas"], latest["replicas_source"]) == (3, "pagefleet:replicas")
    assert (latest["target_replicas"], latest["autoscaler_kv_utilization"]) == (4.0, 0.75)
    assert latest["autoscaler_compute_utilization"] == 0.375


def test_tenant_queues_summed_over_ingresses() -> None:
    dash = new_dashboard()
    depth = GaugeMetricFamily("pagefleet:tenant_queue_depth", "", labels=["ingress", "tenant"])
    for ingress, tenant, n in (("i0", "acme", 3), ("i1", "acme", 2), ("i0", "key-1a2b", 0)):
        depth.add_metric([ingress, tenant], n)
    dash.add([*families({"a": Rep()}), depth], 1000.0, 0.0)
    assert dash.data()["latest"]["tenant_queues"] == {"acme": 5.0, "key-1a2b": 0.0}
    dash.add(families({"a": Rep()}), 1002.0, 2.0)  # no fair queue: nothing listed
    assert dash.data()["latest"]["tenant_queues"] == {}


def test_window_minutes_and_replicas_that_come_and_go() -> None:
    dash = new_dashboard(sample_every_s=60.0, history_s=600.0)
    timeline: list[tuple[float, dict[str, Rep]]] = [
        (0.0, {"a": Rep(running=1)}),
        (60.0, {"a": Rep(running=2), "b": Rep(waiting=3)}),
        (120.0, {"b": Rep(waiting=1)}),
    ]
    feed(dash, timeline)
    d = dash.data(minutes=1.0)
    assert d["t"] == [1060.0, 1120.0]
    assert d["replicas"] == ["a", "b"]
    assert d["per_replica"]["running"] == {"a": [2.0, None], "b": [0.0, 0.0]}
    assert d["per_replica"]["waiting"] == {"a": [0.0, None], "b": [3.0, 1.0]}
    assert set(d["fleet"]) == set(FLEET_SERIES) and set(d["per_replica"]) == set(REPLICA_SERIES)
    assert dash.data()["t"] == [1000.0, 1060.0, 1120.0]
    # The ring buffer holds history_s: 11 points at one a minute.
    feed(dash, [(60.0 * i, {"a": Rep()}) for i in range(3, 20)])
    assert dash.data(minutes=60)["t"] == [1000.0 + 60 * i for i in range(9, 20)]


def test_a_snapshot_within_min_gap_is_not_added() -> None:
    dash = new_dashboard()
    assert dash.add(families({"a": Rep()}), 1000.0, 0.0) is not None
    assert dash.add(families({"a": Rep()}), 1000.5, 0.5, min_gap_s=1.0) is None
    assert dash.add(families({"a": Rep()}), 1001.0, 1.0, min_gap_s=1.0) is not None
    assert len(dash.data()["t"]) == 2


class EmptySource:
    async def metric_snapshots(self) -> list[list[Any]]:
        return [families({"a": Rep()})]


def test_one_sampler_even_when_requests_run_on_another_event_loop() -> None:
    dash = Dashboard(EmptySource(), sample_every_s=0.05)
    other = asyncio.new_event_loop()
    thread = threading.Thread(target=other.run_forever, daemon=True)
    thread.start()

    async def start() -> asyncio.Task[None]:
        dash.start()
        assert dash._task is not None
        return dash._task

    first = asyncio.run_coroutine_threadsafe(start(), other).result(10)

    async def here() -> None:
        dash.start()  # another loop: its own sampler, and the first one is cancelled
        assert dash._task is not None and dash._task is not first
        dash.start()  # same loop, still running: kept
        await asyncio.sleep(0.3)
        await dash.stop()
        assert dash._task is None

    asyncio.run(here())

    async def cancelled() -> bool:
        with contextlib.suppress(asyncio.CancelledError):
            await first
        return first.cancelled()

    assert asyncio.run_coroutine_threadsafe(cancelled(), other).result(10)
    other.call_soon_threadsafe(other.stop)
    thread.join(10)
    other.close()
    assert len(dash.data()["t"]) >= 3  # both samplers added points, one at a time


def test_histogram_quantile_follows_prometheus() -> None:
    inf = math.inf
    assert histogram_quantile(0.5, {}) is None
    assert histogram_quantile(0.5, {1.0: 0.0, inf: 0.0}) is None
    assert histogram_quantile(0.5, {1.0: 4.0, inf: 4.0}) == 0.5  # from 0 in the first bucket
    assert histogram_quantile(0.99, {1.0: 1.0, 2.0: 1.0, inf: 10.0}) == 2.0  # +Inf: top bound
    assert histogram_quantile(0.25, {1.0: 0.0, 2.0: 4.0, inf: 4.0}) == 1.25


# -- the routes on the in-process app ----------------------------------------------------


def test_every_static_file_is_package_data() -> None:
    # A wheel ships only what pyproject's package-data globs name (a non-editable install
    # without them would serve 500s); checked here without building one.
    import fnmatch
    import tomllib

    root = Path(__file__).resolve().parents[2]
    setuptools = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    static = root / "pagefleet" / "cluster" / "static"
    for path in sorted(p for p in static.rglob("*") if p.is_file()):
        rel = path.relative_to(static)
        package = ".".join(["pagefleet", "cluster", "static", *rel.parent.parts])
        assert package in setuptools["packages"], package
        globs = setuptools["package-data"][package]
        assert any(fnmatch.fnmatch(rel.name, g) for g in globs), rel


@dataclass
class InProcess:
    url: str
    replica: LLMReplica
    app: FastAPI
    loop: asyncio.AbstractEventLoop

    def run(self, coro: Any, timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


@contextlib.contextmanager
def in_process_server(llama_dir: str, api_key: str | None) -> Iterator[InProcess]:
    """create_app over one in-process engine replica, served by uvicorn in a thread."""
    import uvicorn

    config = ServeConfig.model_validate(
        {"model": llama_dir, "served_model_name": "tiny", "engine": ENGINE}
    )
    replica = LLMReplica(config, "r0", in_process=True)
    app = create_app(
        LocalBackend(replica), tokenizer_for(llama_dir), "tiny", config.limits, api_key=api_key
    )
    loops: list[asyncio.AbstractEventLoop] = []

    async def remember_loop() -> None:
        loops.append(asyncio.get_running_loop())

    app.router.on_startup.append(remember_loop)
    port = port_in_range()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    h = InProcess(f"http://127.0.0.1:{port}", replica, app, loops[0])
    try:
        yield h
        result = h.run(replica.check_block_accounting())
        assert result["free"] == result["total"] == ENGINE["num_kv_blocks"]
    finally:
        h.run(replica.shutdown())
        server.should_exit = True  # runs the app's shutdown: the dashboard's sampler stops
        thread.join(30)
    assert not thread.is_alive()
    assert app.state.dashboard._task is None


@pytest.fixture(scope="module")
def keyed(llama_dir: str) -> Iterator[InProcess]:
    with in_process_server(llama_dir, api_key=KEY) as h:
        yield h


def complete(url: str, n: int, max_tokens: int) -> None:
    body = {"model": "tiny", "prompt": "def", "max_tokens": max_tokens, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    for _ in range(n):
        r = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == max_tokens


def test_page_and_files_are_open(keyed: InProcess) -> None:
    page = httpx.get(f"{keyed.url}/dashboard")
    assert page.status_code == 200
    assert page.headers["content-type"] == "text/html; charset=utf-8"
    for src in ("dashboard/static/uPlot.iife.min.js", "dashboard/static/dashboard.js"):
        assert f'<script src="{src}">' in page.text
    # Everything the page loads is served (relative URLs, resolved against /dashboard).
    loads = re.findall(r'(?:src|href)="(dashboard/static/[^"]+)"', page.text)
    assert len(loads) == 4
    for rel in loads:
        assert httpx.get(f"{keyed.url}/{rel}").status_code == 200, rel
    js = httpx.get(f"{keyed.url}/dashboard/static/uPlot.iife.min.js")
    assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
    assert js.text.startswith("/*! https://github.com/leeoniya/uPlot (v1.6.32) */")
    css = httpx.get(f"{keyed.url}/dashboard/static/dashboard.css")
    assert css.status_code == 200 and css.headers["content-type"].startswith("text/css")
    missing = httpx.get(f"{keyed.url}/dashboard/static/LICENSE")
    assert missing.status_code == 404
    assert missing.json()["error"]["message"] == "no dashboard file 'LICENSE'"


def test_data_needs_the_api_key(keyed: InProcess) -> None:
    url = f"{keyed.url}/dashboard/data"
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.get(url, headers=headers)
        assert r.status_code == 401, headers
        assert r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"]["type"] == "AuthenticationError"
        assert r.json()["error"]["code"] == 401
    ok = httpx.get(url, headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200
    assert ok.json()["minutes"] == 15
    bad = httpx.get(f"{url}?minutes=0", headers={"Authorization": f"Bearer {KEY}"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "minutes"


class NoMetrics:
    async def metric_snapshots(self) -> list[list[Any]]:
        raise RuntimeError("no metrics here")


def test_without_a_key_the_data_are_open_and_a_failed_read_is_reported(llama_dir: str) -> None:
    # create_app's default (no key); a backend whose metrics cannot be read.
    app = create_app(NoMetrics(), tokenizer_for(llama_dir), "tiny")  # type: ignore[arg-type]
    with TestClient(app) as client:
        r = client.get("/dashboard/data")
        assert r.status_code == 200
        assert r.json()["t"] == [] and r.json()["latest"] is None
        assert r.json()["error"] == "RuntimeError: no metrics here"


def scrape(url: str, key: str | None = None) -> dict[str, dict[str, float]]:
    """{sample name: {replica: value}} of /metrics, summed over other labels (with the
    API key where the server has one: /metrics then needs it)."""
    out: dict[str, dict[str, float]] = {}
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics", headers=headers).text):
        for s in fam.samples:
            if "replica" in s.labels and s.labels.get("le") in (None, "+Inf"):
                per = out.setdefault(s.name, {})
                per[s.labels["replica"]] = per.get(s.labels["replica"], 0.0) + s.value
    return out


def test_data_are_the_numbers_of_metrics(keyed: InProcess) -> None:
    complete(keyed.url, 3, 5)
    keyed.run(keyed.replica.check_block_accounting())  # idle: nothing moves any more
    keyed.run(keyed.app.state.dashboard.sample())
    metrics = scrape(keyed.url, KEY)
    d = httpx.get(f"{keyed.url}/dashboard/data", headers={"Authorization": f"Bearer {KEY}"}).json()
    latest = d["latest"]
    for name, per in latest["gauges"].items():
        assert per == metrics[name], name
    ingress_only = ("pagefleet:routed_requests_total", "pagefleet:migrated_requests_total")
    for name, per in latest["counters"].items():
        if name not in ingress_only:  # no router and no migration without Ray
            assert per == metrics[name], name
    for name in ingress_only:
        assert latest["counters"][name] == {}
    for name, per in latest["histogram_counts"].items():
        assert per == metrics[name], name
    assert latest["counters"]["vllm:generation_tokens_total"]["r0"] >= 15
    assert (latest["replicas"], latest["replicas_source"]) == (1, "pagefleet:kv_blocks_total")
    assert latest["target_replicas"] is None and latest["autoscaler_kv_utilization"] is None
    assert d["replicas"] == ["r0"]
    assert d["per_replica"]["kv_cache_usage"]["r0"][-1] == 0.0
    assert d["error"] is None


def test_rates_from_a_real_replica(keyed: InProcess) -> None:
    # A Dashboard of its own over the same replica, sampled at chosen instants, so that
    # the rate is exact: 4 requests of 8 tokens between t=100 s and t=104 s.
    dash = Dashboard(LocalBackend(keyed.replica))
    keyed.run(dash.sample(wall=100.0, mono=100.0))
    complete(keyed.url, 4, 8)
    keyed.run(keyed.replica.check_block_accounting())
    keyed.run(dash.sample(wall=104.0, mono=104.0))
    f = dash.data()["fleet"]
    assert f["output_tokens_per_s"] == [None, 8.0]
    assert f["requests_per_s"] == [None, 1.0]
    assert f["ttft_p50_s"][1] is not None and f["ttft_p50_s"][1] <= f["ttft_p99_s"][1]
    assert f["itl_p50_s"][1] is not None and f["itl_p50_s"][1] <= f["itl_p99_s"][1]
