"""Tensor-parallel ranks 1..N-1: the loop every rank runs, and local worker processes.

Rank 0 lives in the engine's own process: it schedules, prepares each step's
`StepInputs`, posts them, runs its shard of the model and samples. Ranks
1..N-1 only mirror the forward pass (`run_rank`): join the group, build their
shard, say they are ready, then run every step rank 0 posts until it posts
the stop. A step arrives as bytes already authenticated by `next_step`, and
`step_codec` decodes them (nothing is unpickled). The loop does not care who
started it: `LocalProcessExecutor` spawns it in local processes (the
standalone `LLM`), the rendezvous and its secret in their spawn arguments;
under Serve a replica's Ray actors run the same function.

Local workers exit when the engine closes, and on their own when the
driver's process is gone (a watchdog thread polls the parent; the store
they wait on is the driver's, so its death also ends their wait).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import threading
import time

import torch
import torch.distributed as dist

from .config import EngineConfig
from .distributed import (
    Rendezvous,
    destroy_tp,
    init_tp,
    mark_ready,
    next_step,
    open_rendezvous,
    tp_world_size,
)
from .executor import Executor, post_stop
from .parent_watch import watch_parent
from .step_codec import decode_step

logger = logging.getLogger("pagefleet.engine")


def threads_per_rank(config: EngineConfig) -> int:
    total = config.num_threads or torch.get_num_threads()
    return max(1, total // config.tensor_parallel_size)


def run_rank(config: EngineConfig, rank: int, rendezvous: Rendezvous) -> None:
    """Rank `rank` (1..N-1) of `config`'s group, from joining to rank 0's stop."""
    from .model_runner import ModelRunner
    from .models import resolve_model

    torch.set_num_threads(threads_per_rank(config))
    init_tp(rank, config.tensor_parallel_size, rendezvous, config.device, config.device_visibility)
    try:
        runner = ModelRunner(config, resolve_model(config.hf_config()).args)
        mark_ready()
        while (inputs := decode_step(next_step())) is not None:
            runner.forward(inputs)
    finally:
        destroy_tp()


class LocalProcessExecutor(Executor):
    """Ranks 1..N-1 as spawned local processes, meeting at a store this executor owns."""

    def __init__(self, config: EngineConfig) -> None:
        if config.device.startswith("cuda") and config.device_visibility != "shared":
            # Spawned processes inherit this one's GPUs: they can only share its view.
            raise ValueError("local worker processes need device_visibility 'shared'")
        ctx = mp.get_context("spawn")
        world = config.tensor_parallel_size
        self._store: dist.TCPStore | None
        self._store, self.rendezvous = open_rendezvous("127.0.0.1", world)
        self.processes = [
            ctx.Process(
                target=worker_main,
                args=(config, rank, self.rendezvous, os.getpid()),
                name=f"pagefleet-tp-{rank}",
                daemon=True,
            )
            for rank in range(1, world)
        ]
        for p in self.processes:
            p.start()
        self._closed = False

    def failure(self) -> str | None:
        for rank, p in enumerate(self.processes, start=1):
            if p.exitcode is not None:
                return f"tensor-parallel rank {rank} exited (exit code {p.exitcode})"
        return None

    def close(self, timeout: float = 30.0) -> None:
        if self._closed:
            return
        self._closed = True
        # Not joined (rank 0 failed to start): the workers wait in the rendezvous and
        # cannot be told anything; end them at once.
        # Out of step: they wait in a collective of a step rank 0 abandoned and cannot
        # be told anything either.
        reachable = tp_world_size() > 1 and not self.out_of_step
        if reachable and self.failure() is None:
            try:
                post_stop()
            except Exception:  # a dead worker: fall through to terminate
                logger.exception("could not tell tensor-parallel workers to stop")
        deadline = time.monotonic() + (timeout if reachable else 0.0)
        for p in self.processes:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.terminate()
                p.join(5)
        self._store = None  # after the workers: they wait on it until told to stop


def worker_main(config: EngineConfig, rank: int, rendezvous: Rendezvous, parent_pid: int) -> None:
    threading.Thread(target=watch_parent, args=(parent_pid,), daemon=True).start()
    run_rank(config, rank, rendezvous)
