"""What a failed engine step raises, and what it means for the requests in flight."""

from __future__ import annotations

from collections.abc import Sequence


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
