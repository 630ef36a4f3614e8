"""Where the engine core runs: a thread of this process, or a process of its own.

Both hosts take commands from any thread (`send`) and deliver `CoreEvents` to
a callback on the caller's asyncio loop; `AsyncLLMEngine` does not know which
one it has.

`ProcessCoreHost` is what a server replica uses. The engine's Python (scheduling,
sampling, detokenizing) then holds its own GIL, and the replica's event loop
only relays commands in and per-step events out (vLLM v1's EngineCore
process). Measured on this 2-core machine through Ray Serve: +27% tokens/s at
20 users over stepping in a thread of the replica. Two details keep it from
deadlocking or blocking the event loop:

- commands go through a sender thread, so a large prompt never blocks the loop
  on a full pipe while the core is itself blocked writing events back;
- events are read by a reader thread with blocking reads and handed to the
  loop with `call_soon_threadsafe`. Not `loop.add_reader`: uvloop (Serve's
  loop) makes a registered fd non-blocking, and a message larger than the
  socket buffer (50 streams' outputs) then fails half-read.

The child exits when the parent process dies (a watchdog polls the parent
pid), so a killed replica leaves no engine behind.

Under tensor parallelism the child is rank 0. Its other ranks may have been
started by the caller (a Serve replica's rank actors): the caller then passes
a picklable `executor_factory` for them, and a `start_abort` check that ends
the wait for the engine's start-up as soon as one of those ranks is gone.
`kill` ends the core at once from any thread (a rank died under it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Protocol

from .config import EngineConfig
from .core_messages import (
    Command,
    CoreEvents,
    CoreReady,
    Shutdown,
    decode_events,
    encode_events,
)
from .errors import EngineStartError
from .parent_watch import watch_parent
from .startup import StartupTimeline
from .tracing import TraceSettings

if TYPE_CHECKING:
    from .engine_core import EngineCore
    from .executor import ExecutorFactory

logger = logging.getLogger("pagefleet.engine")

EventSink = Callable[[CoreEvents], None]
DeathSink = Callable[[str], None]


class CoreHost(Protocol):
    ready: CoreReady

    def start(
        self, loop: asyncio.AbstractEventLoop, on_events: EventSink, on_dead: DeathSink
    ) -> None:
        """Begin delivering events to `on_events` on `loop`; `on_dead` once, if the core dies."""
        ...

    def send(self, command: Command) -> None: ...

    def close(self, timeout: float = 30.0) -> None: ...

    def kill(self, reason: str) -> None:
        """Stop the core now, from any thread; `on_dead` gets `reason` if started."""
        ...


class _QueueInbox:
    def __init__(self) -> None:
        self.queue: queue.SimpleQueue[Command] = queue.SimpleQueue()

    def get(self, block: bool) -> list[Command]:
        items: list[Command] = []
        if block:
            items.append(self.queue.get())
        with contextlib.suppress(queue.Empty):
            while True:
                items.append(self.queue.get_nowait())
        return items


class ThreadCoreHost:
    """The core in a thread of this process (tests, notebooks, the standalone engine)."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.ready = core.ready()
        self._inbox = _QueueInbox()
        self._thread: threading.Thread | None = None
        self._report_dead: Callable[[str], None] | None = None

    def start(
        self, loop: asyncio.AbstractEventLoop, on_events: EventSink, on_dead: DeathSink
    ) -> None:
        def dead(reason: str) -> None:
            with contextlib.suppress(RuntimeError):  # the event loop is already closed
                loop.call_soon_threadsafe(on_dead, reason)

        self._report_dead = dead

        def emit(events: CoreEvents) -> None:
            loop.call_soon_threadsafe(on_events, events)

        def main() -> None:
            try:
                self.core.run(self._inbox, emit)
            except BaseException as e:  # the loop must never die silently
                logger.exception("engine core loop died")
                dead(f"engine core died: {type(e).__name__}: {e}")

        self._thread = threading.Thread(target=main, name="pagefleet-engine-core", daemon=True)
        self._thread.start()

    def send(self, command: Command) -> None:
        self._inbox.queue.put(command)

    def close(self, timeout: float = 30.0) -> None:
        if self._thread is not None and self._thread.is_alive():
            self.send(Shutdown())
            self._thread.join(timeout)
        self.core.engine.close()

    def kill(self, reason: str) -> None:
        # A thread cannot be killed: it stops after its current step; the caller hears now.
        self.send(Shutdown())
        if self._report_dead is not None:
            self._report_dead(reason)


# -- a process of its own ---------------------------------------------------------------


class _PipeInbox:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def get(self, block: bool) -> list[Command]:
        items: list[Command] = []
        if block:
            items.extend(self.conn.recv())
        while self.conn.poll(0):
            items.extend(self.conn.recv())
        return items


def _core_main(
    config: EngineConfig,
    conn: Connection,
    parent_pid: int,
    executor_factory: ExecutorFactory | None = None,
    tracing: TraceSettings | None = None,
) -> None:
    startup = StartupTimeline(time.time())
    startup.mark("engine_process")
    # The engine proper (torch) loads here, in the child: the host's side never needs it.
    from .engine_core import EngineCore
    from .llm_engine import LLMEngine

    startup.mark("imports")
    threading.Thread(target=watch_parent, args=(parent_pid,), daemon=True).start()
    try:
        engine = LLMEngine(config, executor_factory, startup)
    except BaseException as e:
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    core = EngineCore(engine, tracer=None if tracing is None else tracing.core_tracer())
    try:
        conn.send(("ready", core.ready()))
        core.run(_PipeInbox(conn), lambda events: conn.send_bytes(encode_events(events)))
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass  # the parent went away
    finally:
        engine.close()


@contextlib.contextmanager
def _passive_omp() -> Iterator[None]:
    """Start children with OMP_WAIT_POLICY=PASSIVE unless the user chose a policy.

    A replica's engine shares the cores with Serve's proxy, the ingress and the
    replica's own event loop. OpenMP's default lets idle team threads spin, and
    on a busy 2-core machine a spinning thread burns the time slice its
    partner needs to reach the barrier: measured here, one decode step of
    SmolLM-135M took 2.4 s instead of 55 ms with another process on a core.
    Passive waiting (futex sleep) gives that back. libgomp reads the variable
    once, at start-up, so it must be in the child's environment from the start.
    """
    key = "OMP_WAIT_POLICY"
    previous = os.environ.get(key)
    if previous is None:
        os.environ[key] = "PASSIVE"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(key, None)


class ProcessCoreHost:
    """The core in a spawned child process, talking over one duplex pipe."""

    def __init__(
        self,
        config: EngineConfig,
        start_timeout_s: float = 600.0,
        executor_factory: ExecutorFactory | None = None,
        start_abort: Callable[[], str | None] | None = None,
        tracing: TraceSettings | None = None,
    ) -> None:
        """Start the core; `start_abort` returns why to give up waiting for it (or None);
        `tracing`: where the core sends its spans."""
        ctx = mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe(duplex=True)
        self._death_reason: str | None = None
        self.process = ctx.Process(
            target=_core_main,
            args=(config, child_conn, os.getpid(), executor_factory, tracing),
            name="pagefleet-engine-core",
            daemon=True,
        )
        with _passive_omp():
            self.process.start()
        child_conn.close()
        self._outbox: queue.SimpleQueue[Command | None] = queue.SimpleQueue()
        self._dead = False
        deadline = time.monotonic() + start_timeout_s
        while not self._conn.poll(0.2):
            if start_abort is not None and (reason := start_abort()) is not None:
                self._kill()
                raise EngineStartError(f"the engine's start was abandoned: {reason}")
            if time.monotonic() > deadline:
                self._kill()
                raise EngineStartError(f"the engine did not start within {start_timeout_s:.0f} s")
        try:
            kind, payload = self._conn.recv()
        except EOFError:
            self._kill()
            raise EngineStartError(
                f"the engine process exited during start-up (exit code {self.process.exitcode})"
            ) from None
        if kind != "ready":
            self._kill()
            raise EngineStartError(payload)
        self.ready: CoreReady = payload
        self._sender = threading.Thread(
            target=self._send_loop, name="pagefleet-core-send", daemon=True
        )
        self._sender.start()

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def start(
        self, loop: asyncio.AbstractEventLoop, on_events: EventSink, on_dead: DeathSink
    ) -> None:
        self._reader = threading.Thread(
            target=self._read_loop,
            args=(loop, on_events, on_dead),
            name="pagefleet-core-read",
            daemon=True,
        )
        self._reader.start()

    def _read_loop(
        self, loop: asyncio.AbstractEventLoop, on_events: EventSink, on_dead: DeathSink
    ) -> None:
        """Deliver the core's events until it ends. Whatever ends this thread ends the
        engine with a reason: a reader that stopped quietly would leave every stream
        waiting for events that never come while the health check stays green."""
        while True:
            try:
                events = decode_events(self._conn.recv_bytes())
            except (EOFError, OSError) as e:
                reason = f"the engine process exited (exit code {{}}; {type(e).__name__})"
                self._report_death(loop, on_dead, reason)
                return
            except BaseException as e:  # a message that cannot be read: the stream is lost
                self.kill(f"the engine's events could not be read: {type(e).__name__}: {e}")
                self._report_death(loop, on_dead, "")
                logger.exception("the engine core's reader failed")
                return
            try:
                loop.call_soon_threadsafe(on_events, events)
            except RuntimeError:
                return  # the loop is closed: nobody is listening any more

    def _report_death(
        self, loop: asyncio.AbstractEventLoop, on_dead: DeathSink, default: str
    ) -> None:
        """Tell `on_dead` once why the core is gone (`kill`'s reason wins)."""
        if self._dead:
            return
        self._dead = True
        self.process.join(1)
        reason = self._death_reason or default.format(self.process.exitcode)
        with contextlib.suppress(RuntimeError):  # the loop is already closed
            loop.call_soon_threadsafe(on_dead, reason)

    def send(self, command: Command) -> None:
        self._outbox.put(command)

    def _send_loop(self) -> None:
        while True:
            cmd = self._outbox.get()
            if cmd is None:
                return
            batch = [cmd]
            with contextlib.suppress(queue.Empty):
                while True:
                    nxt = self._outbox.get_nowait()
                    if nxt is None:
                        self._outbox.put(None)
                        break
                    batch.append(nxt)
            try:
                self._conn.send(batch)
            except (BrokenPipeError, OSError):
                return  # the reader side reports the death
            except BaseException as e:  # e.g. a command that cannot be pickled
                # Its commands are lost, and the core would wait for them forever: end
                # the engine instead, so streams fail and the health check says so.
                logger.exception("the engine core's sender failed")
                self.kill(f"a command could not be sent to the engine: {type(e).__name__}: {e}")
                return

    def close(self, timeout: float = 30.0) -> None:
        if self.process.is_alive():
            self.send(Shutdown())
            self._outbox.put(None)
            self.process.join(timeout)
        else:
            self._outbox.put(None)
        self._kill()

    def kill(self, reason: str) -> None:
        """End the engine process now; the reader reports `reason` to `on_dead`."""
        self._death_reason = reason  # before the process ends: the reader reads it on EOF
        if self.process.is_alive():
            self.process.kill()  # no goodbye: a rank under it is gone, a step may hang
        self.process.join(5)
        self._outbox.put(None)

    def _kill(self) -> None:
        self._dead = True
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(5)
        with contextlib.suppress(OSError):
            self._conn.close()
