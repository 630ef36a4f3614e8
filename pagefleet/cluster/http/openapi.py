"""The OpenAPI document, made to say what this server enforces.

FastAPI generates the document from the routes and request models; `document`
adds what only the running server knows: the configured limits, the engine's
numbers (token ids below its vocabulary size, new tokens below its context
length), the one model name, the bearer key, the statuses each operation answers
(our 400s, never FastAPI's 422), the SSE alternative of the generating endpoints,
and the bodies of /metrics and /health. Generated clients and fuzzers then stay
within what the server accepts.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST

from ..config import Limits
from ..replica_messages import EngineInfo
from .errors import ErrorResponse
from .gate import is_keyed

# What each operation can answer besides 200, for the OpenAPI document.
_ERROR_DOCS = {
    400: "invalid request: a value, a limit (named in the message), the context length",
    401: "missing or invalid API key",
    404: "unknown model (or, for /v1/responses, stored response)",
    408: "request_timeout_s passed before the request finished; it was cancelled",
    413: "request body larger than limits.max_body_bytes",
    429: "every engine replica's queue is full; retry after Retry-After seconds",
    503: "no engine replica is available",
}
_GENERATE_ERRORS = (400, 404, 408, 413, 429, 503)


def _nonnull(prop: dict[str, Any]) -> list[dict[str, Any]]:
    """The non-null branches of a (possibly Optional / union) property schema."""
    branches = prop.get("anyOf", [prop])
    return [b for b in branches if b.get("type") != "null"]


def _token_id_arrays(prop: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every array-of-integers schema within `prop` (token-id lists, nested or not)."""
    for b in _nonnull(prop):
        if b.get("type") == "array":
            items = b.get("items", {})
            if items.get("type") == "integer":
                yield b
            else:
                yield from _token_id_arrays(items)


def document(
    schema: dict[str, Any],
    limits: Limits,
    model_name: str,
    keyed: bool,
    protect_metrics: bool,
    info: EngineInfo | None,
) -> None:
    """Make the generated OpenAPI document say what this server enforces.

    FastAPI knows the models' static ranges; this adds the configured limits, the
    engine's numbers (token ids below its vocabulary size, new tokens below its context
    length), the one model name, the bearer key, the statuses each operation answers
    (our 400s, never FastAPI's 422), the SSE alternative of the generating endpoints,
    and the bodies of /metrics and /health.
    """
    comps = schema.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        comps.pop(name, None)
    _add_error_body(comps)
    _bound_requests(comps, limits, model_name, info)
    if keyed:
        schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    _document_operations(schema, keyed, protect_metrics)


def _add_error_body(comps: dict[str, Any]) -> None:
    """OpenAI's error body, which every error status refers to."""
    body = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
    comps.update(body.pop("$defs", {}))
    comps["ErrorResponse"] = body


def _bound_requests(
    comps: dict[str, Any], limits: Limits, model_name: str, info: EngineInfo | None
) -> None:
    """The limits and the engine's numbers on the request bodies' fields."""
    max_new = limits.max_tokens
    if info is not None:
        max_new = min(max_new or info.max_model_len, info.max_model_len - 1)
        token_lists = [
            comps.get("CompletionRequest", {}).get("properties", {}).get("prompt", {}),
            comps.get("DetokenizeRequest", {}).get("properties", {}).get("tokens", {}),
        ] + [
            comps.get(n, {}).get("properties", {}).get("stop_token_ids", {})
            for n in ("CompletionRequest", "ChatCompletionRequest")
        ]
        for prop in token_lists:
            for arr in _token_id_arrays(prop):
                arr["items"]["maximum"] = info.vocab_size - 1
    requests = [comps[n] for n in ("CompletionRequest", "ChatCompletionRequest") if n in comps]
    for model in requests:
        _bound_sampling(model["properties"], limits, max_new)
    responses = comps.get("ResponsesRequest", {}).get("properties", {})
    if "max_output_tokens" in responses and max_new is not None:
        for b in _nonnull(responses["max_output_tokens"]):
            b["maximum"] = max_new
    if "CompletionRequest" in comps:
        for b in _nonnull(comps["CompletionRequest"]["properties"]["prompt"]):
            if b.get("type") == "array" and b.get("items", {}).get("type") != "integer":
                b["maxItems"] = limits.max_prompts
    for model in comps.values():  # every request's `model`: only the served name exists
        props = model.get("properties", {})
        if "model" in props and model.get("title", "").endswith("Request"):
            props["model"]["anyOf"] = [{"type": "string", "enum": [model_name]}, {"type": "null"}]


def _bound_sampling(props: dict[str, Any], limits: Limits, max_new: int | None) -> None:
    for b in _nonnull(props["n"]):
        b["maximum"] = limits.max_n
    # min_tokens > max_tokens is refused, so min_tokens is bounded as max_tokens is.
    for key in ("max_tokens", "max_completion_tokens", "min_tokens"):
        if key in props and max_new is not None:
            for b in _nonnull(props[key]):
                b["maximum"] = max_new
    for b in _nonnull(props["stop"]):
        if b.get("type") == "array":
            b["maxItems"] = limits.max_stop
    for b in _nonnull(props["stop_token_ids"]):
        b["maxItems"] = limits.max_stop
    if "best_of" in props:
        for b in _nonnull(props["best_of"]):
            b["maximum"] = limits.max_n
    for key in ("logprobs", "top_logprobs"):
        if key in props:
            for b in _nonnull(props[key]):
                if b.get("type") == "integer":
                    b["maximum"] = limits.max_logprobs


def _error(status: int) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "description": _ERROR_DOCS[status],
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
    }
    if status == 429:
        doc["headers"] = {"Retry-After": {"schema": {"type": "integer"}}}
    return doc


# Before OpenAPI 3.2 (no itemSchema) an event stream's `schema` describes one event.
_EVENT_STREAM = {
    "schema": {
        "type": "object",
        "description": "with stream: true, one server-sent event per chunk",
        "properties": {
            "data": {
                "type": "string",
                "description": "a JSON chunk (OpenAI's chunk object, or its error body), "
                "or [DONE] at the end",
            }
        },
        "required": ["data"],
    }
}


_RESPONSE_EVENTS = {
    "schema": {
        "type": "object",
        "description": "with stream: true, one server-sent event per Responses event",
        "properties": {
            "event": {"type": "string", "description": "the event's type"},
            "data": {"type": "string", "description": "the event as JSON"},
        },
        "required": ["data"],
    }
}


def _document_operations(schema: dict[str, Any], keyed: bool, protect_metrics: bool) -> None:
    """Each operation's statuses, the streams' second body, the key where it applies."""
    for path, item in schema["paths"].items():
        for method, op in item.items():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            if method == "post":
                statuses = _GENERATE_ERRORS if path.startswith("/v1/") else (400, 404, 413)
                for status in statuses:
                    responses[str(status)] = _error(status)
                if path in ("/v1/completions", "/v1/chat/completions"):
                    responses["200"]["content"]["text/event-stream"] = _EVENT_STREAM
                if path == "/v1/responses":
                    responses["200"]["content"]["text/event-stream"] = _RESPONSE_EVENTS
            if path == "/v1/responses/{response_id}":
                responses["404"] = _error(404)
            if path == "/dashboard/data":
                responses["400"] = _error(400)  # `minutes` out of range
            if keyed and is_keyed(path, protect_metrics):
                op["security"] = [{"bearer": []}]
                responses["401"] = _error(401)
    if "/metrics" in schema["paths"]:
        schema["paths"]["/metrics"]["get"]["responses"]["200"] = {
            "description": "Prometheus text exposition of every replica's series",
            "content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}},
        }
    if "/health" in schema["paths"]:
        schema["paths"]["/health"]["get"]["responses"] = {
            "200": {"description": "an engine replica answers (empty body)"},
            "503": _error(503),
        }
