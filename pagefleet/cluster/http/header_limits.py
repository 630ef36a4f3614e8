"""The bound on a request's header fields, at Serve's HTTP proxy: more than
`limits.max_headers` fields, or more than `limits.max_header_bytes` bytes of them (each
field counted as `name: value\\r\\n`), is answered 431 with OpenAI's error body
(`param: "headers"`) before the request is routed to any replica.

Serve's proxy takes ASGI middlewares only from its `RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`
callback, read when the proxy starts: `proxy_middlewares` is that callback, and the
bounds reach it as the environment variables `PAGEFLEET_MAX_HEADER_BYTES` and
`PAGEFLEET_MAX_HEADERS` (`proxy_env` writes them from the config; unset: `Limits`'
defaults). The proxy's parser
(uvicorn on httptools, as Serve 2.60 starts it) reads a whole header block before any
middleware sees it: the bound refuses the request, it does not cap what the parser
buffers first; a reverse proxy in front (the chart's Ingress) caps that.
"""

from __future__ import annotations

import os
from typing import Any

from .errors import error_response

MAX_HEADER_BYTES_ENV = "PAGEFLEET_MAX_HEADER_BYTES"
MAX_HEADERS_ENV = "PAGEFLEET_MAX_HEADERS"
PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
_FIELD_OVERHEAD = 4  # ": " and "\r\n"


def over_limit(headers: list[tuple[bytes, bytes]], max_bytes: int, max_count: int) -> str | None:
    """What the header fields exceed, in words, or None."""
    if len(headers) > max_count:
        return f"the request has {len(headers)} header fields, over the limit of {max_count} (max_headers)"
    size = sum(len(n) + len(v) + _FIELD_OVERHEAD for n, v in headers)
    if size > max_bytes:
        return f"the request's header fields take {size} bytes, over the limit of {max_bytes} (max_header_bytes)"
    return None


class HeaderLimits:
    """Pure ASGI middleware: 431 for a request whose header fields exceed the bounds."""

    def __init__(self, app: Any, max_header_bytes: int, max_headers: int) -> None:
        self.app = app
        self.max_header_bytes = max_header_bytes
        self.max_headers = max_headers

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            headers = scope.get("headers", [])
            problem = over_limit(headers, self.max_header_bytes, self.max_headers)
            if problem is not None:
                await error_response(431, problem, param="headers")(scope, receive, send)
                return
        await self.app(scope, receive, send)


def proxy_env(max_header_bytes: int, max_headers: int) -> dict[str, str]:
    """The environment that installs the bound in every Serve proxy started under it."""
    return {
        PROXY_CALLBACK_ENV: f"{__name__}:{proxy_middlewares.__name__}",
        MAX_HEADER_BYTES_ENV: str(max_header_bytes),
        MAX_HEADERS_ENV: str(max_headers),
    }


def proxy_middlewares() -> list[Any]:
    """Serve's proxy callback: the header bound, from the environment `proxy_env` wrote."""
    from starlette.middleware import Middleware

    from ..config import Limits

    defaults = Limits()
    return [
        Middleware(
            HeaderLimits,
            max_header_bytes=int(os.environ.get(MAX_HEADER_BYTES_ENV, defaults.max_header_bytes)),
            max_headers=int(os.environ.get(MAX_HEADERS_ENV, defaults.max_headers)),
        )
    ]
