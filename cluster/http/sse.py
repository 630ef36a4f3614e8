"""Server-sent events of a streamed answer: typed chunks in, `text/event-stream` out.

Each chunk is one event whose data is the chunk's JSON (pydantic's serializer, in
Rust: no per-token round trip through dicts); a failure midway is one more event
holding OpenAI's error body; `[DONE]` ends every stream, as OpenAI's does.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi.sse import EventSourceResponse, format_sse_event
from pydantic import BaseModel

DONE = format_sse_event(data_str="[DONE]")


def event(chunk: BaseModel, with_usage: bool) -> bytes:
    """One chunk's event; its `usage` field only when the client asked for usage."""
    data = chunk.model_dump_json(exclude=None if with_usage else {"usage"})
    return format_sse_event(data_str=data)


def error_event(body: dict[str, Any]) -> bytes:
    return format_sse_event(data_str=json.dumps(body, ensure_ascii=False))


def event_stream(events: AsyncIterator[bytes]) -> EventSourceResponse:
    return EventSourceResponse(events)
