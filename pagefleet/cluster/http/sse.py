"""An answer, streamed or not: chunks in, `text/event-stream` out, or one body.

Each chunk is one event whose data is the chunk's JSON. Per token, no pydantic model
is built: what every chunk of a stream shares (id, object, created, model, and
`"usage":null` when the client asked for usage) is encoded once per stream
(`ChunkEnvelope`), and each chunk's choices are plain dicts of the protocol's chunk
models' fields, encoded by msgspec (0.5 us a chunk here, against 11 us for building
and dumping the pydantic chunk; tests/cluster/http/test_sse.py checks the two agree). The
last chunk (usage) and every non-streamed body still go through the pydantic models.
A failure midway is one more event holding OpenAI's error body; `[DONE]` ends every
stream, as OpenAI's does.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, Protocol

import msgspec
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


_json = msgspec.json.Encoder()


class ChunkEnvelope:
    """Events of one stream's chunks, from their choices (dicts, in the chunk model's
    field order), around the fields every chunk of the stream shares."""

    def __init__(self, rid: str, obj: str, created: int, model: str, with_usage: bool) -> None:
        shared = _json.encode({"id": rid, "object": obj, "created": created, "model": model})
        self._head = b"data: " + shared[:-1] + b',"choices":['
        self._with_usage = with_usage
        self._tail = b'],"usage":null}\n\n' if with_usage else b"]}\n\n"

    def event(self, choices: list[dict[str, Any]], extra: dict[str, Any] | None = None) -> bytes:
        """A chunk's event; `extra`: top-level fields this chunk alone carries (vLLM's
        `prompt_token_ids` on the first, the usage so far on each)."""
        body = self._head + b",".join(_json.encode(c) for c in choices)
        if not extra:
            return body + self._tail
        fields: dict[str, Any] = {"usage": None} if self._with_usage else {}
        fields.update(extra)
        return body + b"]," + _json.encode(fields)[1:] + b"\n\n"


def error_event(body: dict[str, Any]) -> bytes:
    return format_sse_event(data_str=json.dumps(body, ensure_ascii=False))


class ChunkBuilder(Protocol):
    """What `events` needs of an endpoint's builder (completions.py, chat.py)."""

    with_usage: bool
    envelope: ChunkEnvelope

    async def add(self, i: int, d: RequestDelta) -> list[dict[str, Any]]: ...

    def extra_fields(self) -> dict[str, Any]: ...

    def chunk(self, choices: list[Any]) -> Any: ...

    def usage(self) -> Any: ...

    def response(self) -> Any: ...


async def events(builder: ChunkBuilder, deltas: RequestStream) -> AsyncIterator[bytes]:
    """A streamed answer: a chunk per new choice part, an error event if it fails midway,
    the usage chunk if asked for, then [DONE]. Closing it (the client left) aborts."""
    try:
        async for i, d in deltas:
            for choice in await builder.add(i, d):
                yield builder.envelope.event([choice], builder.extra_fields())
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
