"""The app factory: the OpenAI-compatible API over any `EngineBackend`.

`create_app` puts the gate (API key, body size) in front of every route, maps every
failure to OpenAI's error body (`errors.py`), mounts one router per endpoint family
(`completions`, `chat`, `embeddings`, `responses`, `tokenize`, `models`, `service`,
and the dashboard), and
serves its own OpenAPI document (`openapi.py`), which needs the engine's numbers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import pagefleet

from ..config import ChatSettings, FairnessSettings, Limits
from ..dashboard import add_dashboard
from ..replica_messages import EngineInfo
from ..tracing import tracer
from . import chat, completions, models, service, tokenize
from .backend import EngineBackend
from .embeddings import EmbeddingServing
from .embeddings import router as embeddings_router
from .errors import APIError, error_response, to_api_error, validation_error
from .fair_admission import Capacity, FairAdmission, TenantTagger
from .gate import Gate, GateSettings
from .observability import RequestLog, RequestObserver, current_record
from .openapi import document
from .responses import MemoryResponseStore, ResponsesServing, ResponseStore
from .responses import router as responses_router
from .serving import Serving
from .tokenizer import AsyncTokenizer


def _answer(err: APIError) -> JSONResponse:
    return error_response(err.status, err.message, err.param, err.headers)


def create_app(
    backend: EngineBackend,
    tokenizer: Any,
    model_name: str,
    limits: Limits | None = None,
    on_shutdown: Callable[[], Awaitable[None]] | None = None,
    *,
    api_key: str | None = None,
    protect_metrics: bool | None = None,
    request_timeout_s: float | None = None,
    sampling_defaults: Mapping[str, float] | None = None,
    chat_settings: ChatSettings | None = None,
    response_store: ResponseStore | None = None,
    ingress_id: str = "local",
    request_log: RequestLog = "text",
    otlp_traces_endpoint: str | None = None,
    priority_scheduling: bool = False,
    fairness: FairnessSettings | None = None,
    fair_capacity: Capacity | None = None,
) -> FastAPI:
    """The app. api_key: what `Authorization: Bearer` must carry (None: no key);
    protect_metrics: whether /metrics needs it too (None: whenever there is one);
    request_timeout_s: the most a request may take from its arrival (None: no bound);
    sampling_defaults: what a request that leaves a sampling field out gets
    (`pagefleet.engine.checkpoint.generation_defaults`);
    response_store: where `/v1/responses` keeps responses (None: in this process);
    ingress_id, request_log: this ingress's name in metrics, and its request log's form;
    otlp_traces_endpoint: where its spans go (None: no traces);
    priority_scheduling: whether the engines run `scheduling_policy: priority` (else a
    non-zero `priority` is a 400);
    fairness, fair_capacity: with `fairness.enabled`, the fair queue in front of `backend`
    and where it asks its capacity (`fair_admission.py`); else requests go straight to it."""
    limits = limits or Limits()
    gate = GateSettings(api_key, protect_metrics, limits.max_body_bytes)
    admission = _admission(backend, fairness, fair_capacity, ingress_id)
    serving = Serving(
        admission or backend,
        AsyncTokenizer(tokenizer),
        model_name,
        limits,
        request_timeout_s,
        gate,
        sampling_defaults=sampling_defaults,
        chat=chat_settings,
        priority_scheduling=priority_scheduling,
    )
    # /openapi.json and /docs are ours (below): the document needs the engine's numbers.
    app = FastAPI(
        title="pagefleet",
        version=pagefleet.__version__,
        description="OpenAI-compatible LLM serving on Ray Serve",
        openapi_url=None,
        docs_url=None,
        redoc_url=None,
    )
    app.state.serving = serving
    app.state.embeddings = EmbeddingServing(serving)
    app.state.responses = ResponsesServing(serving, response_store or MemoryResponseStore())
    app.add_middleware(Gate, settings=lambda: serving.gate)  # type: ignore[arg-type]
    app.add_middleware(
        RequestObserver,  # type: ignore[arg-type]
        model_name=model_name,
        ingress=ingress_id,
        request_log=request_log,
        tracer=tracer(otlp_traces_endpoint, "pagefleet-ingress"),
    )
    if admission is not None:
        app.add_middleware(TenantTagger, header=admission.settings.tenant_header)  # type: ignore[arg-type]
    if on_shutdown is not None:
        app.router.on_shutdown.append(on_shutdown)
    add_dashboard(app, backend)  # /dashboard, /dashboard/data (dashboard.py)

    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return _answer(exc)

    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _answer(validation_error(exc.errors()))

    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        # Answered outside the middleware that echoes X-Request-Id: it is added here.
        response = _answer(to_api_error(exc))  # a 500 with a log line unless a known one
        if (record := current_record()) is not None:
            response.headers["X-Request-Id"] = record.request_id
        return response

    app.add_exception_handler(APIError, api_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, invalid)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, http_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, unexpected)
    for family in (service, models, tokenize, completions, chat):
        app.include_router(family.router)
    app.include_router(responses_router)
    app.include_router(embeddings_router)
    _serve_openapi(app, serving)
    return app


def _admission(
    backend: EngineBackend,
    fairness: FairnessSettings | None,
    capacity: Capacity | None,
    ingress_id: str,
) -> FairAdmission | None:
    if fairness is None or not fairness.enabled:
        return None
    if capacity is None:
        raise ValueError("fairness.enabled needs the queue's capacity (fair_capacity)")
    return FairAdmission(backend, fairness, capacity, ingress=ingress_id)


def reconfigure(
    app: FastAPI,
    limits: Limits,
    *,
    api_key: str | None,
    protect_metrics: bool | None,
    request_timeout_s: float | None,
) -> None:
    """Apply new live settings to a running app (`Ingress.reconfigure`): the limits, the
    time-out and the gate's settings at once; the OpenAPI document is rebuilt with them."""
    serving: Serving = app.state.serving
    serving.reconfigure(
        limits, request_timeout_s, GateSettings(api_key, protect_metrics, limits.max_body_bytes)
    )
    app.openapi_schema = None


def _serve_openapi(app: FastAPI, serving: Serving) -> None:
    """`/openapi.json` with the engine's numbers (asked of it once, bounded) and `/docs`."""

    def openapi(info: EngineInfo | None = None) -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title,
                version=app.version,
                description=app.description,
                routes=app.routes,
            )
            gate = serving.gate
            keyed = gate.key_digest is not None
            document(schema, serving.limits, serving.model_name, keyed, gate.metrics_keyed, info)
            if info is None:
                return schema  # without the engine's numbers: not kept, asked again next time
            app.openapi_schema = schema
        return app.openapi_schema

    async def openapi_json() -> JSONResponse:
        try:  # bounded: with no engine replica up, the document goes without its numbers
            info: EngineInfo | None = await asyncio.wait_for(serving.info(), 10)
        except Exception:
            info = None
        return JSONResponse(openapi(info))

    async def docs() -> Response:
        return get_swagger_ui_html(openapi_url="openapi.json", title=f"{app.title} - API")

    app.add_api_route("/openapi.json", openapi_json, methods=["GET"], include_in_schema=False)
    app.add_api_route("/docs", docs, methods=["GET"], include_in_schema=False)
    app.openapi = openapi  # type: ignore[method-assign]
