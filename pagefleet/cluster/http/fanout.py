"""One request's deltas: its prompts fanned out to the engines, merged, under a deadline.

A completion with several prompts is one engine request per prompt; `Fanout`
streams all of their deltas as they come, tagged with the prompt's index, hands a
consumer that lags what came meanwhile as one delta, and closing it aborts every
one. `RequestStream` wraps that stream with the request's
deadline and the admission wait: the endpoint answers 200 only once every prompt
is queued on an engine, so a full queue is a 429, never a 200 followed by an error.

A request whose client goes away, queued or streaming, is cancelled: its stream is
closed, which closes the replica streams, which abort the engine requests and free
their blocks.
"""

from __future__ import annotations

import asyncio
import collections

import anyio

from ..replica_messages import ReplicaRequest, RequestDelta, merge_deltas
from .backend import EngineBackend
from .errors import APIError, to_api_error
from .observability import observe_delta


class Fanout:
    """Every request's deltas as they come, tagged with its prompt's index.

    One pump task per request reads its replica stream into one queue, so what comes
    while the consumer is busy waits there: `take_ready` hands the consumer, at once and
    merged, the deltas of a prompt that are already in (one SSE chunk, not one per
    token, when the ingress lags). `aclose` cancels the pumps, which closes the replica
    streams: the engines abort what is left.
    """

    def __init__(self, backend: EngineBackend, requests: list[ReplicaRequest]) -> None:
        self._items: collections.deque[tuple[int, RequestDelta | BaseException | None]] = (
            collections.deque()
        )
        self._arrived = asyncio.Event()
        self._remaining = len(requests)
        self._tasks = [
            asyncio.create_task(self._pump(backend, i, r)) for i, r in enumerate(requests)
        ]

    def _put(self, item: tuple[int, RequestDelta | BaseException | None]) -> None:
        self._items.append(item)
        self._arrived.set()

    async def _pump(self, backend: EngineBackend, i: int, r: ReplicaRequest) -> None:
        try:
            async for d in backend.generate(r):
                observe_delta(d)
                self._put((i, d))
        except BaseException as e:
            self._put((i, e))
            raise
        self._put((i, None))

    async def get(self) -> tuple[int, RequestDelta]:
        """The next delta; StopAsyncIteration once every request ended, or what one raised."""
        while True:
            while not self._items:
                if not self._remaining:
                    raise StopAsyncIteration
                self._arrived.clear()
                await self._arrived.wait()
            i, item = self._items.popleft()
            if item is None:
                self._remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                return i, item

    def take_ready(self, i: int, delta: RequestDelta) -> RequestDelta:
        """`delta` with the deltas of prompt i that are in already and next in line."""
        while self._items:
            j, item = self._items[0]
            if j != i or not isinstance(item, RequestDelta) or delta.finished:
                break
            self._items.popleft()
            delta = merge_deltas(delta, item)
        return delta

    async def aclose(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def timed_out(timeout_s: float) -> APIError:
    """The 408 of a request past its deadline."""
    return APIError(
        408,
        "the request did not finish within the server's request_timeout_s "
        f"({timeout_s:g} s) and was cancelled",
    )


class RequestStream:
    """One request's merged (prompt index, delta) stream, bounded by its deadline.

    `admit()` waits until an engine has queued every prompt (each replica stream starts
    with an empty delta saying so); only then does the endpoint answer 200. A deadline
    that passes, at any point, is an APIError 408. `aclose()` aborts what is left, even
    from a cancelled task (Starlette cancels a stream whose client went away).
    """

    def __init__(
        self,
        fanout: Fanout,
        num_prompts: int,
        deadline: float | None,
        timeout_s: float | None,
    ) -> None:
        self._fanout = fanout
        self._num_prompts = num_prompts
        self._deadline = deadline
        self._timeout_s = timeout_s
        self._buffer: collections.deque[tuple[int, RequestDelta]] = collections.deque()

    async def _next(self) -> tuple[int, RequestDelta]:
        try:
            async with asyncio.timeout_at(self._deadline):
                return await self._fanout.get()
        except TimeoutError:
            assert self._timeout_s is not None
            raise timed_out(self._timeout_s) from None

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
        i, d = await self._next()
        return i, self._fanout.take_ready(i, d)

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            await self._fanout.aclose()
