"""Why a replica's tensor-parallel group broke: set once, from any thread, waited on by
any number of coroutines.

The rank watcher (a thread) records the first rank that is gone; the replica's event
loop has to learn it too, from every stream that failed in the same moment. A wait
must therefore cost no thread: 64 streams failing at once, each parked in the default
executor for up to the grace period, would take that executor's few threads in turns
and deliver the last error tens of seconds late. Every waiter awaits one asyncio event
per loop, set through `call_soon_threadsafe` when the failure is recorded, so they all
wake together.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable

logger = logging.getLogger("pagefleet.cluster")


class RankFailure:
    """The group's failure: None while every rank runs, then the first reason for good.

    Once `stopping()` is called, ranks that end are the replica's own doing, not a
    failure: nothing is recorded from then on and waits return at once.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reason: str | None = None
        self._closing = False
        self._callbacks: list[Callable[[str], None]] = []
        self._events: dict[asyncio.AbstractEventLoop, asyncio.Event] = {}

    @property
    def reason(self) -> str | None:
        return self._reason

    def stopping(self) -> None:
        with self._lock:
            self._closing = True
            events = list(self._events.items())
        for loop, event in events:  # nobody waits for a failure that cannot come now
            with contextlib.suppress(RuntimeError):  # that loop is closed
                loop.call_soon_threadsafe(event.set)

    def record(self, reason: str) -> bool:
        """Record the failure (from any thread); False if stopping or already recorded."""
        with self._lock:
            if self._closing or self._reason is not None:
                return False
            self._reason = reason
            callbacks, self._callbacks = self._callbacks, []
            events = list(self._events.items())
        for loop, event in events:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(event.set)
        for callback in callbacks:
            try:
                callback(reason)
            except Exception:
                logger.exception("could not act on a lost tensor-parallel rank")
        return True

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Call `callback(reason)` once the failure is recorded (at once if it is)."""
        with self._lock:
            if self._reason is None:
                self._callbacks.append(callback)
                return
        callback(self._reason)

    async def wait(self, timeout_s: float) -> str | None:
        """The reason, waiting up to `timeout_s` for one (None if none came)."""
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._reason is not None or self._closing:
                return self._reason
            event = self._events.setdefault(loop, asyncio.Event())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout_s)
        return self._reason
