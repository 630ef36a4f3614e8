"""The engine for many concurrent asyncio callers (what a server replica holds).

`AsyncLLMEngine` keeps one stream per request and relays commands to an
engine core (`engine_core.py`) that runs either in a thread of this process
or in a process of its own (`core_host.py`); the event loop never steps the
model itself.

- `generate` is an async iterator of RequestOutputs (each carrying the new
  token ids and text of that step), or with `deltas=True` of the core's
  `RequestOutputDelta`s as they come (what a server relays: only the news;
  deltas a slow consumer has not taken yet are handed over merged, as one).
  Bad input raises ValueError before any output; leaving the iterator early
  (cancellation, `break`, an exception) aborts the request, and its blocks
  are freed before the next step.
- Every request gets an internal id unique for this engine's life, so a
  caller's id reused right after an abort is never hit by the old abort.
- A core that dies fails every open stream with `EngineDeadError`, and every
  later call raises it: a replica's health check reports it.
- With `announce_admission=True`, `generate` first yields `Admitted` once the
  core has queued the request (or raises why it did not: ValueError,
  EngineOverloadedError), so a server can answer 429 before it commits to a
  200 and a stream.
  `kill(reason)` ends the core from outside, from any thread, with the same
  effect (a tensor-parallel rank that the caller owns has died).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, overload

import msgspec

from .config import EngineConfig
from .core_host import CoreHost, ProcessCoreHost, ThreadCoreHost
from .core_messages import AbortRequests, AddRequest, CoreEvents, Query
from .errors import EngineDeadError, request_error
from .output_accumulator import OutputAccumulator
from .output_delta import RequestOutputDelta, merge
from .outputs import RequestOutput
from .sampling_params import SamplingParams
from .stats import EngineStats
from .tracing import TraceSettings

if TYPE_CHECKING:
    from .executor import ExecutorFactory
    from .input_processor import PromptType

logger = logging.getLogger("pagefleet.engine")


_SHUT_DOWN = "the engine was shut down"


@dataclass(frozen=True)
class Admitted:
    """The core has queued the request (what `generate(announce_admission=True)` yields first)."""

    request_id: str


@dataclass(frozen=True)
class _Accepted:
    prompt_token_ids: list[int] | None  # sent only for a prompt given as text


_Item = RequestOutputDelta | _Accepted | BaseException


class _Stream:
    """One request's items from the core, in order; deltas in a row can be taken as one."""

    def __init__(self) -> None:
        self._items: collections.deque[_Item] = collections.deque()
        self._ready = asyncio.Event()

    def put(self, item: _Item) -> None:
        self._items.append(item)
        self._ready.set()

    async def get(self, merged: bool) -> _Item:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        item = self._items.popleft()
        if merged and isinstance(item, RequestOutputDelta):
            while self._items and isinstance(self._items[0], RequestOutputDelta):
                item = merge(item, self._items.popleft())  # type: ignore[arg-type]
        return item


class AsyncLLMEngine:
    def __init__(self, host: CoreHost) -> None:
        self._host = host
        self.ready = host.ready
        self._stats: EngineStats = host.ready.stats
        self._streams: dict[str, _Stream] = {}
        self._user_ids: set[str] = set()
        self._replies: dict[int, asyncio.Future[Any]] = {}
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dead: str | None = None
        self._killed: str | None = None

    @classmethod
    def from_config(
        cls,
        config: EngineConfig,
        *,
        in_process: bool = True,
        executor_factory: ExecutorFactory | None = None,
        start_abort: Callable[[], str | None] | None = None,
        tracing: TraceSettings | None = None,
    ) -> AsyncLLMEngine:
        """in_process=False runs the engine core in a child process (what replicas use).

        `tracing`: the core emits a span for each request generated with trace headers.

        `executor_factory` runs tensor-parallel ranks 1..N-1 (default: local
        processes); `start_abort` (a child process only) returns why to stop
        waiting for the start-up, e.g. a rank the caller started is gone.
        """
        if in_process:
            # Here, not at the top: the engine proper loads torch, which a caller whose
            # core is a child process (a Serve replica) never needs in its own.
            from .engine_core import EngineCore
            from .llm_engine import LLMEngine

            core_tracer = None if tracing is None else tracing.core_tracer()
            engine = LLMEngine(config, executor_factory)
            return cls(ThreadCoreHost(EngineCore(engine, tracer=core_tracer)))
        return cls(
            ProcessCoreHost(
                config,
                executor_factory=executor_factory,
                start_abort=start_abort,
                tracing=tracing,
            )
        )

    # -- public -----------------------------------------------------------------

    @overload
    def generate(
        self,
        prompt: PromptType,
        params: SamplingParams,
        request_id: str,
        *,
        announce_admission: Literal[False] = False,
        deltas: Literal[False] = False,
        trace_headers: dict[str, str] | None = None,
    ) -> AsyncIterator[RequestOutput]: ...

    @overload
    def generate(
        self,
        prompt: PromptType,
        params: SamplingParams,
        request_id: str,
        *,
        announce_admission: bool = False,
        deltas: Literal[True],
        trace_headers: dict[str, str] | None = None,
    ) -> AsyncIterator[Any]: ...

    @overload
    def generate(
        self,
        prompt: PromptType,
        params: SamplingParams,
        request_id: str,
        *,
        announce_admission: Literal[True],
        deltas: Literal[False] = False,
        trace_headers: dict[str, str] | None = None,
    ) -> AsyncIterator[RequestOutput | Admitted]: ...

    async def generate(
        self,
        prompt: PromptType,
        params: SamplingParams,
        request_id: str,
        *,
        announce_admission: bool = False,
        deltas: bool = False,
        trace_headers: dict[str, str] | None = None,
    ) -> AsyncIterator[Any]:
        """Stream a request's outputs; raises ValueError for bad input before any output.

        announce_admission: yield `Admitted` first, as soon as the core queued it.
        deltas: yield the core's RequestOutputDeltas (named `request_id`), not whole outputs.
        trace_headers: the caller's span (W3C headers): the core's span of it is a child.
        """
        self._ensure_started()
        if request_id in self._user_ids:
            raise ValueError(f"request id {request_id!r} is already in use")
        internal_id = f"{request_id}#{next(self._ids)}"
        stream = _Stream()
        self._streams[internal_id] = stream
        self._user_ids.add(request_id)
        self._host.send(AddRequest(internal_id, prompt, params, trace_headers))
        whole = None if deltas else OutputAccumulator()
        finished = False
        try:
            while True:
                item = await stream.get(merged=deltas)
                if isinstance(item, BaseException):
                    finished = True  # the core has already dropped it
                    raise item
                if isinstance(item, _Accepted):
                    if whole is not None:
                        text, ids = _prompt_parts(prompt)
                        whole.add(internal_id, text, item.prompt_token_ids or ids)
                    if announce_admission:
                        yield Admitted(request_id)
                    continue
                finished = item.finished
                if whole is None:
                    yield msgspec.structs.replace(item, request_id=request_id)
                else:
                    yield whole.apply(item, request_id)
                if finished:
                    return
        finally:
            self._streams.pop(internal_id, None)
            self._user_ids.discard(request_id)
            if not finished and self._dead is None:
                self._host.send(AbortRequests((internal_id,)))

    def stats(self) -> EngineStats:
        """The latest snapshot the core sent (at most a few hundred ms old)."""
        return self._stats

    async def fetch_stats(self) -> EngineStats:
        """A fresh snapshot, taken by the core between steps."""
        self._stats = await self._query("stats")
        return self._stats

    async def check_block_accounting(self) -> None:
        """Raise AssertionError unless the core's block pool balances."""
        problem = await self._query("check_accounting")
        if problem is not None:
            raise AssertionError(problem)

    @property
    def num_open_streams(self) -> int:
        return len(self._streams)

    @property
    def is_dead(self) -> bool:
        return self._dead is not None

    def check_health(self) -> None:
        reason = self._dead or self._killed
        if reason is not None:
            raise EngineDeadError(reason)

    def kill(self, reason: str) -> None:
        """End the engine now, from any thread: open streams and later calls fail with `reason`.

        For a part the engine cannot work without that died under it (a
        tensor-parallel rank): a step may be hung in a collective, so the core
        is not asked to stop, it is stopped.
        """
        if self._dead is None and self._killed is None:
            logger.error("killing the engine: %s", reason)
            self._killed = reason
        self._host.kill(reason)

    async def wait_idle(self, poll_s: float = 0.01) -> None:
        """Return once no stream is open and the core runs and queues nothing."""
        while True:
            if not self._streams:
                stats = await self.fetch_stats()
                if stats.num_running == stats.num_waiting == 0:
                    return
            await asyncio.sleep(poll_s)

    async def shutdown(self) -> None:
        """Stop the core (and its TP workers); open streams fail with EngineDeadError."""
        if self._dead is None:
            self._on_dead(_SHUT_DOWN)
        await asyncio.get_running_loop().run_in_executor(None, self._host.close)

    # -- plumbing -----------------------------------------------------------------

    def _ensure_started(self) -> None:
        self.check_health()
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._host.start(self._loop, self._on_events, self._on_dead)

    async def _query(self, name: str) -> Any:
        self._ensure_started()
        query_id = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._replies[query_id] = fut
        self._host.send(Query(query_id, name))
        try:
            return await fut
        finally:
            self._replies.pop(query_id, None)

    def _on_events(self, events: CoreEvents) -> None:
        for err in events.rejected + events.failed:
            stream = self._streams.get(err.request_id)
            if stream is not None:
                stream.put(request_error(err.error, err.message))
        for rid in events.accepted:  # before outputs: the core queued it before stepping
            stream = self._streams.get(rid)
            if stream is not None:
                stream.put(_Accepted(events.prompt_token_ids.get(rid)))
        for out in events.outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put(out)
        for query_id, answer in events.replies.items():
            fut = self._replies.get(query_id)
            if fut is not None and not fut.done():
                fut.set_result(answer)
        if events.stats is not None:
            self._stats = events.stats

    def _on_dead(self, reason: str) -> None:
        if self._dead is not None:
            return
        reason = self._killed or reason  # killed: the cause, not "the process exited"
        self._dead = reason
        log = logger.info if reason == _SHUT_DOWN else logger.error
        log("engine stopped: %s; failing %d open streams", reason, len(self._streams))
        for stream in self._streams.values():
            stream.put(EngineDeadError(reason))
        for fut in self._replies.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(reason))


def _prompt_parts(prompt: PromptType) -> tuple[str | None, list[int]]:
    """(text, token ids) of a prompt as the caller gave it (ids empty for text alone)."""
    if isinstance(prompt, str):
        return prompt, []
    if isinstance(prompt, dict):
        return prompt.get("prompt"), list(prompt.get("prompt_token_ids") or [])
    return None, list(prompt)
