"""`pagefleet serve` stopping its own Ray: Serve's shutdown is waited for on the main thread,
within STOP_WAIT_S, and never left running in a thread that would call into Ray after
ray.shutdown() (Ray's core worker then ends the process with a non-zero code)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from pagefleet.cluster import launcher


class SlowServe:
    """A Serve whose shutdown drains forever (streams that never end)."""

    def __init__(self) -> None:
        self.started = 0
        self.cancelled = 0

    async def shutdown_async(self) -> None:
        self.started += 1
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise


class QuickServe:
    def __init__(self) -> None:
        self.done = 0

    async def shutdown_async(self) -> None:
        self.done += 1


def test_a_shutdown_past_the_deadline_is_cancelled_and_leaves_no_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(launcher, "STOP_WAIT_S", 0.2)
    before = set(threading.enumerate())
    serve = SlowServe()
    launcher._stop_serve(serve)
    assert (serve.started, serve.cancelled) == (1, 1)
    assert set(threading.enumerate()) == before


def test_a_quick_shutdown_is_awaited() -> None:
    serve = QuickServe()
    launcher._stop_serve(serve)
    assert serve.done == 1
