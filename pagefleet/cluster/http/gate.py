"""The gate in front of every route: the API key, then the body size.

With an API key (vLLM's `--api-key` semantics), /v1/*, /tokenize, /detokenize and
/dashboard/data need `Authorization: Bearer <key>` (compared in constant time, as
fixed-length digests); /health, /version and the docs stay open, /metrics unless
`protect_metrics` is false (by default it is protected whenever there is a key).
Both checks run before FastAPI reads or parses anything, so an unauthenticated or
oversized request costs no JSON parsing.

The gate also stamps the request's arrival (`ARRIVED` in the scope's state, the
event loop's time) before it reads the body, which the request time-out counts
from, and gives reading the body `body_read_timeout_s`: a body still arriving
after it is a 408, and the connection's slot is free again.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from starlette._utils import get_route_path  # what Starlette's router matches on

from .errors import error_response

_KEYED_PREFIXES = ("/v1", "/tokenize", "/detokenize", "/dashboard/data")
ARRIVED = "pagefleet_arrived"


def arrival(scope: dict[str, Any]) -> float:
    """When the gate let the request in (the loop's time), or now if it did not stamp it."""
    arrived = scope.get("state", {}).get(ARRIVED)
    return arrived if arrived is not None else asyncio.get_running_loop().time()


def is_keyed(path: str, protect_metrics: bool) -> bool:
    """Whether `path` needs the API key (prefix match on whole segments, as routes match)."""
    prefixes = (*_KEYED_PREFIXES, "/metrics") if protect_metrics else _KEYED_PREFIXES
    return any(path == p or path.startswith(p + "/") for p in prefixes)


def _scopeis_keyed(scope: dict[str, Any], protect_metrics: bool) -> bool:
    """Whether the route this request reaches needs the key.

    Under a prefix (Serve's `route_prefix`, `http_options.root_path`) the scope's path
    keeps the prefix and `root_path` names it; Starlette routes on the path without it.
    The gate asks Starlette's own function, so it judges exactly the path the router
    will match, and also the full path, so that neither reading can open a keyed route.
    """
    return is_keyed(get_route_path(scope), protect_metrics) or is_keyed(
        scope["path"], protect_metrics
    )


def _digest(key: str) -> bytes:
    # Comparing fixed-length digests keeps even the key's length out of the timing.
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


@dataclass(frozen=True)
class GateSettings:
    """What the gate checks; replaced whole when the ingress is reconfigured, so a request
    sees one consistent set (the gate reads it once per request)."""

    api_key: str | None = field(default=None, repr=False)
    protect_metrics: bool | None = None  # None: protected when there is a key
    max_body_bytes: int = 2 * 1024 * 1024
    body_read_timeout_s: float = 30.0
    key_digest: bytes | None = field(init=False, repr=False, default=None)

    def __post_init__(self) -> None:
        object.__setattr__(self, "key_digest", _digest(self.api_key) if self.api_key else None)

    @property
    def metrics_keyed(self) -> bool:
        return self.protect_metrics if self.protect_metrics is not None else bool(self.api_key)


class Gate:
    """Pure ASGI middleware in front of every route: the API key, then the body size.

    Both run before FastAPI reads or parses anything, so an unauthenticated or oversized
    request costs no JSON parsing. The body is read here (bounded) and replayed to the app;
    later `receive` calls (a stream's disconnect watch) go to the server as before.
    `settings` is asked once per request: the app's current `GateSettings`.
    """

    def __init__(self, app: Any, settings: Callable[[], GateSettings]) -> None:
        self.app = app
        self._settings = settings

    @staticmethod
    def _authorized(scope: dict[str, Any], key: bytes) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                if scheme.lower() == "bearer":
                    return hmac.compare_digest(_digest(token.strip()), key)
        return False

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope.setdefault("state", {})[ARRIVED] = asyncio.get_running_loop().time()
        settings = self._settings()
        key, max_body = settings.key_digest, settings.max_body_bytes
        if (
            key is not None
            and scope["method"] != "OPTIONS"
            and _scopeis_keyed(scope, settings.metrics_keyed)
            and not self._authorized(scope, key)
        ):
            # Never echo what was sent: a wrong key may be a real one for something else.
            response = error_response(
                401,
                "Missing or invalid API key: send `Authorization: Bearer <key>`.",
                headers={"WWW-Authenticate": "Bearer"},
            )
            await response(scope, receive, send)
            return
        too_large = error_response(
            413,
            f"the request body exceeds the limit of {max_body} bytes (max_body_bytes)",
        )
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > max_body:
                    await too_large(scope, receive, send)
                    return
        if scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        timeout = settings.body_read_timeout_s
        try:
            async with asyncio.timeout(timeout):
                body = await self._body(receive, max_body)
        except TimeoutError:
            late = error_response(
                408,
                f"the request body did not arrive within {timeout:g} s (body_read_timeout_s)",
                headers={"Connection": "close"},
            )
            await late(scope, receive, send)
            return
        if body is None:  # the client left before sending it all
            return
        if len(body) > max_body:
            await too_large(scope, receive, send)
            return
        replay = [{"type": "http.request", "body": body, "more_body": False}]

        async def replaying_receive() -> dict[str, Any]:
            return replay.pop(0) if replay else await receive()

        await self.app(scope, replaying_receive, send)

    @staticmethod
    async def _body(receive: Any, max_body: int) -> bytes | None:
        """The whole body (chunked bodies declare no length), read until it ends or
        passes `max_body` (then what came so far); None if the client left."""
        chunks: list[bytes] = []
        size = 0
        while size <= max_body:
            message = await receive()
            if message["type"] != "http.request":
                return None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if not message.get("more_body", False):
                break
        return b"".join(chunks)
