"""OpenTelemetry traces with vLLM's span and attribute names (`observability.otlp_traces_endpoint`).

Off unless an endpoint is set. A request's trace has:

- the ingress's server span (`POST /v1/...`), a child of the client's `traceparent`
  when it sent one, with the request id, the status and the engine replica the
  router chose (`pagefleet.replica`);
- the replica's `llm_request` span, a child of the ingress's (its context travels in
  the `ReplicaRequest`, across Serve to the replica's process), with vLLM's `gen_ai.*`
  attributes, ended when the request finishes;
- below it the engine's phases as spans of their own, timed by the engine core's
  timestamps (`RequestMetrics`): `queue` (arrival to first scheduled), `prefill` (to
  the first token) and `decode` (to the last token).

One tracer provider per process and endpoint, exporting in batches over OTLP/gRPC.
"""

from __future__ import annotations

import functools
import time
from typing import Any

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


def tracer(endpoint: str | None, service: str) -> Any:
    """A tracer exporting to `endpoint` (None: no tracing)."""
    if not endpoint:
        return None
    return _provider(endpoint, service).get_tracer("pagefleet")


def force_flush() -> None:
    """Export every span ended so far, from every provider of this process."""
    for provider in _created:
        provider.force_flush()


_created: list[Any] = []  # the providers `_provider` made


def carrier_of(span: Any) -> dict[str, str]:
    """The span's context as W3C headers (`traceparent`), for another process."""
    from opentelemetry.propagate import inject
    from opentelemetry.trace import set_span_in_context

    headers: dict[str, str] = {}
    inject(headers, context=set_span_in_context(span))
    return headers


def context_of(headers: dict[str, str] | None) -> Any:
    from opentelemetry.propagate import extract

    return extract(headers or {})


def wall_ns(monotonic_s: float) -> int:
    """A `time.monotonic()` instant as wall-clock nanoseconds (what spans are timed in)."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)
