"""The seam through which an engine runs its tensor-parallel ranks 1..N-1.

Rank 0 always lives in the engine's own process: it schedules, builds each
step's `StepInputs`, runs its shard of the model and samples. An `Executor`
stands for the other ranks: it knows where they meet (`rendezvous`, a
TCPStore master that is already listening, and the group's secret), hands
each of them every step's inputs before rank 0 runs the step (encoded by
`step_codec`, authenticated by `distributed.post_step`), and stops them.

Two kinds, one interface:

- `LocalProcessExecutor` (pagefleet/engine/workers.py) starts the ranks itself, as
  spawned processes of the engine's process, and owns the store (the
  standalone `LLM`).
- `AttachedExecutor` only talks to ranks that someone else started and owns
  (under Serve: the replica actor, whose rank actors sit in its placement
  group, and which also owns the store). It broadcasts steps and the stop
  signal; it starts, watches and kills nothing. `AttachedRanks` is its
  picklable factory: it crosses into the engine's process with the
  rendezvous (and so the secret) in it, through the engine process's spawn
  arguments.

An `ExecutorFactory` is called with the engine's config once the engine has
checked that the model splits over the ranks; rank 0 then joins the group at
the executor's `rendezvous`.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .config import EngineConfig
from .distributed import Rendezvous, post_step, tp_world_size
from .step_codec import encode_step

if TYPE_CHECKING:
    from .model_runner import StepInputs

logger = logging.getLogger("pagefleet.engine")


class Executor(ABC):
    """Ranks 1..N-1 of one engine, mirroring rank 0's forward pass step by step."""

    rendezvous: Rendezvous
    """Where rank 0 joins the group (the ranks are already on their way there)."""

    out_of_step: bool = False
    """Set by the engine once rank 0 failed inside a step the ranks had started
    (`RanksOutOfStepError`): they sit in that step's collectives, so `close` must
    not post them a stop, which would pair with one of those collectives."""

    def send(self, inputs: StepInputs) -> None:
        """Hand one step's inputs to every rank (called before rank 0 runs the step)."""
        post_step(encode_step(inputs))

    @abstractmethod
    def close(self) -> None:
        """Stop every rank; idempotent, and safe when a rank has already died."""

    def failure(self) -> str | None:
        """Why a rank is already gone, if this executor can tell (ends start-up waits)."""
        return None


ExecutorFactory = Callable[[EngineConfig], Executor]


def post_stop() -> None:
    """Rank 0: tell every other rank to leave its step loop."""
    post_step(encode_step(None))


class AttachedExecutor(Executor):
    """Ranks started and owned by someone else: this side only sends steps and the stop.

    Their owner watches them (a dead rank is its to report); a stop that
    cannot be delivered because a rank is gone is logged, not raised.
    """

    def __init__(self, rendezvous: Rendezvous) -> None:
        self.rendezvous = rendezvous
        self._closed = False

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if tp_world_size() == 1 or self.out_of_step:
            # Rank 0 never joined, or the ranks are stuck in a step: their owner ends them.
            return
        try:
            post_stop()
        except Exception:  # a rank is gone: its owner stops the rest
            logger.exception("could not tell the tensor-parallel ranks to stop")


@dataclass(frozen=True)
class AttachedRanks:
    """A picklable `ExecutorFactory` for ranks already started at `rendezvous`."""

    rendezvous: Rendezvous

    def __call__(self, config: EngineConfig) -> Executor:
        return AttachedExecutor(self.rendezvous)
