"""The engine for many concurrent asyncio callers (what a server replica holds).

One background task steps the engine while there is work and sleeps when
there is none. Each step runs in a worker thread (torch releases the GIL), so
the event loop stays free to accept requests and stream tokens. The engine is
never touched by two threads at once: requests are added and aborted by the
background task between steps, and stats are snapshotted right after each
step, in the worker thread.

`generate` is an async iterator of RequestOutputs (each carrying the new
token ids and text of that step). Leaving it early, by cancellation, `break`
or an exception, aborts the request; its blocks are freed before the next
step runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from .config import EngineConfig
from .llm_engine import LLMEngine, PromptType
from .outputs import RequestOutput
from .sampling import SamplingParams
from .stats import EngineStats

logger = logging.getLogger("pagefleet.engine")


@dataclass
class _PendingAdd:
    request_id: str
    prompt: PromptType
    params: SamplingParams
    accepted: asyncio.Future[None]


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._adds: list[_PendingAdd] = []
        self._aborts: set[str] = set()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagefleet-step")
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._stats = engine.stats()

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncLLMEngine:
        return cls(LLMEngine(config))

    # -- public -----------------------------------------------------------------

    async def generate(
        self, prompt: PromptType, params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; raises ValueError for bad input before any output."""
        self._ensure_running()
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._streams[request_id] = queue
        accepted = asyncio.get_running_loop().create_future()
        self._adds.append(_PendingAdd(request_id, prompt, params, accepted))
        self._kick()
        finished = False
        try:
            await accepted
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Drop a request; its blocks are freed before the next step."""
        self._aborts.add(request_id)
        self._kick()

    def stats(self) -> EngineStats:
        """The snapshot taken after the latest step (or the latest add/abort)."""
        return self._stats

    @property
    def is_idle(self) -> bool:
        return not (self._adds or self._aborts or self.engine.has_unfinished_requests())

    async def wait_idle(self) -> None:
        """Return once no request is queued, running or pending."""
        while not self.is_idle:
            await asyncio.sleep(0.005)

    async def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._executor.shutdown(wait=True)

    # -- the loop -----------------------------------------------------------------

    def _ensure_running(self) -> None:
        if self._task is None or self._task.done():
            self._wakeup = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name="pagefleet-engine"
            )

    def _kick(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()

    def _apply_pending(self) -> None:
        """Adds and aborts, between steps; the only place requests enter or leave."""
        aborts, self._aborts = self._aborts, set()
        if aborts:
            self.engine.abort_request(aborts)
        adds, self._adds = self._adds, []
        for add in adds:
            if add.accepted.done():  # the caller went away before it was added
                continue
            if add.request_id in aborts:
                add.accepted.cancel()
                continue
            try:
                self.engine.add_request(add.request_id, add.prompt, add.params)
            except ValueError as e:
                add.accepted.set_exception(e)
            else:
                add.accepted.set_result(None)
        if aborts or adds:
            self._stats = self.engine.stats()

    def _step(self) -> tuple[list[RequestOutput], EngineStats]:
        outputs = self.engine.step()
        return outputs, self.engine.stats()

    async def _run(self) -> None:
        assert self._wakeup is not None
        loop = asyncio.get_running_loop()
        while True:
            self._apply_pending()
            if not self.engine.has_unfinished_requests():
                self._wakeup.clear()
                if not (self._adds or self._aborts):
                    await self._wakeup.wait()
                continue
            try:
                outputs, self._stats = await loop.run_in_executor(self._executor, self._step)
            except Exception as e:  # a failed step fails what was in flight, not the loop
                logger.exception("engine step failed; failing %d requests", len(self._streams))
                for rid, queue in list(self._streams.items()):
                    queue.put_nowait(RuntimeError(f"engine step failed: {e}"))
                    self._aborts.add(rid)
                continue
            for out in outputs:
                queue = self._streams.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(out)
