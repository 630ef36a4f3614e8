"""Ending an engine core from outside (what a Serve replica does when a tensor-parallel rank it
owns dies): streams fail with the cause, from any thread; a start-up can be abandoned."""

from __future__ import annotations

import asyncio
import threading
import time

import psutil
import pytest

from pagefleet.engine import AsyncLLMEngine, EngineConfig, SamplingParams
from pagefleet.engine.core_host import ProcessCoreHost
from pagefleet.engine.errors import EngineDeadError, EngineStartError

REASON = "tensor-parallel rank 1 died: its process was killed"


def test_kill_from_another_thread_fails_open_streams_with_the_reason(llama_dir: str) -> None:
    config = EngineConfig(model=llama_dir, num_kv_blocks=48, block_size=8, max_num_seqs=4)
    long = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)

    async def main() -> None:
        eng = AsyncLLMEngine.from_config(config, in_process=False)
        pid = eng._host.pid  # type: ignore[attr-defined]
        stream = eng.generate("while True:", long, "doomed")
        await stream.__anext__()
        killer = threading.Thread(target=eng.kill, args=(REASON,))  # as the rank watcher does
        killer.start()

        async def drain() -> None:  # outputs queued before the kill still come first
            async for _ in stream:
                pass

        with pytest.raises(EngineDeadError, match=f"^{REASON}$"):
            await asyncio.wait_for(drain(), 10)
        killer.join(10)
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        with pytest.raises(EngineDeadError, match=f"^{REASON}$"):
            eng.check_health()
        with pytest.raises(EngineDeadError, match=f"^{REASON}$"):
            async for _ in eng.generate("x", long, "late"):
                pass
        await eng.shutdown()

    asyncio.run(main())


def test_kill_before_any_request_is_seen_by_the_health_check(llama_dir: str) -> None:
    config = EngineConfig(model=llama_dir, num_kv_blocks=16, block_size=8)
    eng = AsyncLLMEngine.from_config(config)  # the core in a thread: same bookkeeping
    eng.kill(REASON)  # no event loop has used it yet: no reader to report the death

    async def main() -> None:
        with pytest.raises(EngineDeadError, match=f"^{REASON}$"):
            eng.check_health()
        with pytest.raises(EngineDeadError, match=f"^{REASON}$"):
            async for _ in eng.generate("x", SamplingParams(max_tokens=2), "late"):
                pass
        await eng.shutdown()

    asyncio.run(main())


def test_an_abandoned_start_ends_the_core_at_once(llama_dir: str) -> None:
    config = EngineConfig(model=llama_dir, num_kv_blocks=16, block_size=8)
    t0 = time.monotonic()
    with pytest.raises(EngineStartError, match=f"^the engine's start was abandoned: {REASON}$"):
        ProcessCoreHost(config, start_abort=lambda: REASON)
    assert time.monotonic() - t0 < 5


class _UnreadableConn:
    """The core's pipe, except that every message read is corrupt (0xc1 is never valid
    msgpack): the reader's decoding fails."""

    def __init__(self, conn: object) -> None:
        self._conn = conn

    def recv_bytes(self) -> bytes:
        return b"\xc1"

    def __getattr__(self, name: str) -> object:
        return getattr(self._conn, name)


def _unpicklable_command() -> object:
    from pagefleet.engine.core_messages import AbortRequests

    return AbortRequests((lambda: None,))  # type: ignore[arg-type]


@pytest.mark.parametrize("fault", ["reader", "sender"])
def test_a_failed_reader_or_sender_thread_ends_the_engine(llama_dir: str, fault: str) -> None:
    """Any exception in the threads between the event loop and the core process ends the
    engine with its reason: streams fail at once (not at request_timeout_s), the health
    check fails, and no engine process is left."""
    config = EngineConfig(model=llama_dir, num_kv_blocks=48, block_size=8, max_num_seqs=4)
    long = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
    expected = {
        "reader": "^the engine's events could not be read: DecodeError: ",
        "sender": "^a command could not be sent to the engine: ",
    }[fault]

    async def main() -> None:
        eng = AsyncLLMEngine.from_config(config, in_process=False)
        host = eng._host  # type: ignore[attr-defined]
        pid = host.pid
        if fault == "reader":
            host._conn = _UnreadableConn(host._conn)
        stream = eng.generate("while True:", long, "doomed")
        if fault == "sender":
            await stream.__anext__()
            host.send(_unpicklable_command())

        async def drain() -> None:
            async for _ in stream:
                pass

        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match=expected):
            await asyncio.wait_for(drain(), 10)
        assert time.monotonic() - t0 < 8
        with pytest.raises(EngineDeadError, match=expected):
            eng.check_health()
        host.process.join(5)
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        await eng.shutdown()

    asyncio.run(main())
