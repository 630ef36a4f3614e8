"""Every error type the engine raises, in one place (and importable without torch).

Three kinds of request failure cross the engine core's process boundary, by the
name of their type (`RequestError.error`, rebuilt by `request_error`): the input is
invalid (`InvalidRequestError`), the waiting queue is full (`EngineOverloadedError`),
or the engine failed the request (`RequestFailedError`). The others say what
happened to the engine itself: a step failed (`StepFailedError`: only its requests
fail), the engine cannot step again (`EngineBrokenError`, `RanksOutOfStepError`),
its core is gone (`EngineDeadError`) or never started (`EngineStartError`). A
server maps these to HTTP statuses by type (pagefleet/cluster/http/errors.py), never by name.
"""

from __future__ import annotations

from collections.abc import Sequence


class InvalidRequestError(ValueError):
    """The request's input cannot be served (a prompt too long, a bad parameter)."""


class EngineOverloadedError(RuntimeError):
    """The engine's waiting queue is full (`EngineConfig.max_waiting_requests`): retry later."""


class RequestFailedError(RuntimeError):
    """The engine failed this request (not the caller's input)."""


class EngineDeadError(RuntimeError):
    """The engine core is gone; nothing more can be served by this engine."""


class EngineStartError(RuntimeError):
    """The engine core did not start (it failed, timed out, or its start was abandoned)."""


# What a request's failure may be once it has crossed the core's process boundary.
_REQUEST_ERRORS: dict[str, type[Exception]] = {
    cls.__name__: cls for cls in (InvalidRequestError, EngineOverloadedError, RequestFailedError)
}


def request_error_name(exc: BaseException) -> str:
    """The name a request's failure travels under (the engine's own input checks raise
    ValueError; anything else unexpected is the engine's failure, not the caller's)."""
    if isinstance(exc, EngineOverloadedError):
        return EngineOverloadedError.__name__
    if isinstance(exc, ValueError):
        return InvalidRequestError.__name__
    return RequestFailedError.__name__


def request_error(name: str, message: str) -> Exception:
    """The exception a request's failure named `name` is raised as on this side."""
    return _REQUEST_ERRORS.get(name, RequestFailedError)(message)


class StepFailedError(RuntimeError):
    """One engine step raised; only its requests fail.

    `request_ids` are the requests scheduled in the step (or touched by the
    scheduler when scheduling itself failed): they have been aborted on every
    side of the engine, so their blocks are free. Every other request is
    untouched and is served by the next step. The original exception is the
    `__cause__`.
    """

    def __init__(self, request_ids: list[str], cause: BaseException) -> None:
        super().__init__(f"engine step failed: {type(cause).__name__}: {cause}")
        self.request_ids = request_ids


class EngineBrokenError(RuntimeError):
    """The engine can serve no more steps: every request fails and it must be rebuilt.

    `request_ids` are the requests of the step that broke it, already aborted
    (like `StepFailedError`'s); the others are still held and must be failed too.
    """

    request_ids: Sequence[str] = ()


class RanksOutOfStepError(EngineBrokenError):
    """Rank 0 failed after the other tensor-parallel ranks were told to run a step.

    They are then inside the step's collectives, which rank 0 can no longer
    match one for one: any later collective would pair with the wrong one.
    """
