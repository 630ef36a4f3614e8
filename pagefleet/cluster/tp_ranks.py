"""Tensor-parallel ranks 1..N-1 of a Serve replica, as Ray actors in its placement group.

A replica with `engine.tensor_parallel_size: N` is deployed with N
placement-group bundles (`ServeConfig.replica_bundles`). Serve puts the
replica actor in bundle 0; its engine core, a child process, is rank 0 and
uses that bundle's GPU. The replica then owns the rest of the group
(`RankGroup`):

1. It opens the rendezvous: a TCPStore master in the replica's process, on a
   port the kernel picks, listening on the replica's node address only (rank
   actors may sit on another node when the strategy is not STRICT_PACK), and
   a fresh secret the rank actors learn only from their constructor
   arguments and the engine core from its spawn arguments (pagefleet/engine/
   distributed.py: without it a client of the store can neither join the
   group nor post a step).
2. It creates one `TensorParallelRank` actor per rank r in bundle r and calls
   its `run()`, which lasts the rank's whole life: join, load the shard, mirror
   every step, return when rank 0 posts the stop.
3. The engine core gets `executor_factory` (engine.executor.AttachedRanks):
   picklable, it only posts steps and the stop; it starts and watches nothing.
4. A watcher thread waits on the `run()` refs. One that ends while the group
   is not closing means a rank is gone (its process killed, its node lost, or
   its loop raised): `failure()` says so from then on, which ends the engine's
   start-up wait, and `on_failure` callbacks kill the engine core at once, so
   every open stream fails with that reason and the replica's health check
   fails. Serve then replaces the replica whole: the ranks are owned by the
   replica actor and live in its placement group, so they go with it.

Devices: Ray gives every actor with `num_gpus=1` its own GPU through
CUDA_VISIBLE_DEVICES, so each rank (and the replica's engine core, in bundle
0) sees exactly one GPU, `cuda:0`; the engine config carries
`device_visibility="per_rank"` to say so.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pagefleet.engine import EngineConfig

from .rank_failure import RankFailure

if TYPE_CHECKING:
    from pagefleet.engine import AttachedRanks, Rendezvous

logger = logging.getLogger("pagefleet.cluster")


@ray.remote(max_restarts=0, max_task_retries=0)
class TensorParallelRank:
    """One rank (1..N-1) of a replica's tensor-parallel group."""

    def __init__(self, config: EngineConfig, rank: int, rendezvous: Rendezvous) -> None:
        self.config = config
        self.rank = rank
        self.rendezvous = rendezvous

    def run(self) -> int:
        """The rank's whole life; returns its rank once rank 0 has told it to stop."""
        from pagefleet.engine import run_rank

        run_rank(self.config, self.rank, self.rendezvous)
        return self.rank


class RankGroup:
    """Ranks 1..N-1 of the engine in this (replica) actor, and the store they meet at."""

    def __init__(self, config: EngineConfig, num_cpus: float, num_gpus: float) -> None:
        # The engine's distributed module loads torch: imported where a group starts, not
        # where `pagefleet serve`'s driver binds the deployment that may hold one.
        from pagefleet.engine import open_rendezvous

        world = config.tensor_parallel_size
        pg = ray.util.get_current_placement_group()
        if pg is None:
            raise RuntimeError(
                f"tensor_parallel_size {world} needs the replica deployed with "
                f"{world} placement-group bundles (build_app sets placement_group_bundles)"
            )
        self._store, self.rendezvous = open_rendezvous(ray.util.get_node_ip_address(), world)
        self._failure = RankFailure()
        # The ranks' OpenMP threads wait passively, as the engine core's do (core_host.py).
        env = {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
        self.actors = [
            TensorParallelRank.options(
                num_cpus=num_cpus,
                num_gpus=num_gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=rank
                ),
                runtime_env={"env_vars": env},
            ).remote(config, rank, self.rendezvous)
            for rank in range(1, world)
        ]
        self._runs = {a.run.remote(): rank for rank, a in enumerate(self.actors, start=1)}
        self._watcher = threading.Thread(target=self._watch, name="pagefleet-tp-watch", daemon=True)
        self._watcher.start()

    @property
    def executor_factory(self) -> AttachedRanks:
        """What the engine core (rank 0) runs its other ranks through."""
        from pagefleet.engine import AttachedRanks

        return AttachedRanks(self.rendezvous)

    def failure(self) -> str | None:
        """Why the group is broken (a rank is gone), or None while every rank runs."""
        return self._failure.reason

    async def wait_failure(self, timeout_s: float) -> str | None:
        """The failure, waiting up to `timeout_s` for one to be noticed (None if none);
        any number of streams wait together, on no thread (rank_failure.py)."""
        return await self._failure.wait(timeout_s)

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Call `callback(reason)` once a rank is gone (at once if one already is)."""
        self._failure.on_failure(callback)

    def _watch(self) -> None:
        ready, _ = ray.wait(list(self._runs), num_returns=1)
        ref = ready[0]
        rank = self._runs[ref]
        try:
            ray.get(ref)
            reason = f"tensor-parallel rank {rank} stopped"
        except ray.exceptions.RayActorError as e:
            reason = f"tensor-parallel rank {rank} died: {_first_line(e)}"
        except Exception as e:  # its loop raised (a collective failed, a load failed)
            cause = getattr(e, "cause", None) or e  # Ray wraps it in a RayTaskError
            reason = (
                f"tensor-parallel rank {rank} failed: {type(cause).__name__}: {_first_line(cause)}"
            )
        if self._failure.record(reason):  # not when the replica is stopping them
            logger.error("%s: the replica's engine cannot go on", reason)

    def stopping(self) -> None:
        """The engine is being stopped: ranks that end from now on are not failures."""
        self._failure.stopping()

    def close(self) -> None:
        """Kill every rank (after the engine has stopped, or instead of it); idempotent."""
        self.stopping()
        for actor in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        self._store = None


def _first_line(e: BaseException) -> str:
    """The gist of a Ray error (its str carries whole tracebacks)."""
    lines = [line for line in str(e).splitlines() if line.strip()]
    return lines[0] if lines else type(e).__name__
