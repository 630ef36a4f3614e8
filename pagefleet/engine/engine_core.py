"""The engine core loop: commands in, one `CoreEvents` per iteration out.

`EngineCore` owns one `LLMEngine` and is the only code that touches it. It is
driven by `run(inbox, emit)`, the same loop whether it lives in a thread of
the caller's process or in a process of its own (`core_host.py`):

1. take every command waiting in the inbox (block only when there is no work);
2. apply them: aborts first, then adds; an add that fails is rejected alone,
   whatever it raised, so one bad request never stops the loop;
3. run one engine step if anything is unfinished; a step that raises fails
   only the requests scheduled in it (`StepFailedError`: the engine already
   aborted them, so the block pool balances); waiting requests stay queued
   and the loop goes on. An engine that cannot step again
   (`EngineBrokenError`: tensor-parallel ranks out of step) fails every
   request, emits that, and ends the loop by raising, so that its host
   reports the core dead and it is rebuilt;
4. emit what happened: accepted and rejected adds, the step's outputs,
   failed requests, answers to queries, and a stats snapshot (at most every
   `stats_interval_s`, and always when the engine goes idle).

The commands and events are `core_messages.py`'s (torch-free, so that a caller
whose core runs in a process of its own never loads the engine proper).
"""

from __future__ import annotations

import contextlib
import logging
import time
import traceback
from collections.abc import Callable, Sequence

from .core_messages import (
    AbortRequests,
    AddRequest,
    Command,
    CoreEvents,
    CoreReady,
    Inbox,
    Query,
    Reply,
    RequestError,
    Shutdown,
)
from .errors import (
    EngineBrokenError,
    InvalidRequestError,
    RequestFailedError,
    StepFailedError,
    request_error_name,
)
from .llm_engine import LLMEngine, PromptType
from .tracing import CoreTracer

logger = logging.getLogger("pagefleet.engine")


# -- the loop -------------------------------------------------------------------------


def _given_as_ids(prompt: PromptType) -> bool:
    return isinstance(prompt, list) or (isinstance(prompt, dict) and "prompt_token_ids" in prompt)


def describe_error(request_id: str, exc: BaseException) -> RequestError:
    name = request_error_name(exc)
    message = str(exc) if name != RequestFailedError.__name__ else f"{type(exc).__name__}: {exc}"
    return RequestError(request_id, name, message)


class EngineCore:
    def __init__(
        self,
        engine: LLMEngine,
        stats_interval_s: float = 0.25,
        tracer: CoreTracer | None = None,
    ) -> None:
        """`tracer`: emits the core's span of each request added with trace headers."""
        self.engine = engine
        self.tracer = tracer
        self._stats_interval_s = stats_interval_s
        self._last_stats = 0.0

    def ready(self) -> CoreReady:
        cap = self.engine.capacity
        return CoreReady(
            max_model_len=cap.max_model_len,
            vocab_size=self.engine.vocab_size,
            block_size=cap.block_size,
            num_kv_blocks=cap.num_kv_blocks,
            max_num_seqs=self.engine.config.max_num_seqs,
            stats=self.engine.stats(),
            compile_seconds=self.engine.token_engine.compile_seconds,
            startup=self.engine.startup,
        )

    def run(self, inbox: Inbox, emit: Callable[[CoreEvents], None]) -> None:
        """Serve commands until `Shutdown`; see the module docstring."""
        while True:
            commands = inbox.get(block=not self.engine.has_unfinished_requests())
            events = CoreEvents()
            stop = self.apply(commands, events)
            broken = None
            if not stop:
                broken = self.step(events)
            if events:
                emit(events)
            if broken is not None:
                raise broken
            if stop:
                return

    def apply(self, commands: list[Command], events: CoreEvents) -> bool:
        """Apply commands in order; returns True on `Shutdown`."""
        for cmd in commands:
            if isinstance(cmd, AbortRequests):
                self.engine.abort_request(cmd.request_ids)
                self._untrace(cmd.request_ids)
            elif isinstance(cmd, AddRequest):
                try:
                    ids = self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params)
                except Exception as e:  # any failure stays with its request
                    with contextlib.suppress(Exception):
                        self.engine.abort_request(cmd.request_id)
                    events.rejected.append(describe_error(cmd.request_id, e))
                else:
                    events.accepted.append(cmd.request_id)
                    if self.tracer is not None:
                        self.tracer.added(cmd.request_id, cmd.trace_headers, cmd.params, len(ids))
                    if not _given_as_ids(cmd.prompt):
                        events.prompt_token_ids[cmd.request_id] = ids
            elif isinstance(cmd, Query):
                events.replies[cmd.query_id] = self._answer(cmd.name)
            elif isinstance(cmd, Shutdown):
                return True
        return False

    def _answer(self, name: str) -> Reply:
        if name == "stats":
            return self.engine.stats()
        if name == "check_accounting":
            try:
                self.engine.check_block_accounting()
            except AssertionError as e:
                return str(e) or "block accounting does not balance"
            return None
        return f"unknown query {name!r}"

    def step(self, events: CoreEvents) -> EngineBrokenError | None:
        """One engine step into `events`; returns the error if the engine can step no more."""
        broken = None
        if self.engine.has_unfinished_requests():
            try:
                events.outputs = self.engine.step_deltas()
            except StepFailedError as e:
                cause = e.__cause__
                if isinstance(cause, InvalidRequestError):
                    # The request's own input, found bad only once the engine had it (a
                    # grammar refused when compiled against the vocabulary): not a bug.
                    name, message = InvalidRequestError.__name__, str(cause)
                else:
                    logger.error("engine step failed:\n%s", traceback.format_exc())
                    name, message = RequestFailedError.__name__, str(e)
                events.failed.extend(RequestError(rid, name, message) for rid in e.request_ids)
            except EngineBrokenError as e:
                logger.error("engine broken:\n%s", traceback.format_exc())
                self._fail_all(e, events, e.request_ids)
                broken = e
            except Exception as e:
                # Not contained by the engine (a bug outside its step handling): the
                # state of every request is unknown, so all of them end.
                logger.error("engine step failed:\n%s", traceback.format_exc())
                self._fail_all(e, events)
        if self.tracer is not None:
            for out in events.outputs:
                self.tracer.output(out)
        self._untrace([e.request_id for e in events.failed])
        now = time.monotonic()
        idle = not self.engine.has_unfinished_requests()
        if idle or now - self._last_stats >= self._stats_interval_s:
            # Light: the prefix digest (up to 256 KiB) goes only to explicit queries.
            events.stats = self.engine.stats(with_prefix=False)
            self._last_stats = now
        return broken

    def _untrace(self, request_ids: Sequence[str]) -> None:
        if self.tracer is not None and request_ids:
            self.tracer.dropped(request_ids)

    def _fail_all(self, exc: Exception, events: CoreEvents, aborted: Sequence[str] = ()) -> None:
        """End every request (so the pool balances) and report each failed,
        `aborted` (ended by the engine already) first."""
        held = self.engine.unfinished_request_ids()
        self.engine.abort_request(held)
        ids = [*aborted, *(r for r in held if r not in aborted)]
        message = f"engine step failed: {type(exc).__name__}: {exc}"
        events.failed.extend(RequestError(rid, RequestFailedError.__name__, message) for rid in ids)
