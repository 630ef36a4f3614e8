"""An answer, streamed or not: typed chunks in, `text/event-stream` out, or one body.

Each chunk is one event whose data is the chunk's JSON (pydantic's serializer, in
Rust: no per-token round trip through dicts); a failure midway is one more event
holding OpenAI's error body; `[DONE]` ends every stream, as OpenAI's does.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, Protocol

from fastapi.sse import EventSourceResponse, format_sse_event
from pydantic import BaseModel

from ..replica_messages import RequestDelta
from .errors import error_body, to_api_error
from .fanout import RequestStream

DONE = format_sse_event(data_str="[DONE]")


def event(chunk: BaseModel, with_usage: bool) -> bytes:
    """One chunk's event; its `usage` field only when the client asked for usage."""
    data = chunk.model_dump_json(exclude=None if with_usage else {"usage"})
    return format_sse_event(data_str=data)


def error_event(body: dict[str, Any]) -> bytes:
    return format_sse_event(data_str=json.dumps(body, ensure_ascii=False))


class ChunkBuilder(Protocol):
    """What `events` needs of an endpoint's builder (completions.py, chat.py)."""

    with_usage: bool

    async def add(self, i: int, d: RequestDelta) -> list[Any]: ...

    def chunk(self, choices: list[Any]) -> Any: ...

    def usage(self) -> Any: ...

    def response(self) -> Any: ...


async def events(builder: ChunkBuilder, deltas: RequestStream) -> AsyncIterator[bytes]:
    """A streamed answer: a chunk per new choice part, an error event if it fails midway,
    the usage chunk if asked for, then [DONE]. Closing it (the client left) aborts."""
    try:
        async for i, d in deltas:
            for choice in await builder.add(i, d):
                yield event(builder.chunk([choice]), builder.with_usage)
    except Exception as e:
        yield error_event(error_body(to_api_error(e)))
        yield DONE
        return
    finally:
        await deltas.aclose()  # a no-op when finished; an abort when the client left
    if builder.with_usage:
        last = builder.chunk([])
        last.usage = builder.usage()
        yield event(last, True)
    yield DONE


async def answer(builder: ChunkBuilder, deltas: RequestStream, stream: bool) -> Any:
    """An admitted request's answer: its event stream, or (not streamed) every delta
    taken by the builder and returned as one body."""
    if stream:
        return EventSourceResponse(events(builder, deltas))
    try:
        async for i, d in deltas:
            await builder.add(i, d)
    except Exception as e:
        raise to_api_error(e) from None
    finally:
        await deltas.aclose()
    return builder.response()
