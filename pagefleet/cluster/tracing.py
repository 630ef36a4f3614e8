"""OpenTelemetry traces with vLLM's span and attribute names (`observability.otlp_traces_endpoint`).

Off unless an endpoint is set. A request's trace joins three processes, each span's
context travelling with the request as W3C headers (`traceparent`):

- the ingress (`http/observability.py`): its server span (`POST /v1/...`), a child
  of the client's `traceparent` when it sent one, with the request id, the status and
  the engine replica that answered; below it one `route` span per engine request, from
  its dispatch to the router until an engine replica queued it, naming the replica the
  router chose (`pagefleet.replica`) and the engine request's id;
- the engine replica (`replica.py`): vLLM's `llm_request` span, a child of `route`
  (its context travels in the `ReplicaRequest`), from the replica's receipt of the
  request to its end, with vLLM's `gen_ai.*` attributes;
- the engine core, in the replica's child process (`pagefleet.engine.tracing`): an
  `engine_core` span, a child of `llm_request` (its context travels in the core's
  `AddRequest.trace_headers`), with the same `gen_ai.*` attributes as the core counts
  them and, below it, the core's `queue`, `prefill` and `decode` phases.

One tracer provider per process and endpoint, exporting in batches over OTLP/gRPC.
"""

from __future__ import annotations

from pagefleet.engine.tracing import (
    GEN_AI,
    TraceSettings,
    carrier_of,
    context_of,
    force_flush,
    latency_attributes,
    params_attributes,
    tracer,
)

from .config import ServeConfig

__all__ = [
    "GEN_AI",
    "carrier_of",
    "context_of",
    "force_flush",
    "latency_attributes",
    "params_attributes",
    "trace_settings",
    "tracer",
]


def trace_settings(config: ServeConfig) -> TraceSettings | None:
    """What an engine replica's core is told of traces (None: traces are off)."""
    endpoint = config.observability.otlp_traces_endpoint
    if not endpoint:
        return None
    return TraceSettings(endpoint, config.model_name)
