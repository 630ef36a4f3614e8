"""The seam through which an engine runs its tensor-parallel ranks 1..N-1.

Rank 0 always lives in the engine's own process: it schedules, builds each
step's `StepInputs`, runs its shard of the model and samples. An `Executor`
owns the other ranks: it starts them so that they join the rendezvous at
`init_method` (rank 0 joins last), hands each of them every step's inputs
before rank 0 runs the step, and stops them. Local processes serve the
standalone `LLM` (engine/workers.py); Ray actors in a replica's placement
group will implement the same class in the cluster package.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING

from .config import EngineConfig

if TYPE_CHECKING:
    from .model_runner import StepInputs


class Executor(ABC):
    """Ranks 1..N-1 of one engine, mirroring rank 0's forward pass step by step."""

    @abstractmethod
    def send(self, inputs: StepInputs) -> None:
        """Hand one step's inputs to every rank (called before rank 0 runs the step)."""

    @abstractmethod
    def close(self) -> None:
        """Stop every rank; idempotent, and safe when a rank has already died."""


# Starts ranks 1..N-1 of `config` joining the group at the given init_method
# ("tcp://host:port"); the engine then joins as rank 0.
ExecutorFactory = Callable[[EngineConfig, str], Executor]
