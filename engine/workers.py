"""Tensor-parallel worker processes for a standalone engine.

Rank 0 lives in the engine's own process: it schedules, prepares each step's
`StepInputs`, broadcasts them, runs its shard of the model and samples. Ranks
1..N-1 are spawned processes that only mirror the forward pass; the whole
interface between driver and worker is one broadcast per step (None to
stop), the same interface an `Executor` of Ray actors implements.

Workers exit when the engine closes, and on their own when the driver's
process is gone (a watchdog thread polls the parent).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import threading
import time
from typing import TYPE_CHECKING

import torch

from .config import EngineConfig
from .distributed import broadcast_object, destroy_tp, init_tp
from .executor import Executor

if TYPE_CHECKING:
    from .model_runner import StepInputs

logger = logging.getLogger("pagefleet.engine")


def threads_per_rank(config: EngineConfig) -> int:
    total = config.num_threads or torch.get_num_threads()
    return max(1, total // config.tensor_parallel_size)


class LocalProcessExecutor(Executor):
    """Ranks 1..N-1 as spawned local processes, started before rank 0 joins the group."""

    def __init__(self, config: EngineConfig, init_method: str) -> None:
        ctx = mp.get_context("spawn")
        world = config.tensor_parallel_size
        self.processes = [
            ctx.Process(
                target=worker_main,
                args=(config, rank, world, init_method, os.getpid()),
                name=f"pagefleet-tp-{rank}",
                daemon=True,
            )
            for rank in range(1, world)
        ]
        for p in self.processes:
            p.start()
        self._closed = False

    def send(self, inputs: StepInputs) -> None:
        broadcast_object(inputs)

    def close(self, timeout: float = 30.0) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            broadcast_object(None)
        except Exception:  # a dead worker: fall through to terminate
            logger.exception("could not tell tensor-parallel workers to stop")
        deadline = time.monotonic() + timeout
        for p in self.processes:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.terminate()
                p.join(5)


def watch_parent(parent_pid: int) -> None:
    """Exit this process as soon as its parent is gone (polls every 0.5 s)."""
    while True:
        if os.getppid() != parent_pid:
            os._exit(0)  # the driver died: nothing left to serve
        time.sleep(0.5)


def worker_main(
    config: EngineConfig, rank: int, world: int, init_method: str, parent_pid: int
) -> None:
    from .model_runner import ModelRunner
    from .models import resolve_model

    threading.Thread(target=watch_parent, args=(parent_pid,), daemon=True).start()
    torch.set_num_threads(threads_per_rank(config))
    init_tp(rank, world, init_method, config.device)
    try:
        runner = ModelRunner(config, resolve_model(config.hf_config()).args)
        while True:
            inputs = broadcast_object()
            if inputs is None:
                break
            runner.forward(inputs)
    finally:
        destroy_tp()
