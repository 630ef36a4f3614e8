"""One request's deltas: its prompts fanned out to the engines, merged, under a deadline.

A completion with several prompts is one engine request per prompt; `merged`
streams all of their deltas as they come, tagged with the prompt's index, and
closing it aborts every one. `RequestStream` wraps that stream with the request's
deadline and the admission wait: the endpoint answers 200 only once every prompt
is queued on an engine, so a full queue is a 429, never a 200 followed by an error.

A request whose client goes away, queued or streaming, is cancelled: its stream is
closed, which closes the replica streams, which abort the engine requests and free
their blocks.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator

import anyio

from ..replica_messages import ReplicaRequest, RequestDelta
from .backend import EngineBackend
from .errors import APIError, to_api_error


async def merged(
    backend: EngineBackend, requests: list[ReplicaRequest]
) -> AsyncIterator[tuple[int, RequestDelta]]:
    """Every request's deltas, merged as they come: (its index, delta)."""
    if len(requests) == 1:
        # aclosing: closing this generator closes the backend's at once (an abort).
        async with contextlib.aclosing(backend.generate(requests[0])) as deltas:
            async for d in deltas:
                yield 0, d
        return
    queue: asyncio.Queue[tuple[int, RequestDelta | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, r: ReplicaRequest) -> None:
        try:
            async for d in backend.generate(r):
                queue.put_nowait((i, d))
        except BaseException as e:
            queue.put_nowait((i, e))
            raise
        queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(requests)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class RequestStream:
    """One request's merged (prompt index, delta) stream, bounded by its deadline.

    `admit()` waits until an engine has queued every prompt (each replica stream starts
    with an empty delta saying so); only then does the endpoint answer 200. A deadline
    that passes, at any point, is an APIError 408. `aclose()` aborts what is left, even
    from a cancelled task (Starlette cancels a stream whose client went away).
    """

    def __init__(
        self,
        gen: AsyncIterator[tuple[int, RequestDelta]],
        num_prompts: int,
        deadline: float | None,
        timeout_s: float | None,
    ) -> None:
        self._gen = gen
        self._num_prompts = num_prompts
        self._deadline = deadline
        self._timeout_s = timeout_s
        self._buffer: collections.deque[tuple[int, RequestDelta]] = collections.deque()

    async def _next(self) -> tuple[int, RequestDelta]:
        try:
            async with asyncio.timeout_at(self._deadline):
                return await anext(self._gen)
        except TimeoutError:
            raise APIError(
                408,
                "the request did not finish within the server's request_timeout_s "
                f"({self._timeout_s:g} s) and was cancelled",
            ) from None

    async def admit(self) -> None:
        """Return once every prompt is queued; raises why one was not (as an APIError)."""
        admitted: set[int] = set()
        try:
            while len(admitted) < self._num_prompts:
                i, d = await self._next()
                if i in admitted or d.samples or d.finished:
                    self._buffer.append((i, d))
                admitted.add(i)
        except StopAsyncIteration:
            await self.aclose()
            raise APIError(503, "the engine replica ended the request before queueing it") from None
        except BaseException as e:
            await self.aclose()
            if isinstance(e, Exception):
                raise to_api_error(e) from None
            raise

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> tuple[int, RequestDelta]:
        if self._buffer:
            return self._buffer.popleft()
        return await self._next()

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            await self._gen.aclose()  # type: ignore[attr-defined]
