"""Request ids, one log line per finished request, and the ingress's own HTTP metrics.

`RequestObserver` is a pure ASGI middleware, the outermost: each HTTP request gets a
`RequestRecord` (kept in a context variable for the routes below it) whose id is the
client's `X-Request-Id` when it is a usable one (printable ASCII, at most 128
characters) and a new one otherwise. The id is echoed in the `X-Request-Id` header of
every response, errors included, beside `X-Pagefleet-Ingress` (the ingress replica
that answers) and, once an engine replica took the request, `X-Pagefleet-Replica`
(which one). A generating endpoint's engine requests are named by
it while no other request of this ingress uses it (`engine_request_id`); otherwise
they keep the endpoint's own id. The record follows the request's deltas (prompt and
output tokens, the first token's time, the engine replica that served it); when the
response's last byte is sent (or it fails), one log line says what happened
(`request_log`: `text`, `json` or `off`), `pagefleet:http_responses` counts it by
status, and `pagefleet:client_time_to_first_token_seconds` has its time to first token
as the client sees it: from its arrival at the ingress, queueing and routing included.
"""

from __future__ import annotations

import contextvars
import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..replica_messages import RequestDelta

logger = logging.getLogger("pagefleet.requests")

RequestLog = Literal["text", "json", "off"]
MAX_ID_CHARS = 128
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip


@dataclass
class RequestRecord:
    request_id: str
    from_client: bool
    arrived: float  # time.monotonic()
    path: str
    model: str
    status: int = 0
    prompt_tokens: dict[str, int] = field(default_factory=dict)  # per engine request
    output_tokens: int = 0
    first_token_at: float | None = None
    replica: str | None = None
    owns_id: bool = False  # its id names its engine requests (held in `_in_flight`)
    done: bool = False
    span: Any = None  # the ingress's server span, when traces are on
    tracer: Any = None  # what made it
    routes: dict[str, Any] = field(default_factory=dict)  # open `route` spans, by engine request
    on_first_token: Callable[[float], None] | None = None

    def observe(self, delta: RequestDelta) -> None:
        """One delta of one of the request's engine requests."""
        self.prompt_tokens[delta.request_id] = delta.num_prompt_tokens
        if delta.replica is not None:
            self.replica = delta.replica
            self._routed(delta.request_id, delta.replica)
        new = sum(len(s.token_ids) for s in delta.samples)
        if new and self.first_token_at is None:
            self.first_token_at = time.monotonic()
            if self.on_first_token is not None:
                self.on_first_token(self.first_token_at - self.arrived)
        self.output_tokens += new

    def route_context(self, engine_request_id: str) -> dict[str, str] | None:
        """Open the `route` span of one engine request (from its dispatch to the replica
        that queues it); its context, for that replica (None: traces are off)."""
        if self.span is None:
            return None
        from opentelemetry.trace import set_span_in_context

        from ..tracing import GEN_AI, carrier_of

        span = self.tracer.start_span(
            "route",
            context=set_span_in_context(self.span),
            attributes={GEN_AI["request_id"]: engine_request_id},
        )
        self.routes[engine_request_id] = span
        return carrier_of(span)

    def _routed(self, engine_request_id: str, replica: str) -> None:
        span = self.routes.pop(engine_request_id, None)
        if span is not None:
            span.set_attribute("pagefleet.replica", replica)
            span.end()

    def end_spans(self) -> None:
        """End the request's spans: a `route` still open found no replica."""
        for span in self.routes.values():
            span.end()
        self.routes.clear()
        span = self.span
        span.set_attribute("http.response.status_code", self.status)
        span.set_attribute("gen_ai.request.id", self.request_id)
        if self.replica is not None:
            span.set_attribute("pagefleet.replica", self.replica)
        span.end()

    def line(self, ended: float) -> dict[str, Any]:
        ttft = None if self.first_token_at is None else self.first_token_at - self.arrived
        return {
            "request_id": self.request_id,
            "method_path": self.path,
            "model": self.model,
            "status": self.status,
            "prompt_tokens": sum(self.prompt_tokens.values()),
            "output_tokens": self.output_tokens,
            "ttft_s": None if ttft is None else round(ttft, 6),
            "e2e_s": round(ended - self.arrived, 6),
            "replica": self.replica,
        }


_current: contextvars.ContextVar[RequestRecord | None] = contextvars.ContextVar(
    "pagefleet_request", default=None
)
_in_flight: set[str] = set()  # client ids naming an engine request of this process


def current_record() -> RequestRecord | None:
    return _current.get()


def engine_request_id(endpoint_id: str) -> str:
    """The engine request id of the current request: the client's X-Request-Id while no
    other request of this ingress uses it, else the endpoint's id."""
    record = _current.get()
    if record is None or not record.from_client or record.request_id in _in_flight:
        return endpoint_id
    _in_flight.add(record.request_id)
    record.owns_id = True
    return record.request_id


def observe_delta(delta: RequestDelta) -> None:
    record = _current.get()
    if record is not None:
        record.observe(delta)


def _usable(value: str) -> bool:
    return 0 < len(value) <= MAX_ID_CHARS and value.isascii() and value.isprintable()


# The series an ingress itself owns (a LocalBackend scrapes these beside its replica's).
INGRESS_SERIES = (
    "pagefleet:http_responses",
    "pagefleet:client_time_to_first_token_seconds",
    "pagefleet:tenant_queue_depth",
    "pagefleet:tenant_queue_time_seconds",
    "pagefleet:tenant_rejected_requests",
)


class HttpMetrics:
    """The ingress's series (prometheus-client's default registry, `pagefleet:` names:
    an ingress pushes them to the hub with the router's counters)."""

    def __init__(self) -> None:
        from prometheus_client import REGISTRY, Counter, Histogram

        self.responses = Counter(
            INGRESS_SERIES[0],
            "HTTP responses of the ingress, by status code.",
            ("ingress", "status"),
            registry=REGISTRY,
        )
        self.ttft = Histogram(
            INGRESS_SERIES[1],
            "Time to first token as the client sees it: from the request's arrival at the "
            "ingress (queueing and routing included) to its first generated token.",
            ("ingress", "model_name"),
            buckets=TTFT_BUCKETS,
            registry=REGISTRY,
        )


_metrics: HttpMetrics | None = None


def http_metrics() -> HttpMetrics:
    """The process's one set (every app of a process shares it, labelled by ingress)."""
    global _metrics
    if _metrics is None:
        _metrics = HttpMetrics()
    return _metrics


class RequestObserver:
    """The ASGI middleware (see the module's docstring)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        model_name: str,
        ingress: str,
        request_log: RequestLog = "text",
        tracer: Any = None,
    ) -> None:
        self.app = app
        self.tracer = tracer
        self.model_name = model_name
        self.ingress = ingress
        self.request_log = request_log
        self.metrics = http_metrics()

    def _record(self, scope: Scope) -> RequestRecord:
        given = next((v for k, v in scope["headers"] if k == b"x-request-id"), b"")
        value = given.decode("latin-1")
        from_client = _usable(value)
        rid = value if from_client else uuid.uuid4().hex
        path = f"{scope['method']} {scope['path']}"
        return RequestRecord(rid, from_client, time.monotonic(), path, self.model_name)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        record = self._record(scope)
        record.on_first_token = self.metrics.ttft.labels(self.ingress, self.model_name).observe
        if self.tracer is not None:
            self._start_span(record, scope)
        _current.set(record)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
                message["headers"] = [*message.get("headers", []), *self._headers(record)]
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                self._finished(record)  # before the last byte leaves: the client sees it done
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except BaseException:
            record.status = record.status or 500
            raise
        finally:
            self._finished(record)

    def _headers(self, record: RequestRecord) -> list[tuple[bytes, bytes]]:
        """The request's id, the ingress replica that answers, and the engine replica
        that took it (once one did: a generating request's answer starts after that)."""
        out = [
            (b"x-request-id", record.request_id.encode("latin-1")),
            (b"x-pagefleet-ingress", self.ingress.encode("latin-1")),
        ]
        if record.replica is not None:
            out.append((b"x-pagefleet-replica", record.replica.encode("latin-1")))
        return out

    def _finished(self, record: RequestRecord) -> None:
        """Once per request: the id freed, the counters, the log line. The operator's
        scrape (`GET /metrics`) is neither counted nor logged, as vLLM's."""
        if record.done:
            return
        record.done = True
        if record.owns_id:
            _in_flight.discard(record.request_id)
        if record.span is not None:
            record.span.set_attribute("pagefleet.ingress", self.ingress)
            record.end_spans()
        if record.path == "GET /metrics":
            return
        self.metrics.responses.labels(self.ingress, str(record.status)).inc()
        if self.request_log != "off":
            self._log(record.line(time.monotonic()))

    def _start_span(self, record: RequestRecord, scope: Scope) -> None:
        from opentelemetry.trace import SpanKind

        from ..tracing import context_of

        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        record.tracer = self.tracer
        record.span = self.tracer.start_span(
            record.path, context=context_of(headers), kind=SpanKind.SERVER
        )

    def _log(self, line: dict[str, Any]) -> None:
        if self.request_log == "json":
            logger.info(json.dumps(line))
        else:
            logger.info(" ".join(f"{k}={v}" for k, v in line.items()))
