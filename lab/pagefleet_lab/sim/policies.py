"""The routing policies the simulator compares, each seeing what it would see in production.

- `most_free_blocks`: pagefleet's, driven through the product's own lifecycle calls
  (`routing.router.Router`, the same object `MostFreeBlocksRouter` drives on Serve) with
  its real `RouterState` (reservations, sent prompts, ownership), fed the replicas' reports as
  Serve delivers them (`Fleet.report`, every `routing_stats_period_s`), reconciled before
  each choice as `MostFreeBlocksRouter` does; completions end reservations; a change of
  the replica set hands the leavers' prompt chains to their holders first
  (`hand_off_and_retain`), as `MostFreeBlocksRouter.retain_replicas` does. On the
  autoscaler's scale-in notice it does what `MostFreeBlocksRouter` does
  (`routing.scale_in.ScaleInNotice`): the newest replicas are the leavers (the simulated
  Serve drains the newest too), their held chains go to their holders, each other reused
  chain is warmed on a survivor (the remembered request's shared blocks, one token out,
  one at a time per survivor) and handed to it when that ends, and a leaver takes only
  what it still owns meanwhile.
  `most_free_blocks_free_only` is the same before its prefill backlog term
  (`RoutingConfig.prefill_weight` 0).
- `round_robin`: `routing.policy.round_robin_ranking`'s first choice.
- `random`: a uniform choice.
- `power_of_two`: the fewer unfinished requests of two random replicas. Serve's router
  probes the replicas' queue lengths, so it reads them live.
- `load_only`: llm-d's load scorers alone, as its endpoint picker (the Gateway API
  Inference Extension's EPP) runs them: `queue-scorer` ((most waiting - waiting) / (most -
  least), 1 when all wait alike) and `kv-cache-utilization-scorer` (1 - KV usage) at
  equal weight (2 each in its default profile), the highest score, ties at random
  (`max-score-picker`). It reads the replicas' metrics as the EPP scrapes them, every 50
  ms (`--refresh-metrics-interval`'s default), not Serve's 2 s routing stats: a choice
  sees each replica as it was at the last scrape (`_Scraped`). No prefix.
- `load_only_stale`: the same idea over Serve's 2 s reports plus what this router sent
  since (`RouterState.pending`): the lowest kv_used_after / total + (waiting + sent
  since) / the largest such queue. The simulator's load_only before it read the EPP's
  scrapes; kept for that before/after.
- `approx_prefix`: Ray Serve LLM's `PrefixCacheAffinityRouter`, over token blocks instead
  of characters: a per-replica tree of the prompts it sent there (block hash -> replica;
  hashes are chained, so one hash names a whole prefix), LRU-evicted past
  `eviction_threshold` tokens to `eviction_target` (Ray's 400k / 360k characters at ~4
  characters a token). If the live queue lengths differ by more than
  `imbalanced_threshold` (10), power of two; else the replicas with the longest match
  if it is at least `match_rate_threshold` (0.1) of the prompt, else those with the
  smallest tree; the fewest unfinished requests among them.
- `approx_prefix_ray`: the same with Ray 2.60's defaults instead (`PrefixCacheAffinityRouter`
  as `routing: prefix_cache_affinity` runs it, `pagefleet/cluster/routing/ray_prefix_affinity.py`):
  `imbalanced_threshold` infinite (the queues never override the tree) and no eviction
  (`do_eviction` False). The simulator's stand-in for that policy when it is compared
  with a real run (`sim_router`); still over block hashes, not characters.
- `approx_prefix_gie`: the EPP's default profile (GIE and llm-d): `prefix-cache-scorer`
  at weight 3 beside the two load scorers at weight 2 each, the highest total. The
  prefix scorer is approximate: per replica an LRU index of the block hashes the picker
  sent there (16-token blocks, the first 256 of a prompt, 31,250 blocks a replica: its
  defaults), scoring the leading blocks a replica's index holds over the prompt's blocks
  indexed. Metrics scraped every 50 ms, as `load_only`.
- `kv_cost`: Dynamo's KV router: the exact cache view (each replica's block manager,
  as its KV events give it), cost = `overlap_weight` x prompt blocks still to compute +
  the blocks its active requests hold (prompt + generated); the lowest.

Ties break on a seeded `random.Random` (never on list order).
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections import OrderedDict
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

from pagefleet.cluster.routing.config import RoutingConfig
from pagefleet.cluster.routing.policy import blocks_needed, round_robin_ranking
from pagefleet.cluster.routing.reports import ReplicaLoad
from pagefleet.cluster.routing.router import Router
from pagefleet.cluster.routing.scale_in import (
    ScaleInNotice,
    newest,
)
from pagefleet.cluster.routing.state import RouterState
from pagefleet_lab.sim.fleet import Fleet, InFlightRequest, Policy
from pagefleet_lab.sim.workloads import SimRequest


class _Base:
    name = ""
    live_engine = False  # reads the engines live (the fleet brings them to now first)

    def __init__(self, fleet: Fleet, seed: int) -> None:
        self.fleet = fleet
        self.rng = random.Random(seed)

    @property
    def live(self) -> list[int]:
        """The replicas requests may go to (`Fleet.live`: started, not draining)."""
        return self.fleet.live

    def on_replicas(self, now: float) -> None:
        """`Fleet.live` changed (a scale-out's replica started, a scale-in's left)."""

    def on_completed(self, request: InFlightRequest, now: float) -> None:
        pass

    def on_stats(self, replica: int, load: ReplicaLoad, now: float) -> None:
        pass

    def on_scale_in_notice(self, leaving: int, now: float) -> None:
        """The autoscaler's scale-in notice: ignored."""

    def take_warm_ups(self, now: float) -> list[tuple[int, SimRequest]]:
        return []

    def _least_unfinished(self, candidates: list[int]) -> int:
        reps = self.fleet.replicas
        return min(candidates, key=lambda i: (reps[i].unfinished, self.rng.random()))


class RoundRobin(_Base):
    name = "round_robin"

    def __init__(self, fleet: Fleet, seed: int) -> None:
        super().__init__(fleet, seed)
        self.counter = 0
        self.on_replicas(0.0)

    def on_replicas(self, now: float) -> None:
        self.index = {self.fleet.replicas[i].id: i for i in self.live}

    def choose(self, request: InFlightRequest, now: float) -> int:
        first = round_robin_ranking(self.index, self.counter)[0]
        self.counter += 1
        return self.index[first]


class Random(_Base):
    name = "random"

    def choose(self, request: InFlightRequest, now: float) -> int:
        return self.live[self.rng.randrange(len(self.live))]


class PowerOfTwo(_Base):
    name = "power_of_two"

    def choose(self, request: InFlightRequest, now: float) -> int:
        if len(self.live) == 1:
            return self.live[0]
        return self._least_unfinished(self.rng.sample(self.live, 2))


class _Reported(_Base):
    """Keeps the latest report per replica and a real `RouterState` over them."""

    def __init__(self, fleet: Fleet, seed: int, config: RoutingConfig | None = None) -> None:
        super().__init__(fleet, seed)
        self.config = config or RoutingConfig()
        self.state = RouterState(
            memory_blocks=self.config.affinity_memory_blocks,
            memory_max_blocks=self.config.affinity_memory_max_blocks,
        )
        self.reports: dict[int, ReplicaLoad] = {}
        self.on_replicas(0.0)

    def on_replicas(self, now: float) -> None:
        """As the adapter does on Serve's update of the replica set: reports and state of
        the replicas offered only (`RouterState.retain`); a new one unreported."""
        reps = self.fleet.replicas
        self.index = {reps[i].id: i for i in self.live}
        self.reports = {
            i: self.reports.get(i) or ReplicaLoad.unreported(reps[i].id) for i in self.live
        }
        self.loads = list(self.reports.values())
        self._retain(now)

    def _retain(self, now: float) -> None:
        self.state.retain(self.index)

    def on_stats(self, replica: int, load: ReplicaLoad, now: float) -> None:
        if replica in self.reports:
            self.reports[replica] = load
            self.loads = list(self.reports.values())

    def on_completed(self, request: InFlightRequest, now: float) -> None:
        self.state.on_completed(request.route.request_id)


class _Scraped(_Base):
    """The replicas' metrics as the Gateway API Inference Extension's endpoint picker reads
    them: scraped every `scrape_period_s` (its `--refresh-metrics-interval`, 50 ms by
    default). The scrape is taken lazily, by the first choice at least a period after the
    last one, so a choice sees each replica as it was up to one period ago; requests sent
    since are not counted (the picker's queue and KV scorers read the scrape alone)."""

    scrape_period_s = 0.05

    def __init__(self, fleet: Fleet, seed: int) -> None:
        super().__init__(fleet, seed)
        self._scraped_at = -math.inf
        self._waiting: dict[int, int] = {}
        self._kv_usage: dict[int, float] = {}

    def on_replicas(self, now: float) -> None:
        self._scraped_at = -math.inf  # a new replica is scraped before it is scored

    def _scrape(self, now: float) -> None:
        if now - self._scraped_at < self.scrape_period_s:
            return
        self._scraped_at = now
        reps = self.fleet.replicas
        for i in self.live:
            r = reps[i]
            r.sync(now)
            stats = r.engine.stats(with_prefix=False)
            self._waiting[i] = stats.num_waiting
            self._kv_usage[i] = stats.num_used_blocks / stats.num_total_blocks

    def _load_scores(self) -> dict[int, float]:
        """`queue-scorer` + `kv-cache-utilization-scorer`, each in [0, 1], by replica."""
        waiting = {i: self._waiting[i] for i in self.live}
        most, least = max(waiting.values()), min(waiting.values())
        span = most - least
        return {
            i: (1.0 if span == 0 else (most - q) / span) + (1.0 - self._kv_usage[i])
            for i, q in waiting.items()
        }

    def _pick(self, scores: Mapping[int, float]) -> int:
        """`max-score-picker`: the highest score, ties at random."""
        return max(scores, key=lambda i: (scores[i], self.rng.random()))


class LoadOnly(_Scraped):
    """llm-d's load scorers on the EPP's 50 ms scrapes (module docstring)."""

    name = "load_only"

    def choose(self, request: InFlightRequest, now: float) -> int:
        self._scrape(now)
        return self._pick(self._load_scores())


class ApproxPrefixGIE(_Scraped):
    """The EPP's default profile: approximate prefix (weight 3) + queue and KV (2 each)."""

    name = "approx_prefix_gie"
    prefix_weight = 3.0
    load_weight = 2.0  # each of the two load scorers
    max_blocks = 256  # `maxPrefixBlocksToMatch`
    index_blocks = 31_250  # `lruCapacityPerServer`

    def __init__(self, fleet: Fleet, seed: int) -> None:
        super().__init__(fleet, seed)
        if fleet.shape.block_size != 16:  # its index hashes 16-token blocks, as vLLM's
            raise ValueError("approx_prefix_gie models 16-token blocks")
        # Per replica: block hash -> None, least recently sent first.
        self.index: dict[int, OrderedDict[int, None]] = {}
        self.on_replicas(0.0)

    def on_replicas(self, now: float) -> None:
        super().on_replicas(now)
        self.index = {i: self.index.get(i) or OrderedDict() for i in self.live}

    def choose(self, request: InFlightRequest, now: float) -> int:
        self._scrape(now)
        hashes = request.route.prompt_block_hashes[: self.max_blocks]
        loads = self._load_scores()
        scores = {}
        for i, load in loads.items():
            match = _leading_in(hashes, self.index[i]) / len(hashes) if hashes else 0.0
            scores[i] = self.prefix_weight * match + self.load_weight * load
        best = self._pick(scores)
        index = self.index[best]
        index.update(dict.fromkeys(hashes))
        for h in hashes:
            index.move_to_end(h)
        while len(index) > self.index_blocks:
            index.popitem(last=False)
        return best


class LoadOnlyStale(_Reported):
    name = "load_only_stale"

    def choose(self, request: InFlightRequest, now: float) -> int:
        self.state.reconcile(self.loads, self.config, now)
        bs = self.fleet.shape.block_size
        need = blocks_needed(request.route, bs)
        total = self.fleet.shape.num_blocks
        kv: list[float] = []
        queue: list[int] = []
        for ld in self.loads:
            blocks, sent = self.state.pending(ld, self.config, now)
            used = (ld.total_blocks - ld.free_blocks + ld.demand_blocks) if ld.reported else 0
            kv.append((used + blocks + need) / total)
            queue.append((ld.waiting if ld.reported else 0) + sent)
        top = max(1, *queue)
        best = min(range(len(kv)), key=lambda i: (kv[i] + queue[i] / top, self.rng.random()))
        rid = self.loads[best].replica_id
        self.state.on_routed(request.route.request_id, rid, need, now)
        return self.index[rid]


class MostFreeBlocks(_Reported):
    """pagefleet's router (module docstring), as `MostFreeBlocksRouter` drives it."""

    name = "most_free_blocks"

    def __init__(self, fleet: Fleet, seed: int, config: RoutingConfig | None = None) -> None:
        # Prompts are the workload's requests (their tokens rebuilt when warmed).
        self.notice: ScaleInNotice[SimRequest] = ScaleInNotice()
        self._warm_ids: dict[str, str] = {}  # a warm-up's request id -> its notice id
        super().__init__(fleet, seed, config)

    @property
    def router(self) -> Router[SimRequest]:
        """The product's router lifecycle over this policy's state (`routing.router`)."""
        return Router(self.config, self.state, self.rng, self.notice)

    def _retain(self, now: float) -> None:
        """As `MostFreeBlocksRouter.retain_replicas`: a leaver's prompt chains go to the
        survivors that hold them first."""
        self.router.retain(self.loads, now)

    def on_scale_in_notice(self, leaving: int, now: float) -> None:
        """As `MostFreeBlocksRouter` on a new status: the newest replicas are the leavers
        (the simulated Serve drains the newest), `ScaleInNotice.hear` plans."""
        leavers = newest([self.fleet.replicas[i].id for i in self.live], leaving)
        self.router.reconcile(self.loads, now)
        self.router.hear(leavers, self.loads, now)

    def take_warm_ups(self, now: float) -> list[tuple[int, SimRequest]]:
        """`ScaleInNotice.due`, each routed to its survivor (the leaver still the owner):
        its prompt the warm-up's blocks of the remembered request, one token out."""
        bs = self.fleet.shape.block_size
        out: list[tuple[int, SimRequest]] = []
        if not self.notice.queued:
            return []
        router = self.router
        router.reconcile(self.loads, now)
        for send in router.due_warm_ups(self.loads, now):
            w = send.warm_up
            tokens = self.fleet.prompts.tokens(send.prompt)[: len(w.hashes) * bs]
            rid = -1 - int(send.warm_id.rpartition("-")[2])  # apart from the workload's
            req = SimRequest(rid, now, (), 0, 0, 1, "warm-up", tuple(tokens))
            router.send_warm_up(str(rid), w, len(tokens), now)
            self._warm_ids[str(rid)] = send.warm_id
            out.append((self.index[w.replica_id], req))
        return out

    def on_completed(self, request: InFlightRequest, now: float) -> None:
        super().on_completed(request, now)
        warm_id = self._warm_ids.pop(request.route.request_id, None)
        if warm_id is not None:
            self.router.warm_up_ended(warm_id)

    def choose(self, request: InFlightRequest, now: float) -> int:
        """As `MostFreeBlocksRouter.choose_replicas`: reconcile, choose, record."""
        router = self.router
        router.reconcile(self.loads, now)
        d = router.choose(request.route, self.loads, now)
        router.record(request.route, d, now, request.req)
        return self.index[d.replica_id]


class MostFreeBlocksFreeOnly(MostFreeBlocks):
    """most_free_blocks before the prefill backlog term (`prefill_weight` 0): free blocks,
    hits and ownership only; for the before/after."""

    name = "most_free_blocks_free_only"

    def __init__(self, fleet: Fleet, seed: int, config: RoutingConfig | None = None) -> None:
        super().__init__(
            fleet, seed, dataclasses.replace(config or RoutingConfig(), prefill_weight=0.0)
        )


class ApproxPrefix(_Base):
    name = "approx_prefix"

    def __init__(
        self,
        fleet: Fleet,
        seed: int,
        imbalanced_threshold: float = 10,
        match_rate_threshold: float = 0.1,
        eviction_threshold: int | None = 100_000,
        eviction_target: int = 90_000,
    ) -> None:
        super().__init__(fleet, seed)
        self.imbalanced_threshold = imbalanced_threshold
        self.match_rate_threshold = match_rate_threshold
        bs = fleet.shape.block_size
        # None: no eviction (in blocks, a tree never that large).
        self.eviction_threshold = (
            math.inf if eviction_threshold is None else eviction_threshold // bs
        )
        self.eviction_target = eviction_target // bs
        # Per replica: block hash -> None, least recently used first.
        self.trees: dict[int, OrderedDict[int, None]] = {}
        self.on_replicas(0.0)

    def on_replicas(self, now: float) -> None:
        self.trees = {i: self.trees.get(i) or OrderedDict() for i in self.live}

    def choose(self, request: InFlightRequest, now: float) -> int:
        hashes = request.route.prompt_block_hashes
        live = self.live
        reps = self.fleet.replicas
        queues = [reps[i].unfinished for i in live]
        if max(queues) - min(queues) > self.imbalanced_threshold:
            best = self._least_unfinished(self.rng.sample(live, min(2, len(live))))
        else:
            matched = {i: _leading_in(hashes, self.trees[i]) for i in live}
            top = max(matched.values())
            blocks = max(1, request.route.prompt_tokens // self.fleet.shape.block_size)
            if top and top / blocks >= self.match_rate_threshold:
                candidates = [i for i in live if matched[i] == top]
            else:
                smallest = min(len(self.trees[i]) for i in live)
                candidates = [i for i in live if len(self.trees[i]) == smallest]
            best = self._least_unfinished(candidates)
        tree = self.trees[best]
        for h in reversed(hashes):  # the root last: most recently used, evicted last
            tree[h] = None
            tree.move_to_end(h)
        if len(tree) > self.eviction_threshold:
            while len(tree) > self.eviction_target:
                tree.popitem(last=False)
        return best


class ApproxPrefixRay(ApproxPrefix):
    """`approx_prefix` with Ray 2.60's defaults (module docstring)."""

    name = "approx_prefix_ray"

    def __init__(self, fleet: Fleet, seed: int) -> None:
        super().__init__(fleet, seed, imbalanced_threshold=math.inf, eviction_threshold=None)


def _leading_in(hashes: tuple[int, ...], tree: OrderedDict[int, None]) -> int:
    n = 0
    for h in hashes:
        if h not in tree:
            break
        n += 1
    return n


class KVCost(_Base):
    name = "kv_cost"

    live_engine = True

    def __init__(self, fleet: Fleet, seed: int, overlap_weight: float = 1.0) -> None:
        super().__init__(fleet, seed)
        self.overlap_weight = overlap_weight

    def choose(self, request: InFlightRequest, now: float) -> int:
        bs = self.fleet.shape.block_size
        hashes = request.route.prompt_block_hashes
        prompt_blocks = -(-request.route.prompt_tokens // bs)
        best, best_key = 0, (float("inf"), 0.0)
        for r in (self.fleet.replicas[i] for i in self.live):
            cached = r.engine.block_manager.cached_run(hashes)
            cost = self.overlap_weight * (prompt_blocks - cached) + r.active_tokens_at(now) / bs
            key = (cost, self.rng.random())
            if key < best_key:
                best, best_key = r.index, key
        return best


POLICIES: dict[str, Callable[[Fleet, int], Policy]] = {
    p.name: p  # type: ignore[misc]
    for p in (
        RoundRobin,
        Random,
        PowerOfTwo,
        LoadOnly,
        LoadOnlyStale,
        ApproxPrefix,
        ApproxPrefixGIE,
        ApproxPrefixRay,
        KVCost,
        MostFreeBlocks,
        MostFreeBlocksFreeOnly,
    )
}


def policy_factory(
    name: str, seed: int, routing: Mapping[str, Any] | None = None
) -> Callable[[Fleet], Policy]:
    """`POLICIES[name]` for a run; `routing` (RoutingConfig fields) reaches the policies
    that read a `RoutingConfig` (most_free_blocks and its variant, load_only_stale) and
    no other."""
    cls = POLICIES[name]
    if routing and isinstance(cls, type) and issubclass(cls, _Reported):
        return partial(cls, seed=seed, config=RoutingConfig(**routing))
    return partial(cls, seed=seed)
