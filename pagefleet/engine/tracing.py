"""OpenTelemetry for the engine core: its span of each traced request, with vLLM's names.

A request added with `trace_headers` (vLLM's field: the W3C `traceparent` of its
caller's span) is traced by the core that runs it, in the core's own process:
once it finishes, `CoreTracer.finished` emits an `engine_core` span, a child of
the caller's, from the request's arrival at the core to its end, and below it
the phases timed by the core's own timestamps (`RequestMetrics`): `queue`
(arrival to first scheduled), `prefill` (to the first token) and `decode` (to
the last token). The attributes are vLLM's `llm_request` ones (`GEN_AI`): the
request id, the sampling parameters, the usage and the latencies.

One tracer provider per process and endpoint, exporting in batches over
OTLP/gRPC; nothing here loads unless a tracer is made (no endpoint: no tracing).
Tracing never fails a request: a `CoreTracer` call that raises is logged, and the
request it was for goes untraced.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ParamSpec

P = ParamSpec("P")
logger = logging.getLogger(__name__)

GEN_AI = {
    "request_id": "gen_ai.request.id",
    "model": "gen_ai.response.model",
    "temperature": "gen_ai.request.temperature",
    "top_p": "gen_ai.request.top_p",
    "max_tokens": "gen_ai.request.max_tokens",
    "n": "gen_ai.request.n",
    "prompt_tokens": "gen_ai.usage.prompt_tokens",
    "completion_tokens": "gen_ai.usage.completion_tokens",
    "queue": "gen_ai.latency.time_in_queue",
    "ttft": "gen_ai.latency.time_to_first_token",
    "e2e": "gen_ai.latency.e2e",
    "prefill": "gen_ai.latency.time_in_model_prefill",
    "decode": "gen_ai.latency.time_in_model_decode",
    "inference": "gen_ai.latency.time_in_model_inference",
}


@functools.cache
def _provider(endpoint: str, service: str) -> Any:
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    exporter = OTLPSpanExporter(endpoint=endpoint, insecure=True)
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=200))
    _created.append(provider)
    return provider


_created: list[Any] = []  # the providers `_provider` made


def tracer(endpoint: str | None, service: str) -> Any:
    """A tracer exporting to `endpoint` (None: no tracing)."""
    if not endpoint:
        return None
    return _provider(endpoint, service).get_tracer("pagefleet")


def force_flush() -> None:
    """Export every span ended so far, from every provider of this process."""
    for provider in _created:
        provider.force_flush()


def carrier_of(span: Any) -> dict[str, str]:
    """The span's context as W3C headers (`traceparent`), for another process."""
    from opentelemetry.propagate import inject
    from opentelemetry.trace import set_span_in_context

    headers: dict[str, str] = {}
    inject(headers, context=set_span_in_context(span))
    return headers


def context_of(headers: Mapping[str, str] | None) -> Any:
    from opentelemetry.propagate import extract

    return extract(dict(headers or {}))


def wall_ns(monotonic_s: float) -> int:
    """A `time.monotonic()` instant as wall-clock nanoseconds (what spans are timed in)."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


def phases(m: Any) -> dict[str, tuple[float, float]]:
    """A request's phases in the core, (start, end) in `time.monotonic()` seconds: queue
    (arrival to first scheduled), prefill (to the first token), decode (to the last)."""
    out: dict[str, tuple[float, float]] = {}
    if m.first_scheduled_time is not None:
        out["queue"] = (m.arrival_time, m.first_scheduled_time)
        if m.first_token_time is not None:
            out["prefill"] = (m.first_scheduled_time, m.first_token_time)
            last = m.last_token_time if m.last_token_time is not None else m.first_token_time
            out["decode"] = (m.first_token_time, last)
    return out


def latency_attributes(m: Any) -> dict[str, float]:
    """vLLM's `gen_ai.latency.*` of a finished request's `RequestMetrics`."""
    out = {
        GEN_AI[key]: value
        for key, value in (
            ("queue", m.queue_time),
            ("ttft", m.time_to_first_token),
            ("e2e", m.e2e_latency),
        )
        if value is not None
    }
    spans = phases(m)
    for key in ("prefill", "decode"):
        if key in spans:
            out[GEN_AI[key]] = spans[key][1] - spans[key][0]
    if "prefill" in spans and "decode" in spans:
        out[GEN_AI["inference"]] = spans["decode"][1] - spans["prefill"][0]
    return out


def params_attributes(params: Any) -> dict[str, Any]:
    """vLLM's `gen_ai.request.*` of a request's `SamplingParams` (those it sets)."""
    out = {GEN_AI["n"]: params.n}
    for key in ("temperature", "top_p", "max_tokens"):
        value = getattr(params, key)
        if value is not None:
            out[GEN_AI[key]] = value
    return out


def emit(
    tracer: Any, name: str, parent: Any, m: Any, attributes: dict[str, Any], kind: Any = None
) -> Any:
    """A span `name` from `m`'s arrival to now under `parent` (a context), with the phases
    of `m` below it; returns the span, ended."""
    from opentelemetry.trace import SpanKind, set_span_in_context

    span = tracer.start_span(
        name,
        context=parent,
        kind=kind if kind is not None else SpanKind.INTERNAL,
        start_time=wall_ns(m.arrival_time),
        attributes=attributes,
    )
    inside = set_span_in_context(span)
    for phase, (start, end) in phases(m).items():
        child = tracer.start_span(phase, context=inside, start_time=wall_ns(start))
        child.end(end_time=wall_ns(end))
    span.end()
    return span


@dataclass(frozen=True)
class TraceSettings:
    """Where an engine core sends its spans (vLLM's `otlp_traces_endpoint`), and the model
    name they carry (vLLM's `served_model_name`)."""

    otlp_traces_endpoint: str
    served_model_name: str
    service: str = "pagefleet-engine-core"

    def core_tracer(self) -> CoreTracer:
        return CoreTracer(tracer(self.otlp_traces_endpoint, self.service), self.served_model_name)


@dataclass
class _Traced:
    headers: dict[str, str]
    attributes: dict[str, Any]
    completion_tokens: int = 0


def contained(method: Callable[P, None]) -> Callable[P, None]:
    """`method`, its exceptions logged instead of raised."""

    @functools.wraps(method)
    def call(*args: P.args, **kwargs: P.kwargs) -> None:
        try:
            method(*args, **kwargs)
        except Exception:
            logger.warning("tracing failed in %s", method.__name__, exc_info=True)

    return call


@dataclass
class CoreTracer:
    """The engine core's traces (see the module docstring): `added` notes a request that
    carries trace headers, `output` counts its tokens and emits its span once finished,
    `dropped` forgets one that ended otherwise (aborted, failed)."""

    tracer: Any
    model: str
    _requests: dict[str, _Traced] = field(default_factory=dict)

    @contained
    def added(
        self,
        request_id: str,
        headers: Mapping[str, str] | None,
        params: Any,
        num_prompt_tokens: int,
    ) -> None:
        if not headers:
            return
        attributes = {
            GEN_AI["request_id"]: request_id.rsplit("#", 1)[0],
            GEN_AI["model"]: self.model,
            GEN_AI["prompt_tokens"]: num_prompt_tokens,
            **params_attributes(params),
        }
        self._requests[request_id] = _Traced(dict(headers), attributes)

    @contained
    def output(self, out: Any) -> None:
        """One `RequestOutputDelta`: its new tokens counted; its span emitted if it is the last."""
        traced = self._requests.get(out.request_id)
        if traced is None:
            return
        traced.completion_tokens += sum(len(c.token_ids) for c in out.outputs)
        if not out.finished:
            return
        del self._requests[out.request_id]
        attributes = {
            **traced.attributes,
            GEN_AI["completion_tokens"]: traced.completion_tokens,
            **latency_attributes(out.metrics),
        }
        emit(self.tracer, "engine_core", context_of(traced.headers), out.metrics, attributes)

    def dropped(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self._requests.pop(rid, None)
