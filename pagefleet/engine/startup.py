"""A replica's start-up as a timeline of named phases (plain data, no torch).

A `StartupTimeline` begins at a wall-clock moment (the replica process's creation)
and each `mark(phase)` ends the phase that ran since the previous mark, so the
phases are contiguous, in the order they ran, and their durations add up to the
whole start-up. Whoever runs a step of the start-up marks it: the replica (its
process, the engine process's spawn), the engine core (imports, tokenizer,
weights, the forward's compilation and warm-up) and the replica again (ready,
first request). The engine core's marks cross to the replica in `CoreReady`.

`PHASES` is the order a replica's start-up runs in; `durations()` keeps that
order, and a phase that did not run (an eager model compiles nothing) is absent.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

# The phases of a replica's start-up, in the order they run:
# process: the replica process's creation -> the deployment's constructor (the worker's
#   start, Ray's and Serve's imports, the deployment's own; a worker Ray started before it
#   was needed counts its wait too);
# engine_process: -> the engine core's child process runs (spawn, the interpreter);
# imports: the engine's modules (torch, transformers);
# tokenizer, weights (the checkpoint read, CPU GEMM weights packed, the KV cache);
# compile: the forward traced and compiled at its first size (inductor's cache or not);
# warm_up: the other warm-up sizes, CUDA graphs;
# ready: -> the replica's constructor returns (the engine's hand-shake, its metrics);
# first_request: -> the first request reaches the replica (Serve marks it running, the
#   ingress's router learns of it and picks it).
PHASES = (
    "process",
    "engine_process",
    "imports",
    "tokenizer",
    "weights",
    "compile",
    "warm_up",
    "ready",
    "first_request",
)


def process_start_time() -> float | None:
    """When this process was created, in Unix time (None where /proc cannot say)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return boot + ticks / os.sysconf("SC_CLK_TCK")


@dataclass
class StartupTimeline:
    """Phases ending at wall-clock times (`time.time()`), from `start`."""

    start: float
    marks: list[tuple[str, float]] = field(default_factory=list)

    def mark(self, phase: str, at: float | None = None) -> None:
        """End `phase` now (or at `at`): it ran since the previous mark."""
        if phase not in PHASES:
            raise ValueError(f"unknown start-up phase {phase!r}")
        self.marks.append((phase, time.time() if at is None else at))

    def extend(self, other: StartupTimeline) -> None:
        """Append `other`'s marks (a later part of the same start-up)."""
        self.marks.extend(other.marks)

    def has(self, phase: str) -> bool:
        return any(name == phase for name, _ in self.marks)

    @property
    def end(self) -> float:
        return self.marks[-1][1] if self.marks else self.start

    def durations(self) -> dict[str, float]:
        """Seconds per phase, in the order they ran."""
        out: dict[str, float] = {}
        previous = self.start
        for name, at in self.marks:
            out[name] = max(0.0, at - previous)
            previous = at
        return out

    def summary(self) -> str:
        """One log line: each phase's seconds and the total."""
        parts = ", ".join(f"{name} {s:.2f} s" for name, s in self.durations().items())
        return f"{parts}; {self.end - self.start:.2f} s in all"
