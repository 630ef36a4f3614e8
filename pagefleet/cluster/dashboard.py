"""The fleet's live dashboard: `GET /dashboard` (one static page) and `GET /dashboard/data` (JSON).

The page (`static/dashboard.html`, `dashboard.js`, `dashboard.css`; charts drawn
by uPlot, shipped in `static/uplot/` with its licence and version) is static and
open to anyone who can reach the server. It polls `/dashboard/data` every
`refresh_s` seconds; that endpoint needs `Authorization: Bearer KEY` when the
server has an API key (the page asks for the key once, on the first 401).

Where the numbers come from
---------------------------
`/dashboard/data` reads the very families `/metrics` exposes: the backend's
`metric_snapshots()` (every engine replica's families from the metrics hub plus
this ingress's router counters), merged by `metrics.merge_families`. Every
number it returns is one of `/metrics`' series, or is computed from them the
way the equivalent PromQL query would compute it:

* A sampler on the ingress reads the families every `sample_every_s` seconds
  (2 s) and reduces them to what the charts need (`Snapshot`): per replica the
  counters (generated tokens, finished requests, routed requests, requests migrated
  to another replica: those have no replica label, all reasons summed), the TTFT and
  inter-token-latency histogram buckets, the gauges (running, waiting, KV-cache
  usage, KV blocks), and the autoscaler's unlabelled fleet gauges when present.
* Between two consecutive snapshots it takes each counter's increase per
  replica as Prometheus' `increase()` does (`Step`): a value lower than before
  means the replica restarted and its counter began again from zero, so the
  increase is the new value; a replica missing from the earlier snapshot has
  no baseline and adds nothing to that step (as a new series in Prometheus).
  Histograms go bucket by bucket the same way (a reset if any bucket fell).
* The chart point of a snapshot (`Point`) sums the steps of the last
  `smooth_s` seconds (10 s) and divides by their duration, as `rate(x[10s])`:
  output tokens/s, requests/s, migrated requests/s, routed requests/s per replica. TTFT and
  inter-token latency p50/p99 are `histogram_quantile` of the bucket increases
  summed over those steps and replicas (null when nothing was observed then).
  Gauges are the snapshot's own values.
* A point depends only on snapshots up to its own, so it is computed once,
  when its snapshot arrives, and kept in a ring buffer of `history_s` (1 h);
  a request returns the last `minutes` (default 15) as columns, ready to plot.

Why on the server and not in the browser: the history is there when an
operator opens the page (after an incident, not only while a tab was open),
every viewer sees the same numbers, and each response is computed inside one
ingress process, so when several ingress replicas share the HTTP port each
response is consistent by itself whichever ingress answers a given poll.
The cost is one hub read per ingress every 2 s while the server runs, small
beside the replicas' own metric pushes (two a second each).

The replica count is `pagefleet:replicas` (the autoscaler's gauge) when the
ingress exports it, else the number of distinct `replica` labels of
`pagefleet:kv_blocks_total`, i.e. the replicas whose metrics the hub holds;
`latest.replicas_source` says which.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Protocol

from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.responses import HTMLResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from .metrics import merge_families

logger = logging.getLogger("pagefleet.cluster")

SAMPLE_EVERY_S = 2.0
SMOOTH_S = 10.0
HISTORY_S = 3600.0
DEFAULT_MINUTES = 15

# The series the dashboard reads (all in metrics.EXPORTED; the tests check that).
GENERATION_TOKENS = "vllm:generation_tokens"
REQUEST_SUCCESS = "vllm:request_success"
ROUTED_REQUESTS = "pagefleet:routed_requests"
MIGRATED_REQUESTS = "pagefleet:migrated_requests"
TTFT = "vllm:time_to_first_token_seconds"
ITL = "vllm:inter_token_latency_seconds"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
KV_BLOCKS_TOTAL = "pagefleet:kv_blocks_total"
REPLICAS = "pagefleet:replicas"
TARGET_REPLICAS = "pagefleet:target_replicas"
AUTOSCALER_KV = "pagefleet:autoscaler_kv_utilization"
AUTOSCALER_COMPUTE = "pagefleet:autoscaler_compute_utilization"
TENANT_QUEUE_DEPTH = "pagefleet:tenant_queue_depth"

COUNTERS = (GENERATION_TOKENS, REQUEST_SUCCESS, ROUTED_REQUESTS, MIGRATED_REQUESTS)
HISTOGRAMS = (TTFT, ITL)
GAUGES = (RUNNING, WAITING, KV_USAGE, KV_BLOCKS_TOTAL)
FLEET_GAUGES = (REPLICAS, TARGET_REPLICAS, AUTOSCALER_KV, AUTOSCALER_COMPUTE)
TENANT_GAUGES = (TENANT_QUEUE_DEPTH,)
READ = COUNTERS + HISTOGRAMS + GAUGES + FLEET_GAUGES + TENANT_GAUGES

PerReplica = dict[str, float]
Buckets = dict[float, float]  # upper bound (le) -> cumulative count


class MetricsSource(Protocol):
    """What the dashboard needs of `api.EngineBackend`."""

    async def metric_snapshots(self) -> list[list[Any]]: ...


# -- the numbers --------------------------------------------------------------------------


@dataclass(frozen=True)
class Snapshot:
    """One reading of the merged families, reduced to what the charts need."""

    wall: float  # unix time: the charts' x axis
    mono: float  # monotonic time: the rates' denominators
    counters: dict[str, PerReplica]  # counter family -> replica -> value (other labels summed)
    buckets: dict[str, dict[str, Buckets]]  # histogram family -> replica -> buckets
    gauges: dict[str, PerReplica]  # gauge family -> replica -> value
    fleet: dict[str, float]  # unlabelled fleet gauges, only those exported
    # requests waiting in the ingresses' fair queues, by tenant (summed over ingresses)
    tenant_queues: dict[str, float] = field(default_factory=dict)

    def replica_count(self) -> tuple[int, str]:
        if REPLICAS in self.fleet:
            return round(self.fleet[REPLICAS]), REPLICAS
        return len(self.gauges[KV_BLOCKS_TOTAL]), KV_BLOCKS_TOTAL


def reduce_families(families: Iterable[Any], wall: float, mono: float) -> Snapshot:
    """The series of READ from merged prometheus-client families, summed per replica.

    Counter families are named without `_total` and their samples with it;
    histogram buckets are the `_bucket` samples, keyed by their `le` bound.
    A fleet gauge reported more than once (one per ingress replica, all
    copies of the same autoscaler decision) counts once: its largest value.
    """
    counters: dict[str, PerReplica] = {name: {} for name in COUNTERS}
    buckets: dict[str, dict[str, Buckets]] = {name: {} for name in HISTOGRAMS}
    gauges: dict[str, PerReplica] = {name: {} for name in GAUGES}
    fleet: dict[str, float] = {}
    tenants: dict[str, float] = {}
    for fam in families:
        name = fam.name
        if name in COUNTERS:
            per = counters[name]
            for s in fam.samples:
                if s.name == name + "_total":
                    replica = s.labels.get("replica", "")
                    per[replica] = per.get(replica, 0.0) + s.value
        elif name in HISTOGRAMS:
            hist = buckets[name]
            for s in fam.samples:
                if s.name == name + "_bucket":
                    b = hist.setdefault(s.labels.get("replica", ""), {})
                    le = float(s.labels["le"])
                    b[le] = b.get(le, 0.0) + s.value
        elif name in GAUGES:
            per = gauges[name]
            for s in fam.samples:
                if s.name == name:
                    replica = s.labels.get("replica", "")
                    per[replica] = per.get(replica, 0.0) + s.value
        elif name in FLEET_GAUGES:
            values = [s.value for s in fam.samples if s.name == name]
            if values:
                fleet[name] = max(values)
        elif name in TENANT_GAUGES:
            for s in fam.samples:
                tenant = s.labels.get("tenant", "")
                tenants[tenant] = tenants.get(tenant, 0.0) + s.value
    return Snapshot(wall, mono, counters, buckets, gauges, fleet, tenants)


@dataclass(frozen=True)
class Step:
    """What happened between two consecutive snapshots."""

    dt: float
    counters: dict[str, PerReplica]  # counter family -> replica -> increase
    buckets: dict[str, Buckets]  # histogram family -> bucket increases, summed over replicas


def counter_increase(before: Mapping[str, float], after: Mapping[str, float]) -> PerReplica:
    """Per replica, as Prometheus' increase(): a drop is a restart counted from zero."""
    out: PerReplica = {}
    for replica, value in after.items():
        if replica in before:
            prev = before[replica]
            out[replica] = value - prev if value >= prev else value
    return out


def bucket_increase(before: Mapping[str, Buckets], after: Mapping[str, Buckets]) -> Buckets:
    """Bucket increases summed over replicas; per replica, any bucket that fell is a reset."""
    out: Buckets = {}
    for replica, now in after.items():
        prev = before.get(replica)
        if prev is None:
            continue
        reset = prev.keys() != now.keys() or any(now[le] < prev[le] for le in now)
        for le, count in now.items():
            out[le] = out.get(le, 0.0) + (count if reset else count - prev[le])
    return out


def step_between(before: Snapshot, after: Snapshot) -> Step:
    return Step(
        dt=after.mono - before.mono,
        counters={n: counter_increase(before.counters[n], after.counters[n]) for n in COUNTERS},
        buckets={n: bucket_increase(before.buckets[n], after.buckets[n]) for n in HISTOGRAMS},
    )


def histogram_quantile(q: float, buckets: Mapping[float, float]) -> float | None:
    """Prometheus' histogram_quantile over cumulative bucket counts {le: count}.

    The rank q * total lies in the first bucket whose cumulative count reaches
    it; the value is interpolated linearly between that bucket's lower bound
    (the previous bucket's upper bound, 0 for the first) and its upper bound.
    A rank in the +Inf bucket answers the largest finite bound. None when the
    buckets hold no observation.
    """
    if math.inf not in buckets or buckets[math.inf] <= 0:
        return None
    rank = q * buckets[math.inf]
    lower, below = 0.0, 0.0
    for le in sorted(buckets):
        count = buckets[le]
        if count >= rank:
            if le == math.inf:
                return lower
            return lower + (le - lower) * (rank - below) / (count - below)
        lower, below = le, count
    return lower


@dataclass(frozen=True)
class Point:
    """Every chart's value at one snapshot (None: nothing to show there)."""

    wall: float
    output_tokens_per_s: float | None
    requests_per_s: float | None
    migrated_per_s: float | None
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    itl_p50_s: float | None
    itl_p99_s: float | None
    replicas: int
    target_replicas: float | None
    autoscaler_kv_utilization: float | None
    autoscaler_compute_utilization: float | None
    kv_cache_usage: PerReplica
    running: PerReplica
    waiting: PerReplica
    routed_per_s: PerReplica


FLEET_SERIES = (
    "output_tokens_per_s",
    "requests_per_s",
    "migrated_per_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "itl_p50_s",
    "itl_p99_s",
    "replicas",
    "target_replicas",
    "autoscaler_kv_utilization",
    "autoscaler_compute_utilization",
)
REPLICA_SERIES = ("kv_cache_usage", "running", "waiting", "routed_per_s")


def point_at(snap: Snapshot, steps: list[Step]) -> Point:
    """The point of `snap` from the steps that end at it (newest last), over their duration."""
    dt = sum(s.dt for s in steps)
    rated = dt > 0

    def rate(name: str) -> float | None:
        return sum(sum(s.counters[name].values()) for s in steps) / dt if rated else None

    routed: PerReplica = {}
    if rated:
        for s in steps:
            for replica, inc in s.counters[ROUTED_REQUESTS].items():
                routed[replica] = routed.get(replica, 0.0) + inc
        routed = {r: v / dt for r, v in routed.items()}

    def quantiles(name: str) -> tuple[float | None, float | None]:
        summed: Buckets = {}
        for s in steps:
            for le, inc in s.buckets[name].items():
                summed[le] = summed.get(le, 0.0) + inc
        return histogram_quantile(0.5, summed), histogram_quantile(0.99, summed)

    ttft50, ttft99 = quantiles(TTFT)
    itl50, itl99 = quantiles(ITL)
    return Point(
        wall=snap.wall,
        output_tokens_per_s=rate(GENERATION_TOKENS),
        requests_per_s=rate(REQUEST_SUCCESS),
        migrated_per_s=rate(MIGRATED_REQUESTS),
        ttft_p50_s=ttft50,
        ttft_p99_s=ttft99,
        itl_p50_s=itl50,
        itl_p99_s=itl99,
        replicas=snap.replica_count()[0],
        target_replicas=snap.fleet.get(TARGET_REPLICAS),
        autoscaler_kv_utilization=snap.fleet.get(AUTOSCALER_KV),
        autoscaler_compute_utilization=snap.fleet.get(AUTOSCALER_COMPUTE),
        kv_cache_usage=dict(snap.gauges[KV_USAGE]),
        running=dict(snap.gauges[RUNNING]),
        waiting=dict(snap.gauges[WAITING]),
        routed_per_s=routed,
    )


def _round(value: float | None) -> float | None:
    # Six significant digits keep the JSON small; the charts show three or four.
    return None if value is None else float(f"{value:.6g}")


# -- the sampler -------------------------------------------------------------------------


class Dashboard:
    """The ring buffer of points, fed by a sampler task on the app's event loop."""

    def __init__(
        self,
        source: MetricsSource,
        *,
        sample_every_s: float = SAMPLE_EVERY_S,
        smooth_s: float = SMOOTH_S,
        history_s: float = HISTORY_S,
    ) -> None:
        self.source = source
        self.sample_every_s = sample_every_s
        self.smooth_s = smooth_s
        self.history_s = history_s
        self._points: deque[Point] = deque(maxlen=math.ceil(history_s / sample_every_s) + 1)
        self._steps: deque[Step] = deque()
        self._last: Snapshot | None = None
        # The sampler and the request handlers may run on different event loops (Serve runs
        # user code on its own loop): a thread lock keeps `add` atomic for both.
        self._lock = threading.Lock()
        self._task: asyncio.Task[None] | None = None
        self.error: str | None = None

    # The pure part: a snapshot in, a point out.

    def add(
        self, families: Iterable[Any], wall: float, mono: float, min_gap_s: float = 0.0
    ) -> Point | None:
        """Reduce, step, append; None when the previous snapshot is under min_gap_s old."""
        snap = reduce_families(families, wall, mono)
        with self._lock:
            last = self._last
            if last is not None and mono - last.mono < max(min_gap_s, 1e-9):
                return None
            if last is not None:
                self._steps.append(step_between(last, snap))
                # Keep just the newest steps that cover smooth_s.
                while (
                    len(self._steps) > 1
                    and sum(s.dt for s in self._steps) - self._steps[0].dt >= self.smooth_s
                ):
                    self._steps.popleft()
            point = point_at(snap, list(self._steps))
            self._points.append(point)
            self._last = snap
            return point

    async def sample(
        self, wall: float | None = None, mono: float | None = None, min_gap_s: float = 0.0
    ) -> Point | None:
        """Read the backend's families now and add them (times overridable for tests)."""
        snapshots = await self.source.metric_snapshots()
        families = merge_families(snapshots)
        return self.add(
            families,
            time.time() if wall is None else wall,
            time.monotonic() if mono is None else mono,
            min_gap_s,
        )

    async def sample_if_stale(self) -> None:
        """A fresh snapshot unless the sampler took one within the period (both may run)."""
        last = self._last
        if last is None or time.monotonic() - last.mono >= self.sample_every_s:
            await self._sample_logged(min_gap_s=self.sample_every_s / 2)

    async def _sample_logged(self, min_gap_s: float) -> None:
        try:
            await self.sample(min_gap_s=min_gap_s)
        except Exception as e:  # the hub restarting, a replica dying: keep the history
            if self.error is None:
                logger.warning("dashboard: could not read the metrics", exc_info=True)
            self.error = f"{type(e).__name__}: {e}"
        else:
            self.error = None

    async def _run(self) -> None:
        next_at = time.monotonic()
        while True:
            await self._sample_logged(min_gap_s=self.sample_every_s / 2)
            # Fixed-rate ticks: a slow hub read shortens the wait instead of drifting.
            next_at = max(next_at + self.sample_every_s, time.monotonic())
            await asyncio.sleep(next_at - time.monotonic())

    def start(self) -> None:
        """Start the sampler on the running loop (again if it died or runs on another loop)."""
        task = self._task
        loop = asyncio.get_running_loop()
        if task is not None and not task.done():
            if task.get_loop() is loop:
                return
            _cancel_elsewhere(task)  # one sampler at a time
        self._task = loop.create_task(self._run(), name="pagefleet-dashboard-sampler")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is None:
            return
        if task.get_loop() is not asyncio.get_running_loop():
            _cancel_elsewhere(task)
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    # What /dashboard/data answers.

    def data(self, minutes: float = DEFAULT_MINUTES) -> dict[str, Any]:
        with self._lock:
            points = list(self._points)
            last = self._last
        if points:
            since = points[-1].wall - minutes * 60
            points = [p for p in points if p.wall >= since]
        replicas = sorted({r for p in points for name in REPLICA_SERIES for r in getattr(p, name)})
        return {
            "minutes": minutes,
            "sample_every_s": self.sample_every_s,
            "smooth_s": self.smooth_s,
            "refresh_s": self.sample_every_s,
            "error": self.error,
            "replicas": replicas,
            "t": [round(p.wall, 3) for p in points],
            "fleet": {name: [_round(getattr(p, name)) for p in points] for name in FLEET_SERIES},
            "per_replica": {
                name: {r: [_round(getattr(p, name).get(r)) for p in points] for r in replicas}
                for name in REPLICA_SERIES
            },
            "latest": None if last is None else _latest(last),
        }


def _cancel_elsewhere(task: asyncio.Task[None]) -> None:
    """Cancel a task of another event loop (a no-op when that loop is already closed)."""
    with contextlib.suppress(RuntimeError):
        task.get_loop().call_soon_threadsafe(task.cancel)


def _latest(snap: Snapshot) -> dict[str, Any]:
    """The newest snapshot's raw values under their `/metrics` sample names."""
    count, source = snap.replica_count()
    return {
        "t": round(snap.wall, 3),
        "replicas": count,
        "replicas_source": source,
        "target_replicas": snap.fleet.get(TARGET_REPLICAS),
        "autoscaler_kv_utilization": snap.fleet.get(AUTOSCALER_KV),
        "autoscaler_compute_utilization": snap.fleet.get(AUTOSCALER_COMPUTE),
        "gauges": {name: dict(snap.gauges[name]) for name in GAUGES},
        "tenant_queues": dict(snap.tenant_queues),
        "counters": {f"{name}_total": dict(snap.counters[name]) for name in COUNTERS},
        "histogram_counts": {
            f"{name}_count": {r: b.get(math.inf, 0.0) for r, b in snap.buckets[name].items()}
            for name in HISTOGRAMS
        },
    }


# -- the routes --------------------------------------------------------------------------

# Everything the page loads, by the name it asks for (no directory listing, no other file).
_STATIC = {
    "dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
    "dashboard.css": ("dashboard.css", "text/css; charset=utf-8"),
    "uPlot.iife.min.js": ("uplot/uPlot.iife.min.js", "text/javascript; charset=utf-8"),
    "uPlot.min.css": ("uplot/uPlot.min.css", "text/css; charset=utf-8"),
}


def _static_file(path: str) -> bytes:
    return resources.files(__package__).joinpath("static", *path.split("/")).read_bytes()


def dashboard_router(dashboard: Dashboard) -> APIRouter:
    """`/dashboard`, its static files, and `/dashboard/data` (behind the API key if set)."""
    router = APIRouter()
    # Read once: the files are part of the package and never change while it runs.
    page = _static_file("dashboard.html")
    files = {name: (_static_file(path), media) for name, (path, media) in _STATIC.items()}

    @router.get("/dashboard", include_in_schema=False)
    async def dashboard_page() -> HTMLResponse:
        return HTMLResponse(page, headers={"Cache-Control": "no-cache"})

    @router.get("/dashboard/static/{name}", include_in_schema=False)
    async def dashboard_static(name: str) -> Response:
        if name not in files:
            raise StarletteHTTPException(404, f"no dashboard file {name!r}")
        content, media = files[name]
        return Response(content, media_type=media, headers={"Cache-Control": "no-cache"})

    @router.get("/dashboard/data")
    async def dashboard_data(
        request: Request,
        minutes: float = Query(DEFAULT_MINUTES, gt=0, le=dashboard.history_s / 60),
    ) -> Any:
        """The charts' series over the last `minutes` and the newest raw values (module doc)."""
        dashboard.start()  # where the app's startup hook did not run (or its loop went away)
        await dashboard.sample_if_stale()
        return dashboard.data(minutes)

    return router


def add_dashboard(app: FastAPI, source: MetricsSource, **options: float) -> Dashboard:
    """Mount the dashboard on `app`; its sampler runs from the app's startup to shutdown.
    With an API key, the app's gate (`api._Gate`) guards `/dashboard/data` as it guards
    `/v1/*`; the page and its files stay open (the page asks for the key)."""
    dashboard = Dashboard(source, **options)
    app.include_router(dashboard_router(dashboard))
    app.state.dashboard = dashboard

    async def start() -> None:
        dashboard.start()

    app.router.on_startup.append(start)
    app.router.on_shutdown.append(dashboard.stop)
    return dashboard
