"""The Ray Serve application: `build_app(args)` for `serve run` / `serve deploy`.

Three deployments, as Ray Serve LLM lays them out:

- `Ingress` (stateless, `@serve.ingress`): the FastAPI app of `api.py`. It
  validates, applies the chat template, tokenizes once, and calls the engine
  replicas through a streaming `DeploymentHandle`.
- `EngineReplica`: one `LLMReplica` each (its engine core in a child process).
  num_replicas, resources and max_ongoing_requests come from the config. With
  `engine.tensor_parallel_size` N > 1 each replica is a placement group of N
  bundles (`ServeConfig.placement`): the replica actor in bundle 0 (its engine
  core is rank 0), and ranks 1..N-1 as Ray actors it owns in the others
  (`tp_ranks.py`). A lost rank kills the engine core: open requests fail with
  the cause, the health check fails, and Serve replaces the replica whole.

Overload is bounded at every hop, and each bound answers 429 (OpenAI's body,
Retry-After) rather than letting a request wait without end: an engine holds
at most `max_waiting_requests` requests not yet scheduled (beyond it its core
rejects new ones); Serve sends a replica at most max_num_seqs +
max_waiting_requests (`max_ongoing_requests`), so it routes around a full
replica; when every replica is full, each ingress holds at most
`max_queued_requests` (Serve's BackPressureError beyond it). The ingress's own
limits sit above all of that, so the proxy's plain 429 is a last resort.
- `MetricsHub`: the replicas push their metric families to it; the ingress's
  `/metrics` exposes them all (one scrape target for the fleet).

    applications:
      - name: pagefleet
        import_path: pagefleet.cluster.app:build_app
        args: {model: /models/tiny, replicas: 2, engine: {dtype: float32}}
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from pydantic import SecretStr
from ray import serve
from ray.serve.config import BackpressureConfig
from ray.serve.handle import DeploymentHandle

from pagefleet.engine.errors import EngineDeadError, RequestFailedError

from .api import RETRY_AFTER_S, APIError
from .autoscaling import (
    autoscaling_stats_from_engine,
    read_status,
    serve_autoscaling_config,
    status_key,
)
from .config import ServeConfig, parse_config
from .fleet_state import FleetState
from .messages import EngineRequest, RequestDelta
from .metrics import MetricsHub, fleet_families, replicas_reporting
from .replica import EngineInfo, LLMReplica
from .router import request_router_config
from .routing import routing_stats_from_engine
from .tp_ranks import RankGroup

logger = logging.getLogger("pagefleet.cluster")

HEALTH_TIMEOUT_S = 5.0
# While a request waits for a replica to admit it, how often the ingress asks Serve's
# controller whether any engine replica is running at all (else: 503, not a wait).
NO_REPLICA_CHECK_S = 2.0
INGRESS_HEADROOM = 64
# How long a request that failed under tensor parallelism waits to learn whether a rank died.
_RANK_FAILURE_GRACE_S = 3.0


@serve.deployment(ray_actor_options={"num_cpus": 0}, num_replicas=1, max_ongoing_requests=1000)
class MetricsHubDeployment(MetricsHub):
    pass


@serve.deployment
class EngineReplica:
    """The Serve face of `LLMReplica`: handle methods, health check, clean stop."""

    def __init__(self, config: dict[str, Any], hub: DeploymentHandle) -> None:
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
            )
        except BaseException:
            if self._ranks is not None:
                self._ranks.close()
            raise
        if self._ranks is not None:
            # A lost rank ends the engine now: open streams fail with the reason, the
            # health check fails, and Serve replaces this replica (its ranks with it).
            self._ranks.on_failure(self.replica.engine.kill)

    async def info(self) -> EngineInfo:
        return await self.replica.info()

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestDelta]:
        try:
            async for delta in self.replica.generate(request):
                yield delta
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
        return autoscaling_stats_from_engine(self.replica.engine.stats())

    async def check_health(self) -> None:
        self.replica.check_health()  # a dead engine core: Serve replaces this replica
        self.replica._start_pusher()

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


class ServeBackend:
    """`api.EngineBackend` over the replica deployment's handle."""

    def __init__(
        self, engine: DeploymentHandle, hub: DeploymentHandle, config: ServeConfig
    ) -> None:
        self._engine = engine
        self._stream = engine.options(stream=True)
        self._hub = hub
        self._config = config
        ctx = serve.get_replica_context()
        self._id = f"ingress-{ctx.replica_id.unique_id if ctx is not None else 0}"
        app_name = ctx.app_name if ctx is not None else None
        self._app_name = app_name
        self._status_key = status_key(app_name, engine.deployment_name)
        self._fleet_seen: tuple[float, FleetState | None] = (-1e9, None)
        scaling = config.autoscaling
        self._scales_from_zero = scaling is not None and scaling.min_replicas == 0

    async def info(self) -> EngineInfo:
        return await self._engine.info.remote()

    def _call(self, request: EngineRequest) -> Any:
        # Serve keys pending requests by the HTTP request's internal id, which every handle
        # call made while serving it inherits: the sub-requests of a multi-prompt completion
        # would collide (Serve drops all but one). Each call gets its own id.
        set_context = serve.context._set_request_context
        set_context(_internal_request_id=f"{request.request_id}-{uuid.uuid4().hex[:8]}")
        return self._stream.generate.remote(request)

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestDelta]:
        """The replica's deltas. Until one admits the request (its first, empty delta),
        Serve holds it here. While a replica runs or is starting (scale from zero
        included) the request waits for it, within request_timeout_s; with none running
        and none coming (all gone, or the deployment failed) that wait would last until
        the time-out, so every NO_REPLICA_CHECK_S it asks Serve's controller
        (`fleet_state.py`) and answers 503 then."""
        gen = contextvars.copy_context().run(self._call, request)
        finished = False
        try:
            first = asyncio.ensure_future(gen.__anext__())
            try:
                while not (await asyncio.wait({first}, timeout=NO_REPLICA_CHECK_S))[0]:
                    fleet = await self._fleet_state()
                    if fleet is not None and not fleet.may_wait(self._scales_from_zero):
                        raise APIError(
                            503,
                            "no engine replica is running or starting "
                            f"({fleet.status.lower()}); retry after {RETRY_AFTER_S} s",
                            headers={"Retry-After": str(RETRY_AFTER_S)},
                        )
            finally:
                if not first.done():
                    first.cancel()
            try:
                delta = first.result()
            except StopAsyncIteration:
                return
            finished = delta.finished
            yield delta
            async for delta in gen:
                finished = finished or delta.finished
                yield delta
        finally:
            if not finished:
                gen.cancel()  # the client left: the replica aborts the engine request

    async def _fleet_state(self) -> FleetState | None:
        """The engine deployment as Serve's controller sees it (cached for a second
        across requests); None when the controller cannot say."""
        checked, fleet = self._fleet_seen
        if time.monotonic() - checked < 1.0:
            return fleet
        try:
            status = await asyncio.wait_for(asyncio.to_thread(serve.status), HEALTH_TIMEOUT_S)
            fleet = FleetState.from_serve_status(
                status, self._app_name or "default", self._engine.deployment_name
            )
        except Exception:
            logger.warning("could not read the engine replicas' state", exc_info=True)
            fleet = None
        self._fleet_seen = (time.monotonic(), fleet)
        return fleet

    def _own_families(self) -> list[Any]:
        """This ingress's router counters (`pagefleet:` families of its default registry)."""
        from prometheus_client import REGISTRY

        return [f for f in REGISTRY.collect() if f.name.startswith("pagefleet:")]

    async def push_own_metrics(self) -> None:
        """Publish the router counters for the other ingress replicas' scrapes."""
        families = self._own_families()
        if families:
            await self._hub.push.remote(self._id, families)

    async def metric_snapshots(self) -> list[list[Any]]:
        # Every ingress answers from the hub's one copy, ours pushed first: were our own
        # counters read fresh here and another ingress's from its last push, two scrapes
        # served by different ingresses could see a counter go down.
        await self.push_own_metrics()
        snapshots = await self._hub.snapshots.remote()
        return [*snapshots, await self._fleet_families(snapshots)]

    async def _fleet_families(self, snapshots: list[list[Any]]) -> list[Any]:
        """Replicas against the target: the autoscaler's last status, or the fixed count."""
        if self._config.autoscaling is not None:
            # A GCS read (Ray's key-value store), off the event loop.
            status = await asyncio.to_thread(read_status, self._status_key)
            if status is not None:
                return fleet_families(
                    self._config.model_name,
                    status.replicas,
                    status.target_replicas,
                    status.kv_utilization,
                )
        target = self._config.replicas
        if self._config.autoscaling is not None:
            target = (
                self._config.autoscaling.initial_replicas or self._config.autoscaling.min_replicas
            )
        return fleet_families(self._config.model_name, replicas_reporting(snapshots), target, None)

    async def healthy(self) -> bool:
        """From the controller, never through a replica's queue (fleet_state.py): a
        health check must not wait behind generation, or it fails when the fleet is
        busiest and a load balancer pulls the busy pod."""
        fleet = await self._fleet_state()
        return fleet is not None and fleet.healthy(self._scales_from_zero)


@serve.deployment(ray_actor_options={"num_cpus": 0})
@serve.ingress()
class Ingress:
    def __init__(
        self, config: dict[str, Any], engine: DeploymentHandle, hub: DeploymentHandle
    ) -> None:
        from transformers import AutoTokenizer

        self.config = ServeConfig.model_validate(config)
        tok_path = self.config.engine.tokenizer or self.config.model
        self.tokenizer = AutoTokenizer.from_pretrained(tok_path)
        self.backend = ServeBackend(engine, hub, self.config)

    async def check_health(self) -> None:
        # Serve calls this every few seconds: a natural beat to publish the router counters.
        try:
            await self.backend.push_own_metrics()
        except Exception:
            logger.warning("could not push router metrics", exc_info=True)

    def __serve_build_asgi_app__(self) -> Any:
        from .api import create_app

        return create_app(
            self.backend,
            self.tokenizer,
            self.config.model_name,
            self.config.limits,
            api_key=self.config.resolved_api_key(),
            protect_metrics=self.config.protect_metrics,
            request_timeout_s=self.config.request_timeout_s,
        )


def build_app(args: dict[str, Any]) -> Any:
    """The application for `serve run` / `serve deploy` (args: pagefleet's config)."""
    config = parse_config(dict(args))
    if config.api_key is None and (key := config.resolved_api_key()):
        # Read here, where `pagefleet serve` or `serve deploy` runs, and carried as a
        # SecretStr: the replicas' environment need not have it, and no repr shows it.
        config = config.model_copy(update={"api_key": SecretStr(key)})
    if config.make_model and not os.path.isdir(config.model):
        from .make_model import make_model

        make_model(config.model, preset=config.make_model)
    as_dict = config.model_dump()
    hub = MetricsHubDeployment.bind()
    scaling: dict[str, Any] = {"num_replicas": config.replicas}
    if config.autoscaling is not None:
        scaling = {
            "num_replicas": "auto",
            "autoscaling_config": serve_autoscaling_config(config.autoscaling.policy_config()),
        }
    engine = EngineReplica.options(
        **scaling,
        request_router_config=request_router_config(
            config.routing, stats_period_s=config.routing_stats_period_s
        ),
        max_ongoing_requests=config.replica_max_ongoing_requests,
        max_queued_requests=config.ingress_max_queued_requests,
        backpressure_config=BackpressureConfig(status_code=429, retry_after_s=RETRY_AFTER_S),
        # Under tensor parallelism each rank is one placement-group bundle; the replica
        # actor (whose engine core is rank 0) takes bundle 0, so it asks for one bundle.
        ray_actor_options={
            "num_cpus": config.replica_resources.num_cpus,
            "num_gpus": config.replica_resources.num_gpus,
        },
        **config.placement(),
        health_check_period_s=2,
        health_check_timeout_s=30,
        # Scale-in drains: Serve stops routing to the replica and waits for its requests,
        # as long as an accepted request may take (request_timeout_s), then `__del__`
        # shuts the engine down, which ends what is left with an error delta (never a
        # silently cut stream). A replica with nothing left stops at once.
        graceful_shutdown_timeout_s=config.drain_s,
        graceful_shutdown_wait_loop_s=0.5,
    ).bind(as_dict, hub)
    # Serve's default max_ongoing_requests (5) would cap the whole fleet at 5 requests in
    # flight per ingress replica: it streams for every engine replica behind it. Its room is
    # the fleet's, plus the queue in front of it, plus headroom for what never reaches an
    # engine (requests being refused, scrapes, tokenize): so the engines' and the queue's
    # 429s (OpenAI's body) come before the proxy's own.
    fleet_capacity = config.replica_max_ongoing_requests * max(
        config.replicas, config.autoscaling.max_replicas if config.autoscaling else 0
    )
    return Ingress.options(
        num_replicas=config.ingress_replicas,
        max_ongoing_requests=fleet_capacity + config.ingress_max_queued_requests + INGRESS_HEADROOM,
        # Serve counts a request as queued while it is being routed, so simultaneous
        # arrivals at the proxy see each other "queued": a small bound here would refuse
        # them with the ingress idle. This queue only fills once the ingress is full.
        max_queued_requests=max(INGRESS_HEADROOM, config.ingress_max_queued_requests),
        backpressure_config=BackpressureConfig(status_code=429, retry_after_s=RETRY_AFTER_S),
        # Every stream passes through an ingress replica: one being replaced (a redeploy,
        # a scale change of the ingress) drains as the engine replicas do.
        graceful_shutdown_timeout_s=config.drain_s,
        graceful_shutdown_wait_loop_s=0.5,
    ).bind(as_dict, engine, hub)
