"""Prometheus metrics with vLLM's names and meanings, one scrape target for the fleet.

Each engine replica keeps its own `ReplicaMetrics` (a private
prometheus-client registry, labelled with model_name and replica) and pushes
a snapshot of its metric families to the app's `MetricsHub`, a named Ray
actor, about twice a second. The ingress's `/metrics` asks the hub for every
replica's latest snapshot and exposes them merged, family by family, through
prometheus-client's own exposition: users scrape one URL and never discover
replica ports. A replica that stops pushing is dropped after `stale_after_s`.

What only pagefleet has (router decisions, replica counts) goes under
`pagefleet:`; the `vllm:` series keep vLLM's exact names, types and units so
existing dashboards and scalers work unchanged. The router's counters live in
each ingress replica's process; every ingress exposes its own and the others'
(pushed to the hub), each labelled with its `ingress`, so a scrape of any
ingress holds every series once: sum over `ingress` for fleet totals.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable
from typing import Any

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.metrics_core import Metric

from pagefleet.engine import EngineStats, RequestMetrics, RequestOutputDelta, SamplingParams
from pagefleet.engine.startup import StartupTimeline
from pagefleet.engine.stats import ITERATION_TOKEN_BUCKETS


def registered(
    kind: Any,
    name: str,
    doc: str,
    labels: tuple[str, ...],
    registry: CollectorRegistry = REGISTRY,
    **kwargs: Any,
) -> Any:
    """The metric `name` in `registry`: the one something in this process registered
    first (registering a name twice raises), else a new `kind` (Counter, Gauge, Histogram;
    `kwargs` such as `buckets` go to it)."""
    existing = getattr(registry, "_names_to_collectors", {})
    if name in existing:
        return existing[name]
    try:
        return kind(name, doc, labels, registry=registry, **kwargs)
    except ValueError:  # registered by another thread in between
        return getattr(registry, "_names_to_collectors", {}).get(name)


# vLLM exports no `_created` series; neither do we (fewer series per replica).
disable_created_metrics()

LABELS = ("model_name", "replica")

# vLLM's buckets (vllm/v1/metrics/loggers.py), so dashboards' bucket queries match.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)
N_BUCKETS = (1, 2, 5, 10, 20)

# Every series this module exports (without the _total/_bucket suffixes); the
# dashboard and its tests check their queries against this.
EXPORTED = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:num_preemptions",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:request_success",
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
    "vllm:request_time_per_output_token_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:request_inference_time_seconds",
    "vllm:request_params_n",
    "vllm:request_params_max_tokens",
    "vllm:cache_config_info",
    "vllm:iteration_tokens_total",
    "pagefleet:kv_blocks_free",
    "pagefleet:kv_blocks_total",
    "pagefleet:kv_blocks_hot",
    # the replica's start-up timeline (pagefleet/engine/startup.py)
    "pagefleet:replica_startup_seconds",  # phase
    "pagefleet:replica_start_time_seconds",
    # structured outputs (the engine's GrammarCompiler); vLLM has no series for these
    "pagefleet:structured_output_compiles",
    "pagefleet:structured_output_compile_seconds",
    "pagefleet:structured_output_cache_hits",
    "pagefleet:structured_output_cache_misses",
    # pagefleet/cluster/http/observability.py, in each ingress: labelled `ingress`
    "pagefleet:http_responses",  # ingress, status
    "pagefleet:client_time_to_first_token_seconds",  # ingress, model_name
    # pagefleet/cluster/routing/serve_common.py, in each ingress's router: labelled with that ingress replica's id
    # (`ingress`), since every ingress's /metrics also shows the other ingresses' counters
    "pagefleet:routed_requests",  # ingress, replica, policy
    "pagefleet:router_prefix_hit_blocks",  # ingress
    # pagefleet/cluster/migration.py, in each ingress: requests moved to another replica
    "pagefleet:migrated_requests",  # ingress, reason
    # pagefleet/cluster/autoscaling.py: the policy's last decision, read by the ingress
    "pagefleet:replicas",
    "pagefleet:target_replicas",
    "pagefleet:autoscaler_kv_utilization",
    "pagefleet:autoscaler_compute_utilization",
    # pagefleet/cluster/http/fair_admission.py, in each ingress: labelled ingress, tenant
    "pagefleet:tenant_queue_depth",
    "pagefleet:tenant_queue_time_seconds",
    "pagefleet:tenant_rejected_requests",
)


class ReplicaMetrics:
    """One replica's series. Counters follow the engine's running totals."""

    def __init__(self, model_name: str, replica: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._labels = {"model_name": model_name, "replica": replica}
        reg = self.registry

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, LABELS, registry=reg).labels(**self._labels)

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, LABELS, registry=reg).labels(**self._labels)

        def histogram(name: str, doc: str, buckets: Iterable[float]) -> Any:
            return Histogram(name, doc, LABELS, buckets=tuple(buckets), registry=reg).labels(
                **self._labels
            )

        self.running = gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches."
        )
        self.waiting = gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed."
        )
        self.kv_usage = gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."
        )
        # Exact block counts (vLLM has only the fraction): what tests and the router check.
        self.free_blocks = gauge("pagefleet:kv_blocks_free", "Free KV blocks of the replica.")
        self.total_blocks = gauge("pagefleet:kv_blocks_total", "KV blocks of the replica.")
        self.hot_blocks = gauge(
            "pagefleet:kv_blocks_hot",
            "Cached KV blocks a prefix lookup reused in the last minute, in use or not (the "
            "cache's working set, which the autoscaler keeps room for when it scales in).",
        )
        # Token counters count what requests were given (vLLM v1 counts a request's whole
        # prompt once its prefill is done, and every generated token), so they equal the
        # usage that responses report; the engine-wide totals below come from its stats.
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        )
        self._totals = {
            "num_preemptions": counter(
                "vllm:num_preemptions", "Cumulative number of preemption from the engine."
            ),
            "prefix_cache_queries": counter(
                "vllm:prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens.",
            ),
            "prefix_cache_hits": counter(
                "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
            ),
            # Structured outputs: compile time over compiles is the mean compile time; a hit
            # is a request whose grammar was compiled (or compiling) already.
            "grammar_compiles": counter(
                "pagefleet:structured_output_compiles",
                "Grammars compiled for structured outputs.",
            ),
            "grammar_compile_seconds": counter(
                "pagefleet:structured_output_compile_seconds",
                "Seconds spent compiling grammars for structured outputs.",
            ),
            "grammar_cache_hits": counter(
                "pagefleet:structured_output_cache_hits",
                "Constrained requests whose grammar was already compiled or compiling.",
            ),
            "grammar_cache_misses": counter(
                "pagefleet:structured_output_cache_misses",
                "Constrained requests whose grammar had to be compiled.",
            ),
        }
        self._seen: dict[str, float] = dict.fromkeys(self._totals, 0)
        self._iterations: tuple[tuple[int, ...], int] = ((), 0)  # the engine's counts, sum
        self._success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*LABELS, "finished_reason"],
            registry=reg,
        )
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            ITL_BUCKETS,
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            LATENCY_BUCKETS,
        )
        self.queue = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            LATENCY_BUCKETS,
        )
        self.prompt_len = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", TOKEN_BUCKETS
        )
        self.gen_len = histogram(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            TOKEN_BUCKETS,
        )
        self.tpot = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            ITL_BUCKETS,
        )
        self.prefill = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            LATENCY_BUCKETS,
        )
        self.decode = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            LATENCY_BUCKETS,
        )
        self.inference = histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            LATENCY_BUCKETS,
        )
        self.params_n = histogram(
            "vllm:request_params_n", "Histogram of the n request parameter.", N_BUCKETS
        )
        self.params_max_tokens = histogram(
            "vllm:request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            TOKEN_BUCKETS,
        )
        self._startup = Gauge(
            "pagefleet:replica_startup_seconds",
            "Seconds each phase of the replica's start-up took, in the order they ran: "
            "process, engine_process, imports, tokenizer, weights, compile, warm_up, ready, "
            "first_request.",
            [*LABELS, "phase"],
            registry=reg,
        )
        self._start_time = gauge(
            "pagefleet:replica_start_time_seconds",
            "When the replica's process was created, in Unix time (its start-up's origin).",
        )
        self._cache_info = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            [*LABELS, "block_size", "num_gpu_blocks", "enable_prefix_caching"],
            registry=reg,
        )

    def startup(self, timeline: StartupTimeline) -> None:
        """The start-up's phases, each its seconds, and when it began (Unix time)."""
        for phase, seconds in timeline.durations().items():
            self._startup.labels(**self._labels, phase=phase).set(seconds)
        self._start_time.set(timeline.start)

    def cache_config(self, block_size: int, num_blocks: int, prefix_caching: bool) -> None:
        """vLLM's info gauge (value 1): the KV cache's settings as labels."""
        labels = {"block_size": str(block_size), "num_gpu_blocks": str(num_blocks)}
        labels["enable_prefix_caching"] = str(prefix_caching)
        self._cache_info.labels(**self._labels, **labels).set(1)

    def update(self, stats: EngineStats) -> None:
        """Gauges from the snapshot; counters advance by what the totals moved."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        self.free_blocks.set(stats.num_free_blocks)
        self.total_blocks.set(stats.num_total_blocks)
        self.hot_blocks.set(stats.num_hot_cached_blocks)
        self._iterations = (stats.iteration_tokens_counts, stats.iteration_tokens_sum)
        for field, counter in self._totals.items():
            value = getattr(stats, field)
            if value > self._seen[field]:
                counter.inc(value - self._seen[field])
                self._seen[field] = value

    def observe_output(
        self, out: RequestOutputDelta, num_prompt_tokens: int, first: bool, gap_s: float | None
    ) -> None:
        """One delta of a request: token counters and inter-token latency.

        gap_s is the time since this request's previous delta (None for its first);
        a delta with k new tokens counts k gaps of gap_s / k, as vLLM does per token.
        """
        new = sum(len(c.token_ids) for c in out.outputs)
        if first:
            self.prompt_tokens.inc(num_prompt_tokens)
        if new:
            self.generation_tokens.inc(new)
            if gap_s is not None:
                for _ in range(new):
                    self.itl.observe(gap_s / new)

    def observe_finished(
        self,
        out: RequestOutputDelta,
        num_prompt_tokens: int,
        generated: dict[int, int],
        params: SamplingParams | None = None,
    ) -> None:
        """A request's finishing delta; `generated`: its tokens per sample index;
        `params`: what it asked for (vLLM's request_params_* histograms)."""
        m = out.metrics
        self._observe_phases(m, max(generated.values(), default=0))
        if params is not None:
            self.params_n.observe(params.n)
            if params.max_tokens is not None:
                self.params_max_tokens.observe(params.max_tokens)
        if (ttft := m.time_to_first_token) is not None:
            self.ttft.observe(max(0.0, ttft))
        self.e2e.observe(max(0.0, (m.finished_time or time.monotonic()) - m.arrival_time))
        if (queued := m.queue_time) is not None:
            self.queue.observe(max(0.0, queued))
        kept = out.kept if out.kept is not None else sorted(generated)
        self.prompt_len.observe(num_prompt_tokens)
        self.gen_len.observe(sum(generated.get(i, 0) for i in kept))
        reasons = {c.index: c.finish_reason for c in out.outputs}
        for i in kept:
            if reasons.get(i) is not None:
                self._success.labels(**self._labels, finished_reason=reasons[i]).inc()

    def _observe_phases(self, m: RequestMetrics, num_generated: int) -> None:
        """vLLM's phases: prefill from first scheduled to first token, decode from first
        to last token, inference both; time per output token is decode over the tokens
        after the first (observed for requests of two tokens or more)."""
        if m.first_scheduled_time is None or m.first_token_time is None:
            return
        last = m.last_token_time if m.last_token_time is not None else m.first_token_time
        prefill = max(0.0, m.first_token_time - m.first_scheduled_time)
        decode = max(0.0, last - m.first_token_time)
        self.prefill.observe(prefill)
        self.decode.observe(decode)
        self.inference.observe(prefill + decode)
        if num_generated > 1:
            self.tpot.observe(decode / (num_generated - 1))

    def _iteration_tokens(self) -> Metric:
        """vLLM's histogram of tokens per engine step, from the engine's own counters."""
        counts, total = self._iterations
        counts = counts or (0,) * (len(ITERATION_TOKEN_BUCKETS) + 1)
        bounds = [*(str(float(b)) for b in ITERATION_TOKEN_BUCKETS), "+Inf"]
        fam = HistogramMetricFamily(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            labels=LABELS,
        )
        cumulative = list(itertools.accumulate(counts))
        fam.add_metric(
            list(self._labels.values()), list(zip(bounds, cumulative, strict=True)), total
        )
        return fam

    def families(self) -> list[Metric]:
        return [*self.registry.collect(), self._iteration_tokens()]


def merge_families(snapshots: Iterable[list[Metric]]) -> list[Metric]:
    """One family per metric name, with the samples of every replica."""
    merged: dict[str, Metric] = {}
    for families in snapshots:
        for fam in families:
            into = merged.get(fam.name)
            if into is None:
                into = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            into.samples.extend(fam.samples)
    return list(merged.values())


def fleet_families(
    model_name: str,
    replicas: int,
    target_replicas: int,
    kv_utilization: float | None,
    compute_utilization: float | None = None,
) -> list[Metric]:
    """The fleet's size against the autoscaler's target (and the utilisation it acted on)."""
    labels = {"model_name": model_name}

    def gauge(name: str, doc: str, value: float) -> Metric:
        fam = Metric(name, doc, "gauge")
        fam.add_sample(name, labels, value)
        return fam

    out = [
        gauge("pagefleet:replicas", "Running engine replicas.", replicas),
        gauge(
            "pagefleet:target_replicas",
            "Engine replicas the autoscaler asks for (the configured count without one).",
            target_replicas,
        ),
    ]
    if kv_utilization is not None:
        out.append(
            gauge(
                "pagefleet:autoscaler_kv_utilization",
                "Fleet KV-cache utilisation (0-1) the autoscaler last acted on.",
                kv_utilization,
            )
        )
    if compute_utilization is not None:
        out.append(
            gauge(
                "pagefleet:autoscaler_compute_utilization",
                "Replicas' mean compute use (0-1: the share of time their steps fill the "
                "token budget) the autoscaler last acted on.",
                compute_utilization,
            )
        )
    return out


def replicas_reporting(snapshots: Iterable[list[Metric]]) -> int:
    """Engine replicas with a fresh snapshot (each reports its KV pool)."""
    return len(
        {
            s.labels.get("replica")
            for families in snapshots
            for fam in families
            if fam.name == "pagefleet:kv_blocks_total"
            for s in fam.samples
        }
    )


class _Families:
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


def exposition(snapshots: Iterable[list[Metric]]) -> bytes:
    """Prometheus text format of the merged snapshots."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(merge_families(snapshots)))  # type: ignore[arg-type]
    return generate_latest(registry)


class MetricsHub:
    """Latest metric snapshot of every replica (a named Ray actor under Serve)."""

    def __init__(self, stale_after_s: float = 30.0) -> None:
        self._stale_after_s = stale_after_s
        self._snapshots: dict[str, tuple[float, list[Metric]]] = {}

    def push(self, replica: str, families: list[Metric]) -> None:
        self._snapshots[replica] = (time.monotonic(), families)

    def drop(self, replica: str) -> None:
        self._snapshots.pop(replica, None)

    def snapshots(self) -> list[list[Metric]]:
        return self.snapshots_except("")

    def snapshots_except(self, source: str) -> list[list[Metric]]:
        """Every fresh snapshot but `source`'s (an ingress adds its own, fresher)."""
        now = time.monotonic()
        for replica in [
            r for r, (t, _) in self._snapshots.items() if now - t > self._stale_after_s
        ]:
            del self._snapshots[replica]
        return [fams for r, (_, fams) in self._snapshots.items() if r != source]
