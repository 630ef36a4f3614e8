"""Independent simulation runs side by side: one process per run, up to one per CPU.

A run is a pure function of its inputs (simulated time only), so running several in
worker processes changes nothing but the wall time; results come back in the order
the runs were given. A single run stays in this process.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import TypeVar

J = TypeVar("J")
R = TypeVar("R")


def run_all(fn: Callable[[J], R], jobs: Sequence[J]) -> Iterator[R]:
    """`fn` of each job, in the order of `jobs`: a pool of min(runs, CPUs) worker
    processes (`fn` and the jobs picklable), or this process for one run."""
    if len(jobs) <= 1:
        yield from map(fn, jobs)
        return
    with ProcessPoolExecutor(min(len(jobs), os.cpu_count() or 1)) as pool:
        yield from pool.map(fn, jobs)
