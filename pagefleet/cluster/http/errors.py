"""Errors as the client sees them: OpenAI's error body, and one table from failure to status.

Every failure reaches the client as `APIError` (status, message, `param`) rendered
as OpenAI's body, `{"error": {"message", "type", "param", "code"}}`. The ingress's
own checks raise `APIError` directly. What the engines and Ray Serve raise is mapped
by type, in `_BY_TYPE`, once: a replica's exception crosses Ray as a `RayTaskError`
that is also an instance of its cause's class, so `isinstance` sees the engine's own
type. Anything not in the table is a bug: a 500 with a log line, never a 400.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel
from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import (
    BackPressureError,
    DeploymentUnavailableError,
    ReplicaUnavailableError,
)

from pagefleet.engine import (
    EngineDeadError,
    EngineOverloadedError,
    InvalidRequestError,
    RequestFailedError,
    StepFailedError,
)

logger = logging.getLogger("pagefleet.cluster")

# What a 429 tells clients to wait (seconds): a queue slot frees when a request
# finishes, which at any load is well within a second or two.
RETRY_AFTER_S = 1


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers


ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    408: "TimeoutError",
    413: "RequestTooLarge",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


def error_body(err: APIError) -> dict[str, Any]:
    """OpenAI's error body; also the last event of a stream that fails midway."""
    info = ErrorInfo(
        message=err.message,
        type=ERROR_TYPES.get(err.status, "Error"),
        param=err.param,
        code=err.status,
    )
    return ErrorResponse(error=info).model_dump()


def error_response(
    status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(
        error_body(APIError(status, message, param)), status_code=status, headers=headers
    )


def overloaded() -> APIError:
    return APIError(
        429,
        "The server is at capacity: every engine replica's queue is full. "
        f"Retry after {RETRY_AFTER_S} s.",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def reason(exc: BaseException) -> str:
    """What went wrong, in one line: the replica's own exception where Ray wrapped it (a
    RayTaskError's `cause`), else the first line of Ray's message (the rest is a remote
    traceback, actor ids and addresses)."""
    cause = getattr(exc, "cause", None)
    text = str(cause) if isinstance(cause, BaseException) and str(cause) else str(exc)
    lines = _ANSI.sub("", text).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def _invalid(exc: BaseException) -> APIError:
    """The request's own error: its message's first line (the rest may be a backtrace);
    from a Ray error that lost the exception, its traceback's last line (the message)."""
    cause = getattr(exc, "cause", None)
    own = cause if isinstance(cause, InvalidRequestError) else exc
    lines = [line for line in str(own).splitlines() if line.strip()]
    if not lines:
        return APIError(400, "invalid request")
    return APIError(400, lines[0] if isinstance(own, InvalidRequestError) else lines[-1])


def _unavailable(exc: BaseException) -> APIError:
    return APIError(503, f"the engine replica is unavailable: {reason(exc)}")


def _failed(exc: BaseException) -> APIError:
    return APIError(500, f"the engine failed the request: {reason(exc)}")


# Failure type -> the client's error, in order (the first match wins).
_BY_TYPE: list[tuple[tuple[type[BaseException], ...], Callable[[BaseException], APIError]]] = [
    ((InvalidRequestError,), _invalid),
    # Serve's BackPressureError: every replica is full and so is this caller's queue.
    ((EngineOverloadedError, BackPressureError), lambda _: overloaded()),
    (
        (EngineDeadError, RayActorError, ReplicaUnavailableError, DeploymentUnavailableError),
        _unavailable,
    ),
    ((RequestFailedError, StepFailedError), _failed),
]


def to_api_error(exc: BaseException) -> APIError:
    """The client's error for `exc` (an unexpected one is logged, with its traceback)."""
    if isinstance(exc, APIError):
        return exc
    cause = exc.cause if isinstance(exc, RayTaskError) else None
    for types, make in _BY_TYPE:
        if isinstance(exc, types) or isinstance(cause, types):
            return make(exc)
    logger.error("unexpected error serving a request", exc_info=exc)
    return APIError(500, f"internal error: {type(cause or exc).__name__}")


# -- pydantic's validation errors as one OpenAI error ---------------------------------

_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}
_PLACES = {"body", "query", "path", "header", "cookie"}


def _field_path(loc: Any) -> str:
    """A pydantic error location as the client wrote it: where it was (`body`, `query`)
    and union-branch tags (`str`, `list[int]`, `constrained-str`) left out, list indices
    kept."""
    parts = []
    for i, p in enumerate(loc):
        if (i == 0 and p in _PLACES) or (
            isinstance(p, str) and ("[" in p or "-" in p or p in _TAGS)
        ):
            continue
        parts.append(str(p))
    return ".".join(parts)


def validation_error(errs: list[Any]) -> APIError:
    """A 400 for FastAPI's validation errors: the first field's, with every reason a
    union gave for it (a prompt is a string or one of three list forms)."""
    first = errs[0] if errs else {}
    if first.get("type") == "json_invalid":
        return APIError(
            400, f"the request body is not valid JSON: {first.get('msg', 'invalid JSON')}"
        )
    if not errs:
        return APIError(400, "invalid request")
    where = _field_path(first.get("loc", ()))
    top = where.split(".")[0]
    reasons = []
    for e in errs:
        path = _field_path(e.get("loc", ()))
        if path.split(".")[0] == top and e.get("msg") not in reasons:
            reasons.append(e.get("msg", "invalid"))
    msg = "; or ".join(reasons[:4])
    return APIError(400, f"{where}: {msg}" if where else msg, top or None)
