"""The ingress deployment: the FastAPI app of `http/`, stateless, and its way to the engines.

It validates, applies the chat template, tokenizes once, and calls the engine
replicas through a streaming `DeploymentHandle` (`ServeBackend`); the router
(`routing/serve_routers.py`) picks the replica of each call. It imports no torch: an ingress is a
light process (the layering contracts in pyproject.toml hold it to that).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle

from pagefleet.cluster.routing.scale_in import take_warm_ups
from pagefleet.engine.checkpoint import checkpoint_dir, generation_defaults

from .autoscaling import read_status, status_key
from .config import ServeConfig
from .fair_capacity import ServeCapacity
from .fleet_state import FleetState
from .http import RETRY_AFTER_S, APIError
from .http.tokenizer import load_tokenizer
from .leaving import any_offered, left_at
from .live_settings import with_user_config
from .metrics import fleet_families, replicas_reporting
from .migration import MigratingStream, handed_off, migrated_requests_counter, stream_cut
from .replica_messages import EngineInfo, ReplicaRequest, RequestDelta, decode_delta
from .response_store import ServeResponseStore

logger = logging.getLogger("pagefleet.cluster")

HEALTH_TIMEOUT_S = 5.0
# While a request waits for a replica to admit it, how often the ingress asks Serve's
# controller whether any engine replica is running at all (else: 503, not a wait).
NO_REPLICA_CHECK_S = 2.0
# How often an ingress publishes its router counters to the hub.
ROUTER_METRICS_PERIOD_S = 2.0
# How often it sends the warm-ups its routers ask for (a scale-in notice's).
WARM_UP_PERIOD_S = 0.25
# How often it looks for streams on stopping replicas whose drain is over.
HAND_OFF_PERIOD_S = 0.25


class _Watched:
    """A stream on an engine replica, handed off when the replica leaves (`_hand_off_loop`)."""

    def __init__(self, replica: str, gen: Any) -> None:
        self.replica = replica
        self.gen = gen
        self.handed_off = False


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
        self.ingress_id = self._id
        app_name = ctx.app_name if ctx is not None else None
        self._app_name = app_name
        self._status_key = status_key(app_name, engine.deployment_name)
        self._fleet_seen: tuple[float, FleetState | None] = (-1e9, None)
        self._warm_up_sender: asyncio.Task[None] | None = None
        self._migrated = migrated_requests_counter(self._id)
        self._watched: set[_Watched] = set()
        self._hand_offs: asyncio.Task[None] | None = None

    @property
    def _scales_from_zero(self) -> bool:
        scaling = self._config.autoscaling
        return scaling is not None and scaling.min_replicas == 0

    def reconfigure(self, config: ServeConfig) -> None:
        """The fleet's bounds as the ingress's `user_config` says (its metrics' target, and
        whether a request waits for a scale from zero)."""
        self._config = config

    async def info(self) -> EngineInfo:
        return await self._engine.info.remote()

    def _call(self, request: ReplicaRequest) -> Any:
        # Serve keys pending requests by the HTTP request's internal id, which every handle
        # call made while serving it inherits: the sub-requests of a multi-prompt completion
        # would collide (Serve drops all but one). Each call gets its own id.
        set_context = serve.context._set_request_context
        set_context(_internal_request_id=f"{request.request_id}-{uuid.uuid4().hex[:8]}")
        return self._stream.generate.remote(request)

    def generate(self, request: ReplicaRequest) -> AsyncIterator[RequestDelta]:
        """The request's deltas; with `migration_limit` > 0 a request whose replica is
        lost or stopped goes on on another (`migration.py`), but for a warm-up (pinned
        to its replica: elsewhere it warms nothing)."""
        if self._warm_up_sender is None and self._config.autoscaling is not None:
            # Only an autoscaled fleet gets scale-in notices, so only it has warm-ups.
            self._warm_up_sender = asyncio.ensure_future(self._send_warm_ups())
        limit = self._config.migration_limit
        if limit == 0 or request.replica is not None:
            return self._leg(request)
        if self._hand_offs is None:
            self._hand_offs = asyncio.ensure_future(self._hand_off_loop())
        return MigratingStream(request, self._leg, limit, self._count_migration).deltas()

    def _count_migration(self, reason: str) -> None:
        self._migrated.labels(ingress=self._id, reason=reason).inc()

    async def _leg(self, request: ReplicaRequest) -> AsyncIterator[RequestDelta]:
        """One replica's deltas. Until one admits the request (its first, empty delta),
        Serve holds it here. While a replica runs or is starting (scale from zero
        included) the request waits for it, within request_timeout_s; with none running
        and none coming (all gone, or the deployment failed) that wait would last until
        the time-out, so every NO_REPLICA_CHECK_S that no router offers a replica it
        asks Serve's controller (`fleet_state.py`) and answers 503 then. A stream that
        ends before the request's final delta raises `stream_cut()`; one cut because
        its replica is leaving (`_hand_off_loop`) raises `handed_off()`."""
        gen = contextvars.copy_context().run(self._call, request)
        finished = False
        watched: _Watched | None = None
        try:
            first = asyncio.ensure_future(gen.__anext__())
            try:
                while not (await asyncio.wait({first}, timeout=NO_REPLICA_CHECK_S))[0]:
                    if any_offered():
                        continue  # a running replica takes it when it has room
                    fleet = await self.fleet_state()
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
                delta = decode_delta(first.result())
            except StopAsyncIteration:
                raise stream_cut() from None
            finished = delta.finished
            watched = self._watch(delta.replica, gen)
            yield delta
            async for data in gen:
                delta = decode_delta(data)
                finished = finished or delta.finished
                yield delta
            if not finished:
                raise stream_cut()
        except Exception:
            if watched is not None and watched.handed_off:
                raise handed_off() from None
            raise
        finally:
            if watched is not None:
                self._watched.discard(watched)
            if not finished:
                gen.cancel()  # the client left: the replica aborts the engine request

    def _watch(self, replica: str | None, gen: Any) -> _Watched | None:
        """Watch a migrating request's stream on `replica` for the replica's leaving."""
        if replica is None or self._config.migration_limit == 0:
            return None
        watched = _Watched(replica, gen)
        self._watched.add(watched)
        return watched

    async def _hand_off_loop(self) -> None:
        """Forever: cut the streams whose replica stopped being offered (a scale-in, a
        redeploy) `migration_drain_s` ago; each goes on elsewhere (`migration.py`), and
        the replica, its requests aborted, ends its drain."""
        while True:
            await asyncio.sleep(HAND_OFF_PERIOD_S)
            drain, now = self._config.migration_drain_s, time.monotonic()
            for watched in list(self._watched):
                left = left_at(watched.replica)
                if left is not None and now - left >= drain and not watched.handed_off:
                    watched.handed_off = True
                    watched.gen.cancel()

    async def _send_warm_ups(self) -> None:
        """Forever: the warm-ups this process's routers planned on a scale-in notice
        (`routing.scale_in.take_warm_ups`), each sent like a request (the router pins it to
        its replica) and read to its end; a failed one is only logged."""
        running: set[asyncio.Future[None]] = set()  # referenced until done
        while True:
            for request in take_warm_ups():
                task = asyncio.ensure_future(self._warm_up(request))
                running.add(task)
                task.add_done_callback(running.discard)
            await asyncio.sleep(WARM_UP_PERIOD_S)

    async def _warm_up(self, request: ReplicaRequest) -> None:
        try:
            async for _ in self.generate(request):
                pass
        except Exception:
            logger.warning("warm-up %s failed", request.request_id, exc_info=True)

    async def fleet_state(self) -> FleetState | None:
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
                    status.compute_utilization,
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
        fleet = await self.fleet_state()
        return fleet is not None and fleet.healthy(self._scales_from_zero)


@serve.deployment(ray_actor_options={"num_cpus": 0})
@serve.ingress()
class Ingress:
    def __init__(
        self,
        config: dict[str, Any],
        engine: DeploymentHandle,
        hub: DeploymentHandle,
        responses: DeploymentHandle,
    ) -> None:
        self.config = ServeConfig.model_validate(config)
        self._args = self.config  # the application's args; user_config applies over them
        folder = checkpoint_dir(self.config.model, self.config.engine.revision)
        self.tokenizer = load_tokenizer(self.config.engine.tokenizer or folder)
        self._sampling_defaults = generation_defaults(folder, self.config.engine.generation_config)
        self.backend = ServeBackend(engine, hub, self.config)
        self._fair_capacity = ServeCapacity(self.config, self.backend.fleet_state)
        self.responses = ServeResponseStore(responses)
        self._app: Any = None
        # The router counters reach the hub from a task of their own, started with the
        # ingress (the other ingresses' scrapes read them there).
        self._pusher = asyncio.get_running_loop().create_task(self._push_loop())

    async def _push_loop(self) -> None:
        while True:
            await asyncio.sleep(ROUTER_METRICS_PERIOD_S)
            try:
                await self.backend.push_own_metrics()
            except Exception:  # the hub restarts with Serve; keep serving meanwhile
                logger.warning("could not push router metrics", exc_info=True)

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Serve's `user_config` (the config's live keys, `live_settings.LIVE_KEYS`, and the
        fleet's bounds), applied in place over the application's args: Serve calls this
        at start and again on each change of it alone, restarting nothing. An invalid one
        raises, naming the key, and Serve reports the deployment's update as failed."""
        config = with_user_config(self._args, user_config)
        self.config = config
        self.backend.reconfigure(config)
        self._fair_capacity.reconfigure(config)
        if self._app is not None:
            self._apply(self._app)

    def _apply(self, app: Any) -> None:
        from .http import reconfigure

        reconfigure(
            app,
            self.config.limits,
            api_key=self.config.resolved_api_key(),
            protect_metrics=self.config.protect_metrics,
            request_timeout_s=self.config.request_timeout_s,
        )

    def __serve_build_asgi_app__(self) -> Any:
        from .http import create_app

        self._app = create_app(
            self.backend,
            self.tokenizer,
            self.config.model_name,
            sampling_defaults=self._sampling_defaults,
            chat_settings=self.config.chat_settings(),
            response_store=self.responses,
            ingress_id=self.backend.ingress_id,
            request_log=self.config.observability.request_log,
            otlp_traces_endpoint=self.config.observability.otlp_traces_endpoint,
            priority_scheduling=self.config.engine.scheduling_policy == "priority",
            fairness=self.config.fairness,
            fair_capacity=self._fair_capacity,
        )
        self._apply(self._app)
        return self._app
