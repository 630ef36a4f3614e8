"""Ray Serve 2.60 request routers around the routing policy (`policy.py`, `state.py`).

Configure the engine deployment with `request_router_config(routing)`:

    routing: most_free_blocks  -> MostFreeBlocksRouter (the default)
    routing: power_of_two      -> PowerOfTwoRouter (Serve's own power-of-two choices)
    routing: round_robin       -> RoundRobinRouter
    routing: prefix_cache_affinity -> RayPrefixCacheAffinityRouter (Ray Serve LLM's
                                  PrefixCacheAffinityRouter; ray_prefix_affinity.py)

each by import path as `RequestRouterConfig(request_router_class=..., request_router_kwargs=...,
request_routing_stats_period_s=...)`.

Contract with the replica (pagefleet/cluster/replica.py). The deployment class defines

    def record_routing_stats(self) -> dict[str, Any]:
        return routing_stats_from_engine(engine_stats, time.time())

(`pagefleet.cluster.routing.reports`; keys free_blocks, total_blocks, block_size,
running, waiting: int; optional demand_blocks: int, prefix_digest: bytes,
hash_salt: int; timestamp: float, the replica's time.time() when the stats
were taken). Serve calls it every `request_routing_stats_period_s` and hands
the dict to every router as `RunningReplica.routing_stats`.

Contract with the caller (pagefleet/cluster/http/serving.py). Every call is
`handle.options(stream=True).generate.remote(request)` with one
`replica_messages.ReplicaRequest`: the router reads its `prompt_token_ids` (and `cache_salt`)
(the tokenized prompt, chat template applied) and its `params`' `max_tokens`
(0 or None: prompt only) and sample count (`best_of` if set, else `n`;
`samples_of`), for which it reserves each sample's output blocks. A call
without such a request (a health probe, `info`) is routed on load alone.

Lifecycle (`router.Router`, the calls the lab's simulator makes too). `choose_replicas`
ranks every candidate and at once reserves the request's blocks on its first choice. It cannot wait for `on_request_routed`:
Serve calls that only after the replica has answered that it accepted the
request, a round trip during which a burst's other requests are ranked, and
they would all see the same free replica. A first call offers Serve only the
best replica; when Serve calls again for the same request (that replica was
full, or its queue-length probe missed Serve's 0.1 s deadline on a busy
host), the earlier reservation is withdrawn and the whole ranking is offered,
one replica per rank. `on_request_routed` moves the reservation to the
replica that actually took the request (with its prompt's blocks, which
make that replica the prompt's owner for affinity) and counts the routing
metrics;
`on_request_completed` (any outcome) frees it. New routing stats reconcile
reservations on every choice, so a reservation whose request was cancelled
before it was routed lasts one stats period at most.

Replicas that leave. Serve calls `update_replicas` with the whole replica
set whenever it changes; a replica removed by a scale-in or a redeploy is
simply absent from it (only a replica whose probe finds its actor dead goes
through `on_replica_actor_died`). So `update_replicas` parses the live
replicas' latest reports, hands each prompt chain a leaving replica owns to a
live replica that holds it (`scale_in.hand_off_and_retain`), then forgets
every replica not in the new set: its parsed report (with a prefix digest of up
to 256 KiB), its reservations, sent prompts and remaining owned prompt blocks
(`RouterState.retain`), and its `pagefleet:routed_requests` series. The
router's state is thus bounded by the live replicas, however many come and
go.

Scale-in notice. With autoscaling on, the router reads the autoscaler's status (Ray's
key-value store, `autoscaling.read_status`, at most every NOTICE_READ_PERIOD_S, off its
loop) on its choices. When the status announces a scale-in (`leaving` replicas), the
newest replicas Serve offered are the leavers (Serve stops the newest on a node first),
and `ScaleInNotice` plans: their held chains are handed over, and each other reused
chain is warmed on a survivor. A warm-up is a `ReplicaRequest` of the chain's tokens
(remembered as the prompts were routed), one token out, with `replica` set: the
ingress sends it (`scale_in.take_warm_ups`, `ingress.ServeBackend`) through its
handle like any request, and this router sends it to that replica only. A survivor gets
one at a time, and only while it has compute to spare (`scale_in.spare_compute`:
no waiting request reported, no prompt tokens left by the router's reckoning), checked
on every choice. A warm-up's completion hands its chain over. Under the notice a leaver takes only the chains it
still owns and prompts too short to start one (`ScaleInNotice.routable`). A router whose
status reads nothing (no autoscaling) remembers no prompts.

Shared view. Each MostFreeBlocksRouter exchanges its sends and prompt owners with the
other routers of its deployment every `shared_view_period_s`, as a task on its own loop
(started by its first choice of a generation request, never awaited by one: a router
that only sends other calls, the `pagefleet serve` driver's, has nothing to share),
through the deployment's hub actor (`view_actor.RemoteView`), and merges theirs into its
state (`shared_view.ViewClient`); `pagefleet:router_shared_view` says whether its last
exchange was answered.

Metrics (prometheus_client, the process's default registry, so the
ingress's /metrics serves them): `pagefleet:routed_requests` (counter,
labels ingress, replica, policy) and `pagefleet:router_prefix_hit_blocks`
(counter, label ingress: prompt blocks found in the chosen replica's prefix
cache). They are created once per process by `router_metrics()`; other
modules should use that too. `ingress` is the id of the ingress replica the
router runs in (`ingress_id`): every ingress's /metrics shows the other
ingresses' counters next to its own (they push them to the metrics hub), so
without it the same series would appear once per ingress with different
values, and `rate()` over it would see resets. Sum over `ingress` for fleet
totals.

Why the power-of-two router is Serve's: it probes the replicas' real queue
lengths (`PowerOfTwoChoicesRequestRouter`, Serve's default in 2.60), which a
pure function of stale stats cannot; the subclass only adds our metrics.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import random
import time
import uuid
import weakref
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    ReplicaResult,
    RequestRouter,
    RunningReplica,
)

from pagefleet.cluster.autoscaling import AutoscalerStatus, read_status, status_key
from pagefleet.cluster.replica_messages import ReplicaRequest
from pagefleet.cluster.routing.config import (
    DEFAULT_ROUTING_STATS_PERIOD_S,
    ROUTING_POLICIES,
    RoutingConfig,
)
from pagefleet.cluster.routing.policy import (
    RouteDecision,
    RouteRequest,
    round_robin_ranking,
)
from pagefleet.cluster.routing.reports import ReplicaLoad
from pagefleet.cluster.routing.router import Router
from pagefleet.cluster.routing.scale_in import (
    ScaleInNotice,
    WarmUp,
    newest,
    register_warm_up_source,
)
from pagefleet.cluster.routing.serve_common import (
    CountsRoutes,
    cache_salt_of,
    ingress_id,
    prompt_of,
    replica_key,
    request_of,
    samples_of,
)
from pagefleet.cluster.routing.shared_view import ViewClient
from pagefleet.cluster.routing.state import RouterState
from pagefleet.cluster.routing.view_actor import RemoteView, hub_name
from pagefleet.engine import SamplingParams

logger = logging.getLogger("pagefleet.cluster")

# Decisions waiting for on_request_routed; a request cancelled before it is
# routed never reports back, so the oldest are dropped past this many.
_MAX_PENDING_DECISIONS = 10_000
# The scale-in notice: how often a router reads the autoscaler's status (a GCS read, off
# its loop), how old a status may be and still count, and how many prompt tokens it
# remembers to warm (int32: 32 MiB).
NOTICE_READ_PERIOD_S = 1.0
NOTICE_MAX_AGE_S = 30.0
NOTICE_MEMORY_TOKENS = 8 << 20
# A peer router not heard from for this many exchange timeouts is dropped by the hub.
VIEW_PEER_TTL_TIMEOUTS = 5


@dataclass
class _Pending:
    """A request ranked and not yet reported routed."""

    decision: RouteDecision
    hashes: tuple[int, ...]  # the prompt's block hashes (its prefix, for affinity)
    finished: bool = False  # its completion was seen first


class _PagefleetRouter(CountsRoutes, RequestRouter):
    """Shared wiring: the policy name, the metrics and an injectable clock."""

    def initialize_state(self, **kwargs: Any) -> None:
        self._clock: Callable[[], float] = time.time
        self._init_metrics()


class MostFreeBlocksRouter(_PagefleetRouter):
    """Ranks replicas by the KV blocks they would have free after the request
    (`policy.choose_replica`). `request_router_kwargs` are
    `RoutingConfig` fields."""

    policy_name = "most_free_blocks"

    def initialize_state(self, **kwargs: Any) -> None:
        super().initialize_state()
        self.routing_config = RoutingConfig(**{"policy": "most_free_blocks", **kwargs})
        self.routing_state = RouterState(
            memory_blocks=self.routing_config.affinity_memory_blocks,
            memory_max_blocks=self.routing_config.affinity_memory_max_blocks,
        )
        # Independent per router (per handle), so routers in several
        # processes do not break ties the same way.
        self._rng = random.Random(os.urandom(16))
        self._decisions: OrderedDict[str, _Pending] = OrderedDict()
        # Parsed reports by replica, reused while Serve hands us the same dict
        # (it changes only every stats period; parsing copies the digest).
        self._loads: dict[str, tuple[Mapping[str, Any], ReplicaLoad]] = {}
        # The scale-in notice (module docstring): prompts as int32 arrays.
        self._notice: ScaleInNotice[array[int]] = ScaleInNotice(
            NOTICE_MEMORY_TOKENS, len, f"warm-up-{uuid.uuid4().hex[:12]}"
        )
        self._order: dict[str, None] = {}  # replicas in the order first offered
        self._read_status: Callable[[bytes], AutoscalerStatus | None] = read_status
        self._status_key = status_key(self._deployment_id.app_name, self._deployment_id.name)
        self._status_read_at = -math.inf
        self._autoscaled = False  # a status was read: the deployment autoscales
        self._leaving = 0  # the notice last heard
        self._warm_ups: dict[str, WarmUp] = {}  # sent, by warm-up id
        self._warm_routed: dict[str, str] = {}  # internal request id -> warm-up id
        self.warm_up_outbox: deque[ReplicaRequest] = deque()
        self._router = Router(self.routing_config, self.routing_state, self._rng, self._notice)
        register_warm_up_source(self)  # the ingress sends them (`take_warm_ups`)
        # The shared view (module docstring): exchanged every period off the requests' path.
        cfg = self.routing_config
        self.view = ViewClient()
        self.view_id = f"{ingress_id()}-{uuid.uuid4().hex[:8]}"
        self.remote_view = RemoteView(
            hub_name(self._deployment_id.app_name, self._deployment_id.name),
            cfg.shared_view_timeout_s,
            VIEW_PEER_TTL_TIMEOUTS * cfg.shared_view_timeout_s,
        )
        self._view_task: asyncio.Task[None] | None = None

    def _start_view(self) -> None:
        """Start the exchanges on this router's loop (once; never with period 0)."""
        period = self.routing_config.shared_view_period_s
        if self._view_task is None and period > 0:
            loop = asyncio.get_running_loop()
            self._view_task = loop.create_task(_exchange_every(weakref.ref(self), period))

    async def exchange_view(self) -> None:
        """One exchange with the hub: merge the peers, or fall back to the own view."""
        publication = self.view.publication(self.routing_state)
        try:
            answer = await self.remote_view.exchange(self.view_id, publication, self.view.since)
        except Exception:
            if self.view.shared:
                logger.warning("routing view hub unreachable: routing on this router's own view")
            self.view.failed(self.routing_state)
        else:
            now = self._clock()
            self.view.merged(self.routing_state, publication, answer, self.routing_config, now)
        self._metrics.shared_view(self.view.shared)

    def _load_of(self, key: str, replica: RunningReplica) -> ReplicaLoad:
        stats = replica.routing_stats
        cached = self._loads.get(key)
        if cached is not None and cached[0] is stats:
            return cached[1]
        load = ReplicaLoad.from_routing_stats(key, stats)
        self._loads[key] = (stats, load)
        return load

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        now = self._clock()
        by_key = {replica_key(r.replica_id): r for r in candidate_replicas}
        loads = [self._load_of(k, r) for k, r in by_key.items()]
        self._router.reconcile(loads, now)
        await self._hear_notice(loads, now)
        if self._notice.queued:  # a survivor may have compute to spare now
            self._send_due_warm_ups(loads, now)
        warm = self._warm_up_of(pending_request, by_key, now)
        if warm is not None:
            return [[warm]]
        ids, max_tokens = prompt_of(pending_request)
        if ids:
            self._start_view()
        samples = samples_of(pending_request)
        # The replicas' own salt and block size: the prompt is hashed exactly as
        # their block managers hash it (normally one model, so one salt).
        salted = next((ld for ld in loads if ld.hash_salt is not None), None)
        request_id = pending_request.metadata.internal_request_id if pending_request else ""
        # A retry re-decides from scratch: its own earlier choice must not weigh on it.
        retry = request_id in self._decisions
        self.routing_state.withdraw(request_id)
        request = RouteRequest.from_prompt(
            request_id,
            ids,
            max_tokens,
            salted.block_size if salted else None,
            salted.hash_salt if salted else None,
            samples,
            cache_salt_of(pending_request),
        )
        decision = self._router.choose(request, loads, now)
        if pending_request is not None:
            # Serve's built-in routers set this through their locality helpers; without it a
            # replica that rejects (full queue, slow probe) is retried in a tight loop that
            # holds the router thread's GIL and starves the very probes it waits on.
            pending_request.routing_context.should_backoff = True
        if pending_request is not None and ids:
            # A warm-up's tokens are remembered once a status was read (autoscaling).
            prompt = array("i", ids) if self._autoscaled else None
            self._router.record(request, decision, now, prompt)
            self._decisions[request_id] = _Pending(decision, request.prompt_block_hashes)
            self._decisions.move_to_end(request_id)
            while len(self._decisions) > _MAX_PENDING_DECISIONS:
                self._decisions.popitem(last=False)
        # First try: the best replica only. Serve gives up on a replica whose queue-length
        # probe misses a 0.1 s deadline (a busy host) and would take the next rank; the
        # retry (Serve calls again at once, with a longer deadline) offers the whole
        # ranking, so a full or dead first choice still falls through.
        ranking = decision.ranking if retry or not ids else decision.ranking[:1]
        return [[by_key[k]] for k in ranking]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult
    ) -> None:
        key, request_id = replica_key(replica_id), pending_request.metadata.internal_request_id
        pending = self._decisions.pop(request_id, None)
        if pending is None:
            return  # not a generation request (or one decided too long ago to matter)
        decision = pending.decision
        if pending.finished:
            # Nothing to reserve any more, but its prompt is cached where it ran.
            self.routing_state.on_routed(
                request_id, key, 0, self._clock(), pending.hashes, decision.owner
            )
            self.routing_state.on_completed(request_id)
        else:
            blocks = decision.cost_blocks.get(key, 0)
            self.routing_state.on_routed(
                request_id,
                key,
                blocks,
                self._clock(),
                pending.hashes,
                decision.owner,
                decision.prefill_tokens.get(key, 0),
            )
        self._count(key, decision.hit_blocks.get(key, 0))

    async def _hear_notice(self, loads: Sequence[ReplicaLoad], now: float) -> None:
        """Read the autoscaler's status (rate-limited); on a new scale-in notice plan its
        warm-ups (module docstring, "Scale-in notice")."""
        if now - self._status_read_at < NOTICE_READ_PERIOD_S:
            return
        self._status_read_at = now
        try:
            status = await asyncio.to_thread(self._read_status, self._status_key)
        except Exception:  # routing must not fail for a notice
            logger.warning("could not read the autoscaler's status", exc_info=True)
            return
        self._autoscaled = self._autoscaled or status is not None
        fresh = status is not None and now - status.time <= NOTICE_MAX_AGE_S
        leaving = status.leaving if status is not None and fresh else 0
        if leaving != self._leaving:
            self._leaving = leaving
            self._router.hear(newest(list(self._order), leaving), loads, now)

    def _send_due_warm_ups(self, loads: Sequence[ReplicaLoad], now: float) -> None:
        """`ScaleInNotice.due` (survivors with compute to spare) into the outbox, as pinned
        one-token requests."""
        for send in self._router.due_warm_ups(loads, now):
            w = send.warm_up
            # Due only to a replica that reported (`spare_compute`): its block size is known.
            bs = self._loads[w.replica_id][1].block_size
            tokens = send.prompt[: len(w.hashes) * bs].tolist()
            params = SamplingParams(max_tokens=1)
            self._warm_ups[send.warm_id] = w
            self.warm_up_outbox.append(
                ReplicaRequest(send.warm_id, tokens, params, True, w.replica_id)
            )

    def _warm_up_of(
        self,
        pending_request: PendingRequest | None,
        by_key: Mapping[str, RunningReplica],
        now: float,
    ) -> RunningReplica | None:
        """A warm-up's replica, if `pending_request` is one of this router's and its
        replica is still offered: reserved there, its blocks sent, the leaver still their
        owner. A pinned request this router did not plan goes to its replica too."""
        request = request_of(pending_request)
        pin = getattr(request, "replica", None)
        if pending_request is None or pin not in by_key:
            return None
        pending_request.routing_context.should_backoff = True
        internal = pending_request.metadata.internal_request_id
        w = self._warm_ups.get(request.request_id)
        if w is not None and w.replica_id == pin:
            self.routing_state.withdraw(internal)
            self._router.send_warm_up(internal, w, len(request.prompt_token_ids), now)
            self._warm_routed[internal] = request.request_id
        return by_key[pin]

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        warm_id = self._warm_routed.pop(internal_request_id, None)
        if warm_id is not None:  # its chain is cached there now: hand it over, send the next
            self._warm_ups.pop(warm_id, None)
            self._router.warm_up_ended(warm_id)
        self.routing_state.on_completed(internal_request_id)
        if warm_id is not None:
            loads = [load for _, load in self._loads.values()]
            self._send_due_warm_ups(loads, self._clock())
        # Serve runs a result's completion callback and the code after the replica's
        # acceptance as separate events: on a busy loop a short request can finish first.
        # Its decision stays for on_request_routed to count, marked so it reserves nothing.
        pending = self._decisions.get(internal_request_id)
        if pending is not None:
            pending.finished = True

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.routing_state.forget_replica(replica_key(replica_id))
        self._loads.pop(replica_key(replica_id), None)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        # The live replicas' latest reports first: the hand-off reads their digests.
        for r in replicas:
            key = replica_key(r.replica_id)
            self._load_of(key, r)
            self._order.setdefault(key)
        super().update_replicas(replicas)

    def retain_replicas(self, live: set[str]) -> None:
        """Forget the replicas not in `live`, first handing the prompt chains they own to
        the live ones that hold them (`scale_in.hand_off_and_retain`)."""
        super().retain_replicas(live)
        survivors = [
            self._loads[k][1] if k in self._loads else ReplicaLoad.unreported(k)
            for k in sorted(live)
        ]
        self._router.retain(survivors, self._clock())
        for gone in self._loads.keys() - live:
            del self._loads[gone]
        for gone in self._order.keys() - live:
            del self._order[gone]


async def _exchange_every(router: weakref.ref[MostFreeBlocksRouter], period: float) -> None:
    """`exchange_view` every `period` while the router lives."""
    while True:
        await asyncio.sleep(period)
        live = router()
        if live is None:
            return
        await live.exchange_view()
        del live


class RoundRobinRouter(_PagefleetRouter):
    """Each request's first choice is the next replica in a fixed order (a baseline)."""

    policy_name = "round_robin"

    def initialize_state(self, **kwargs: Any) -> None:
        super().initialize_state()
        self._counter = 0

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        by_key = {replica_key(r.replica_id): r for r in candidate_replicas}
        ranking = round_robin_ranking(by_key, self._counter)
        self._counter += 1
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # see MostFreeBlocksRouter
        return [[by_key[k]] for k in ranking]


class PowerOfTwoRouter(CountsRoutes, PowerOfTwoChoicesRequestRouter):
    """Serve's power-of-two choices, with pagefleet's routing metrics."""

    policy_name = "power_of_two"

    def initialize_state(self, **kwargs: Any) -> None:
        self._init_metrics()


# Each policy's router, by import path: Serve imports it (and pickles its module by
# value for the handles), so this module names the Ray Serve LLM baseline without
# importing it.
ROUTER_PATHS: dict[str, str] = {
    "most_free_blocks": f"{__name__}.MostFreeBlocksRouter",
    "power_of_two": f"{__name__}.PowerOfTwoRouter",
    "round_robin": f"{__name__}.RoundRobinRouter",
    "prefix_cache_affinity": (
        "pagefleet.cluster.routing.ray_prefix_affinity.RayPrefixCacheAffinityRouter"
    ),
}


def request_router_config(
    routing: str = "most_free_blocks",
    stats_period_s: float = DEFAULT_ROUTING_STATS_PERIOD_S,
    router_kwargs: Mapping[str, Any] | None = None,
) -> RequestRouterConfig:
    """Serve's `RequestRouterConfig` for a `routing:` setting of the cluster config.

    `router_kwargs` (JSON-serializable) reach `initialize_state`; for
    most_free_blocks they are `RoutingConfig` fields.
    """
    if routing not in ROUTING_POLICIES:
        raise ValueError(f"routing must be one of {ROUTING_POLICIES}, got {routing!r}")
    kwargs = dict(router_kwargs or {})
    if routing == "most_free_blocks":
        RoutingConfig(**{"policy": routing, **kwargs})  # fail here, not in every handle
    return RequestRouterConfig(
        request_router_class=ROUTER_PATHS[routing],
        request_router_kwargs=kwargs,
        request_routing_stats_period_s=stats_period_s,
    )
