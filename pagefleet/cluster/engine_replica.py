"""The engine replica deployment: one `LLMReplica` (its engine core in a child process).

num_replicas, resources and max_ongoing_requests come from the config
(`app.build_app`). With `engine.tensor_parallel_size` N > 1 each replica is a
placement group of N bundles (`ServeConfig.placement`): the replica actor in bundle 0
(its engine core is rank 0), and ranks 1..N-1 as Ray actors it owns in the others
(`tp_ranks.py`). A lost rank kills the engine core: open requests fail with the
cause, the health check fails, and Serve replaces the replica whole.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle

from pagefleet.cluster.routing.reports import routing_stats_from_engine
from pagefleet.engine import EngineDeadError, RequestFailedError
from pagefleet.engine.startup import StartupTimeline, process_start_time

from .autoscaling import ComputeMeter, autoscaling_stats_from_engine
from .config import ServeConfig
from .replica import LLMReplica
from .replica_messages import EngineInfo, ReplicaRequest, encode_delta
from .tp_ranks import RankGroup

logger = logging.getLogger("pagefleet.cluster")

# How long a request that failed under tensor parallelism waits to learn whether a rank died.
_RANK_FAILURE_GRACE_S = 3.0


@serve.deployment
class EngineReplica:
    """The Serve face of `LLMReplica`: handle methods, health check, clean stop."""

    def __init__(self, config: dict[str, Any], hub: DeploymentHandle) -> None:
        startup = StartupTimeline(process_start_time() or time.time())
        startup.mark("process")
        cfg = ServeConfig.model_validate(config)
        ctx = serve.get_replica_context()
        replica_id = ctx.replica_id.unique_id if ctx is not None else "0"
        self._hub = hub

        async def push(replica: str, families: list[Any]) -> None:
            await self._hub.push.remote(replica, families)

        # Tensor parallelism: this actor (bundle 0) owns ranks 1..N-1 as actors in the
        # other bundles of its placement group; the engine core is rank 0 (tp_ranks.py).
        self._ranks: RankGroup | None = None
        engine_config = cfg.engine_config()
        self._max_num_seqs = engine_config.max_num_seqs
        self._compute = ComputeMeter()  # compute use between Serve's autoscaling pushes
        if engine_config.tensor_parallel_size > 1:
            res = cfg.replica_resources
            self._ranks = RankGroup(engine_config, res.num_cpus, res.num_gpus)
        try:
            self.replica = LLMReplica(
                cfg,
                replica_id,
                push_metrics=push,
                executor_factory=self._ranks.executor_factory if self._ranks else None,
                start_abort=self._ranks.failure if self._ranks else None,
                startup=startup,
            )
        except BaseException:
            if self._ranks is not None:
                self._ranks.close()
            raise
        if self._ranks is not None:
            # A lost rank ends the engine now: open streams fail with the reason, the
            # health check fails, and Serve replaces this replica (its ranks with it).
            self._ranks.on_failure(self.replica.engine.kill)
        # Its metrics reach the hub from a task of its own, started with the replica.
        self.replica.start_pusher()

    async def info(self) -> EngineInfo:
        return await self.replica.info()

    async def generate(self, request: ReplicaRequest) -> AsyncIterator[bytes]:
        """The replica's deltas, each as msgpack bytes (`replica_messages.encode_delta`)."""
        try:
            async for delta in self.replica.generate(request):
                yield encode_delta(delta)
        except (RequestFailedError, EngineDeadError) as e:
            if self._ranks is None:
                raise
            # A rank that dies mid-step shows in rank 0 first as a failed collective
            # (gloo sees the socket close); the cause reaches the rank watcher through
            # Ray a moment later. Name the cause when there is one.
            cause = await self._ranks.wait_failure(_RANK_FAILURE_GRACE_S)
            if cause is None:
                raise
            raise EngineDeadError(cause) from e

    async def check_block_accounting(self) -> dict[str, Any]:
        return await self.replica.check_block_accounting()

    async def record_routing_stats(self) -> dict[str, Any]:
        """What the router ranks on (Serve polls it every routing_stats_period_s)."""
        stats = await self.replica.engine.fetch_stats()  # fresh, with the prefix digest
        return routing_stats_from_engine(stats, time.time())

    def record_autoscaling_stats(self) -> dict[str, float]:
        stats = self.replica.engine.stats()
        compute = self._compute.read(stats.busy_budget_seconds, time.monotonic())
        return autoscaling_stats_from_engine(stats, self._max_num_seqs, compute)

    async def check_health(self) -> None:
        self.replica.check_health()  # a dead engine core: Serve replaces this replica

    async def __del__(self) -> None:
        if self._ranks is not None:
            self._ranks.stopping()  # the engine's stop ends them: not a failure
        await self.replica.shutdown()
        if self._ranks is not None:
            self._ranks.close()
        try:  # leave /metrics now, not when the hub finds the snapshot stale
            await self._hub.drop.remote(self.replica.replica_id)
        except Exception:
            logger.warning("could not leave the metrics hub", exc_info=True)
