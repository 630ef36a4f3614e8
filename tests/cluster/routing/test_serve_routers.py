"""The Serve 2.60 router adapters over fake replicas and requests (no Ray cluster)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
from ray.serve.request_router import PendingRequest, ReplicaID

from pagefleet.cluster.autoscaling import AutoscalerStatus
from pagefleet.cluster.metrics import exposition
from pagefleet.cluster.replica_messages import ReplicaRequest
from pagefleet.cluster.routing.ledger import InFlight
from pagefleet.cluster.routing.reports import STAT_TIMESTAMP, routing_stats_from_engine
from pagefleet.cluster.routing.scale_in import take_warm_ups
from pagefleet.cluster.routing.serve_common import RouterMetrics, ingress_id, prompt_of, samples_of
from pagefleet.cluster.routing.serve_routers import (
    MostFreeBlocksRouter,
    PowerOfTwoRouter,
    RoundRobinRouter,
    request_router_config,
)
from pagefleet.engine import SamplingParams
from pagefleet.engine.block_manager import BlockManager
from pagefleet.engine.prefix_hash import block_hashes, prefix_hash_salt
from pagefleet.engine.sequence import Sequence
from pagefleet.engine.stats import EngineStats

DEP = DeploymentID(name="engine", app_name="pagefleet")
BS = 16
SALT = prefix_hash_salt("models/tiny", BS)


@dataclass
class FakeReplica:
    """What the router (and Serve's `update_replicas`) reads of a `RunningReplica`."""

    replica_id: ReplicaID
    routing_stats: dict[str, Any] = field(default_factory=dict)
    node_id: str | None = None
    availability_zone: str | None = None
    multiplexed_model_ids: set[str] = field(default_factory=set)

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return 0  # Serve probes each new replica's queue


def replica(name: str, free: int, now: float, cached: list[int] | None = None) -> FakeReplica:
    bm = BlockManager(64, BS, hash_salt=SALT)
    if cached:
        s = Sequence("s", cached, SamplingParams())
        assert bm.allocate_prefilled(s, [], s.num_tokens)
        s.num_computed_tokens = s.num_tokens
        bm.cache_computed_blocks(s)
        bm.free(s)
    stats = EngineStats(
        64, free, BS, 0, 0, 0, 0, 0, prefix_digest=bm.prefix_digest(), prefix_hash_salt=SALT
    )
    return FakeReplica(ReplicaID(name, DEP), routing_stats_from_engine(stats, now))


def pending(rid: str, *args: Any, prompt_token_ids: Any = None, **params: Any) -> PendingRequest:
    """A handle call as the ingress makes it: one ReplicaRequest-shaped argument (the
    params duck-typed, so that odd values can be tried), or `args` as given."""
    if prompt_token_ids is not None:
        args = (
            SimpleNamespace(prompt_token_ids=prompt_token_ids, params=SimpleNamespace(**params)),
        )
    return PendingRequest(list(args), {}, RequestMetadata(request_id=rid, internal_request_id=rid))


def names(ranks: list[list[Any]]) -> list[list[str]]:
    return [[r.replica_id.unique_id for r in rank] for rank in ranks]


def routed_count(replica: str, policy: str) -> float:
    value = REGISTRY.get_sample_value(
        "pagefleet:routed_requests_total",
        {"ingress": ingress_id(), "replica": replica, "policy": policy},
    )
    return value or 0.0


def make(cls: type, clock: float = 100.0, **kwargs: Any) -> Any:
    router = cls(deployment_id=DEP, handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state(**kwargs)
    router._clock = lambda: clock
    return router


def test_most_free_blocks_router_ranks_reserves_and_releases() -> None:
    async def go() -> None:
        router = make(MostFreeBlocksRouter)
        prompt = list(range(100))
        a = replica("a", 40, now=99.0, cached=prompt[:64])  # holds 4 of the prompt's blocks
        b = replica("b", 42, now=99.0)
        pr = pending("q1", prompt_token_ids=prompt, max_tokens=28)
        ranks = await router.choose_replicas([b, a], pr)
        # need 8 blocks; a: 40 - (8 - 4) = 36, b: 42 - 8 = 34.
        assert names(ranks) == [["a"]]  # the best only; a retry gets the whole ranking
        # Reserved on the first choice at once, before the replica has answered.
        assert router.routing_state.reserved_blocks("a") == 4
        before, hits_before = routed_count("a", "most_free_blocks"), _hits()
        router.on_request_routed(pr, a.replica_id, None)
        assert router.routing_state.reserved_blocks("a") == 4
        assert routed_count("a", "most_free_blocks") == before + 1
        assert _hits() == hits_before + 4
        # The reservation counts until a report newer than the routing arrives.
        pr2 = pending("q2", prompt_token_ids=list(range(500, 516)), max_tokens=16)
        ranks = await router.choose_replicas([a, b], pr2)
        assert ranks[0][0].replica_id.unique_id == "b"  # a: 40 - 4 - 2 = 34; b: 42 - 2 = 40
        router.on_request_completed(a.replica_id, "q1")
        assert router.routing_state.reserved_blocks("a") == 0
        # A request that was never accepted (rejected, cancelled) completes harmlessly.
        router.on_request_completed(b.replica_id, "q2")

    asyncio.run(go())


def test_fresh_stats_reconcile_reservations() -> None:
    async def go() -> None:
        router = make(MostFreeBlocksRouter, clock=100.0, stats_include_slack_s=0.5)
        a, b = replica("a", 40, now=99.0), replica("b", 40, now=99.0)
        pr = pending("q1", prompt_token_ids=[1] * 40, max_tokens=24)
        await router.choose_replicas([a, b], pr)
        router.on_request_routed(pr, a.replica_id, None)
        assert router.routing_state.reserved_blocks("a") == 4
        # A report taken after the request arrived (Serve delivers each report as a new dict).
        a.routing_stats = {**a.routing_stats, STAT_TIMESTAMP: 100.6}
        await router.choose_replicas([a, b], pending("q2", prompt_token_ids=[2]))
        assert set(router.routing_state.in_flight) == {"q2"}  # q1's is gone, q2's is new

    asyncio.run(go())


def test_a_burst_spreads_before_any_replica_answers() -> None:
    async def go() -> list[str]:
        router = make(MostFreeBlocksRouter)
        a, b = replica("a", 40, now=99.0), replica("b", 40, now=99.0)
        firsts = []
        for i in range(4):  # no on_request_routed in between: the replicas have not answered
            pr = pending(f"q{i}", prompt_token_ids=[i] * 40, max_tokens=24)
            firsts.append((await router.choose_replicas([a, b], pr))[0][0].replica_id.unique_id)
        assert router.routing_state.reserved_blocks("a") == 8
        assert router.routing_state.reserved_blocks("b") == 8
        return firsts

    firsts = asyncio.run(go())
    assert sorted(firsts) == ["a", "a", "b", "b"]


def test_a_retry_replaces_its_reservation_and_routing_moves_it() -> None:
    async def go() -> None:
        router = make(MostFreeBlocksRouter, memory_headroom=1.0)
        a, b = replica("a", 40, now=99.0), replica("b", 38, now=99.0)
        pr = pending("q", prompt_token_ids=[1] * 40, max_tokens=24)  # 4 blocks
        await router.choose_replicas([a, b], pr)
        assert router.routing_state.reserved_blocks("a") == 4
        # Serve found a full and asks again: the whole ranking, one reservation, not two.
        ranks = await router.choose_replicas([a, b], pr)
        assert names(ranks) == [["a"], ["b"]]
        assert router.routing_state.reserved_blocks("a") == 4
        # It fell down the ranking to b: the reservation follows.
        router.on_request_routed(pr, b.replica_id, None)
        assert router.routing_state.reserved_blocks("a") == 0
        assert router.routing_state.reserved_blocks("b") == 4
        # So do its prompt's 2 full blocks: b now holds and owns them.
        hashes = block_hashes([1] * 40, BS, SALT)
        assert {r.replica_id for r in router.routing_state.sent.values()} == {"b"}
        assert router.routing_state.owned_run(hashes, "b") == 2
        router.on_request_completed(b.replica_id, "q")
        assert router.routing_state.in_flight == {}

    asyncio.run(go())


def test_a_request_that_finishes_before_its_routing_is_reported_still_counts() -> None:
    async def go() -> None:
        router = make(MostFreeBlocksRouter)
        a, b = replica("a", 40, now=99.0), replica("b", 40, now=99.0)
        pr = pending("quick", prompt_token_ids=[1] * 20, max_tokens=4)
        first = (await router.choose_replicas([a, b], pr))[0][0]
        before = routed_count(first.replica_id.unique_id, "most_free_blocks")
        # Serve's completion callback ran before the code after the replica's acceptance.
        router.on_request_completed(first.replica_id, "quick")
        router.on_request_routed(pr, first.replica_id, None)
        assert routed_count(first.replica_id.unique_id, "most_free_blocks") == before + 1
        assert router.routing_state.in_flight == {}  # nothing reserved for a finished request
        assert "quick" not in router._decisions

    asyncio.run(go())


def _hits() -> float:
    labels = {"ingress": ingress_id()}
    return REGISTRY.get_sample_value("pagefleet:router_prefix_hit_blocks_total", labels) or 0.0


def test_round_robin_router_rotates() -> None:
    async def go() -> list[str]:
        router = make(RoundRobinRouter)
        reps = [replica(n, 10, 0.0) for n in ("b", "a", "c")]
        return [
            (await router.choose_replicas(reps, pending(f"q{i}")))[0][0].replica_id.unique_id
            for i in range(4)
        ]

    assert asyncio.run(go()) == ["a", "b", "c", "a"]


def test_prompt_contract_is_the_replica_request() -> None:
    async def go() -> None:
        req = ReplicaRequest("q", [4, 5], SamplingParams(max_tokens=9))
        assert prompt_of(pending("q", req)) == ([4, 5], 9)
        assert prompt_of(pending("q", prompt_token_ids=[1, 2], max_tokens=5)) == ([1, 2], 5)
        assert prompt_of(pending("q", prompt_token_ids=[1, 2])) == ([1, 2], 0)
        assert prompt_of(pending("q", "just text")) == ((), 0)  # e.g. a probe's call
        assert prompt_of(pending("q")) == ((), 0)
        assert prompt_of(None) == ((), 0)

    asyncio.run(go())


def test_request_router_config_per_routing_setting() -> None:
    cfg = request_router_config(
        "most_free_blocks", stats_period_s=1.5, router_kwargs={"affinity_max_load_gap": 0.1}
    )
    assert (
        cfg.request_router_class == "pagefleet.cluster.routing.serve_routers.MostFreeBlocksRouter"
    )
    assert cfg.get_request_router_class().__name__ == "MostFreeBlocksRouter"
    assert cfg.request_router_kwargs == {"affinity_max_load_gap": 0.1}
    assert cfg.request_routing_stats_period_s == 1.5
    assert request_router_config("round_robin").request_router_class.endswith("RoundRobinRouter")
    assert issubclass(PowerOfTwoRouter, object)
    assert request_router_config("power_of_two").request_router_class.endswith("PowerOfTwoRouter")
    with pytest.raises(ValueError):
        request_router_config("fastest")
    with pytest.raises(ValueError):
        request_router_config(router_kwargs={"affinity_max_load_gap": 2.0})


def test_n_and_best_of_reserve_each_sample_s_output() -> None:
    async def go() -> None:
        # Blocks alone (no prefill backlog term, no headroom): the sample count's
        # reservation is the point.
        router = make(MostFreeBlocksRouter, prefill_weight=0.0, memory_headroom=1.0)
        a, b = replica("a", 60, now=99.0), replica("b", 40, now=99.0)

        def prompt(k: int) -> list[int]:
            return [k] * 40  # 2 full blocks + 8 tokens; its own, so no hits

        # As pagefleet/cluster/http/serving.py sends it: a ReplicaRequest, the sample count on its params.
        burst = ReplicaRequest("q8", prompt(1), SamplingParams(max_tokens=24, n=8))
        await router.choose_replicas([a, b], pending("q8", burst))
        # ceil(64 / 16) = 4 for the prompt and the first sample, 7 x ceil(24 / 16) = 14.
        assert router.routing_state.in_flight["q8"] == InFlight("a", 18, 100.0, prefill_tokens=40)
        best = ReplicaRequest("qb", prompt(2), SamplingParams(max_tokens=24, n=2, best_of=8))
        await router.choose_replicas([a, b], pending("qb", best))
        # best_of 8 are generated; a has 60 - 18 - 18 = 24 left after it, b 40 - 18 = 22.
        assert router.routing_state.in_flight["qb"] == InFlight("a", 18, 100.0, prefill_tokens=40)
        kw = pending("qk", prompt_token_ids=prompt(3), max_tokens=24, n=3)
        await router.choose_replicas([a, b], kw)
        # 4 + 2 x 2 = 8: a would keep 24 - 8 = 16, b 40 - 8 = 32.
        assert router.routing_state.in_flight["qk"] == InFlight("b", 8, 100.0, prefill_tokens=40)

    asyncio.run(go())


def test_samples_of_reads_best_of_then_n() -> None:
    async def go() -> None:
        assert samples_of(pending("q", prompt_token_ids=[1], n=4)) == 4
        assert samples_of(pending("q", prompt_token_ids=[1], n=2, best_of=5)) == 5
        assert samples_of(pending("q", {"prompt_token_ids": [1], "best_of": 3})) == 1  # no request
        req = ReplicaRequest("q", [1], SamplingParams(n=6))
        assert samples_of(pending("q", req)) == 6
        assert samples_of(pending("q", prompt_token_ids=[1])) == 1
        assert samples_of(pending("q", prompt_token_ids=[1], n=True)) == 1  # not a count
        assert samples_of(None) == 1

    asyncio.run(go())


def _series(name: str, policy: str) -> set[str]:
    """Replicas with a `name` series of this process's ingress and `policy`."""
    return {
        s.labels["replica"]
        for m in REGISTRY.collect()
        for s in m.samples
        if s.name == name
        and s.labels.get("ingress") == ingress_id()
        and s.labels.get("policy") == policy
    }


def test_replicas_serve_stops_offering_are_forgotten() -> None:
    """Scale-ins and redeploys remove replicas without a death: 100 come and go, and the
    router's state (parsed reports, reservations, sent prompts, owners, its metric
    series) stays within the live set."""

    async def go() -> None:
        router = make(MostFreeBlocksRouter)
        live: list[FakeReplica] = []
        for i in range(100):
            new = replica(f"churn{i}", 60, now=99.0)
            live = [*live[-2:], new]  # at most 3 at once: the oldest leaves
            router.update_replicas(live)  # what Serve calls when the replica set changes
            keys = {r.replica_id.unique_id for r in live}
            for j, target in enumerate(live):  # a request to every live replica
                pr = pending(f"q{i}-{j}", prompt_token_ids=[i, j] * 20, max_tokens=8)
                await router.choose_replicas([target], pr)
                router.on_request_routed(pr, target.replica_id, None)
            state = router.routing_state
            assert set(router._loads) == keys
            assert state.replicas() == keys
            assert {f.replica_id for f in state.in_flight.values()} == keys
            assert set(state.owners.values()) == keys
            assert (
                _series("pagefleet:routed_requests_total", "most_free_blocks")
                & {f"churn{k}" for k in range(100)}
                == keys
            )
        # Exact: what the 3 live replicas were sent while live (3 blocks a request: 40 + 8
        # tokens, no hits), churn97 in the last 3 rounds, churn98 in 2, churn99 in 1.
        state = router.routing_state
        assert len(state.in_flight) == len(state.sent) == 6
        assert [state.reserved_blocks(f"churn{k}") for k in (96, 97, 98, 99)] == [0, 9, 6, 3]
        assert len(state.owners) == 6 * 2
        assert len(router._loads) == 3

    asyncio.run(go())


def test_a_scale_in_hands_the_leaver_s_prompt_to_a_replica_that_holds_it() -> None:
    """Serve's update without a replica: the prompts it owned go to a live replica holding
    them (`scale_in.hand_off_and_retain`) before its state is dropped."""

    async def go() -> None:
        router = make(MostFreeBlocksRouter)
        prompt = list(range(100))  # 6 full blocks
        gone = replica("gone", 60, now=99.0)
        a = replica("a", 40, now=99.0, cached=prompt)  # holds the prompt's 6 blocks
        b = replica("b", 48, now=99.0)
        router.update_replicas([gone, a, b])
        pr = pending("q1", prompt_token_ids=prompt, max_tokens=28)
        await router.choose_replicas([gone], pr)
        router.on_request_routed(pr, gone.replica_id, None)
        router.on_request_completed(gone.replica_id, "q1")
        hashes = block_hashes(prompt, BS, SALT)
        assert dict(router.routing_state.owners) == dict.fromkeys(hashes, "gone")
        router.update_replicas([a, b])  # the scale-in
        assert dict(router.routing_state.owners) == dict.fromkeys(hashes, "a")
        assert router.routing_state.replicas() == {"a"} and set(router._loads) == {"a", "b"}
        # Its next request stays where the prompt is: a 40 - (8 - 6) + 2 x 6 = 50 against
        # b's 48 - 8 = 40 (without the ownership a would score 38 and lose it).
        ranks = await router.choose_replicas([a, b], pending("q2", prompt_token_ids=prompt))
        assert names(ranks) == [["a"]]

    asyncio.run(go())


def test_a_scale_in_notice_warms_the_newest_replica_s_prompt_on_a_survivor() -> None:
    """The autoscaler's status announces one replica leaving: the newest offered (`new`)
    is the leaver; its reused prompt (sent twice: a 10-block system prompt, two queries)
    is queued as a warm-up pinned to the survivor with the most room, of its 10 shared
    blocks' tokens and one token out; the ingress's `take_warm_ups` gets it once; routed,
    it goes to that replica only; when it completes, the chain is that replica's. Under
    the notice a new prompt avoids the leaver."""
    statuses: list[AutoscalerStatus | None] = [AutoscalerStatus(3, 3, 0.1, 100.0)]

    async def go() -> None:
        router = make(MostFreeBlocksRouter)
        router._read_status = lambda key: statuses[-1]
        system = list(range(1000, 1160))
        a, b = replica("a", 30, now=99.0), replica("b", 40, now=99.0)
        new = replica("new", 60, now=99.0)  # the freest: it takes the tenant
        router.update_replicas([a, b, new])
        for i in range(2):
            prompt = system + list(range(5000 + 100 * i, 5040 + 100 * i))
            pr = pending(f"q{i}", prompt_token_ids=prompt, max_tokens=8)
            assert names(await router.choose_replicas([a, b, new], pr)) == [["new"]]
            router.on_request_routed(pr, new.replica_id, None)
            router.on_request_completed(new.replica_id, f"q{i}")
        hashes = block_hashes(system + list(range(5100, 5140)), BS, SALT)
        assert take_warm_ups() == []
        # The notice: read at the next choice at least NOTICE_READ_PERIOD_S later.
        statuses.append(AutoscalerStatus(3, 3, 0.1, 101.0, leaving=1))
        router._clock = lambda: 101.0
        other = pending("q2", prompt_token_ids=list(range(7000, 7100)), max_tokens=8)
        assert names(await router.choose_replicas([a, b, new], other)) == [["b"]]
        router.on_request_routed(other, b.replica_id, None)
        warm = take_warm_ups()
        assert [(w.replica, w.params.max_tokens) for w in warm] == [("b", 1)]
        assert warm[0].request_id.startswith("warm-up-")  # and the router's own id
        assert warm[0].prompt_token_ids == system  # the shared blocks only
        assert take_warm_ups() == []
        # The ingress sends it like any request: pinned to b, its blocks sent there, the
        # leaver still their owner until it completes.
        pr = PendingRequest(
            [warm[0]], {}, RequestMetadata(request_id="w", internal_request_id="w-1")
        )
        assert names(await router.choose_replicas([a, b, new], pr)) == [["b"]]
        assert router.routing_state.owners[hashes[0]] == "new"
        router.on_request_completed(b.replica_id, "w-1")
        assert [router.routing_state.owners[h] for h in hashes[:10]] == ["b"] * 10
        assert (
            router.routing_state.reserved_blocks("b") == 7
        )  # q2's (108 tokens), not the warm-up's
        # The notice withdrawn: the leaver takes new prompts again.
        statuses.append(AutoscalerStatus(3, 3, 0.1, 102.0))
        router._clock = lambda: 102.0
        later = pending("q3", prompt_token_ids=list(range(8000, 8100)), max_tokens=8)
        assert names(await router.choose_replicas([a, b, new], later)) == [["new"]]

    asyncio.run(go())


def test_replicas_that_leave_lose_their_series_on_every_router() -> None:
    async def go() -> None:
        for cls, policy in ((RoundRobinRouter, "round_robin"), (PowerOfTwoRouter, "power_of_two")):
            router = make(cls)
            a, b = replica(f"{policy}-a", 10, 0.0), replica(f"{policy}-b", 10, 0.0)
            router.update_replicas([a, b])
            for r in (a, b):
                router.on_request_routed(pending("q", prompt_token_ids=[1]), r.replica_id, None)
            ours = {f"{policy}-a", f"{policy}-b"}
            assert _series("pagefleet:routed_requests_total", policy) & ours == ours
            router.update_replicas([b])
            assert _series("pagefleet:routed_requests_total", policy) & ours == {f"{policy}-b"}

    asyncio.run(go())


def test_two_ingresses_expose_distinct_monotonic_series() -> None:
    """Each ingress's /metrics merges its own router counters with the other ingress's
    (pushed to the metrics hub): the ingress label keeps every series unique."""
    own, other = CollectorRegistry(), CollectorRegistry()
    a = RouterMetrics(registry=own, ingress="ingress-a")
    b = RouterMetrics(registry=other, ingress="ingress-b")
    for _ in range(3):
        a.routed("r1", "most_free_blocks", hit_blocks=2)
    b.routed("r1", "most_free_blocks", hit_blocks=5)
    b.routed("r2", "most_free_blocks")

    def scrape() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        # As ServeBackend.metric_snapshots: the hub's copy of the other ingress, then ours.
        text = exposition([list(other.collect()), list(own.collect())]).decode()
        out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        for fam in text_string_to_metric_families(text):
            for sample in fam.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                assert key not in out, f"duplicate series {key}"
                out[key] = sample.value
        return out

    first = scrape()
    routed = "pagefleet:routed_requests_total"
    assert {k: v for k, v in first.items() if k[0] == routed} == {
        (routed, (("ingress", "ingress-a"), ("policy", "most_free_blocks"), ("replica", "r1"))): 3,
        (routed, (("ingress", "ingress-b"), ("policy", "most_free_blocks"), ("replica", "r1"))): 1,
        (routed, (("ingress", "ingress-b"), ("policy", "most_free_blocks"), ("replica", "r2"))): 1,
    }
    hits = "pagefleet:router_prefix_hit_blocks_total"
    assert {k: v for k, v in first.items() if k[0] == hits} == {
        (hits, (("ingress", "ingress-a"),)): 6,
        (hits, (("ingress", "ingress-b"),)): 5,
    }
    b.routed("r1", "most_free_blocks", hit_blocks=1)
    second = scrape()
    assert first.keys() <= second.keys()
    assert all(second[k] >= v for k, v in first.items())  # no counter went down


class _Direct:
    """A `PrefixTree` method as an actor method: `.remote(...)` runs it at once."""

    def __init__(self, method: Any) -> None:
        self.remote = method


class FakeTreeActor:
    """Ray's own `PrefixTree` in this process, in place of its `PrefixTreeActor`."""

    def __init__(self) -> None:
        from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_tree import PrefixTree

        self.tree = PrefixTree()

    def __getattr__(self, name: str) -> _Direct:
        return _Direct(getattr(self.tree, name))


def test_ray_prefix_cache_affinity_router_routes_by_token_prefix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ray's `PrefixCacheAffinityRouter` through the adapter, with fake replicas and Ray's
    prefix tree in-process (its `ray.get` on the tree's answers made the identity)."""
    from ray.llm._internal.serve.routing_policies.prefix_aware import prefix_aware_router

    from pagefleet.cluster.routing.ray_prefix_affinity import (
        RayPrefixCacheAffinityRouter,
        prompt_text,
    )

    monkeypatch.setattr(prefix_aware_router, "ray", SimpleNamespace(get=lambda ref: ref))

    async def go() -> None:
        tree = FakeTreeActor()
        router = make(RayPrefixCacheAffinityRouter, tree_actor=tree)
        a, b = replica("pca-a", 10, 0.0), replica("pca-b", 10, 0.0)
        router.update_replicas([a, b])
        system = list(range(60_000, 60_100))  # past the surrogates: still one char each
        first = pending("q1", prompt_token_ids=[*system, 1, 2], max_tokens=4)
        assert {r.unique_id for r in names_of(await router.choose_replicas([a, b], first))} == {
            "pca-a",
            "pca-b",
        }  # an empty tree: the smallest tenants, both
        before = routed_count("pca-a", "prefix_cache_affinity")
        router.on_request_routed(first, a.replica_id, None)
        assert routed_count("pca-a", "prefix_cache_affinity") == before + 1
        # The same system prompt, another question: the replica that holds the prefix.
        again = pending("q2", prompt_token_ids=[*system, 7, 8, 9], max_tokens=4)
        assert names(await router.choose_replicas([a, b], again)) == [["pca-a"]]
        # Nothing shared (under 10 % matched): the replica holding the fewest tokens.
        other = pending("q3", prompt_token_ids=list(range(300, 400)), max_tokens=4)
        assert names(await router.choose_replicas([a, b], other)) == [["pca-b"]]
        # A call without a prompt: Serve's power of two, nothing inserted.
        probe = pending("info")
        assert len(await router.choose_replicas([a, b], probe)) >= 1
        router.on_request_routed(probe, b.replica_id, None)
        chars = tree.tree.tenant_to_char_count
        assert chars[a.replica_id.to_full_id_str()] == 102
        assert chars[b.replica_id.to_full_id_str()] == 0
        assert prompt_text([0, 0xD7FF, 0xD800]) == "\x00\ud7ff\ue000"

    asyncio.run(go())


def names_of(ranks: list[list[Any]]) -> list[ReplicaID]:
    return [r.replica_id for rank in ranks for r in rank]


def test_prefix_cache_affinity_config_names_the_adapter() -> None:
    cfg = request_router_config("prefix_cache_affinity", router_kwargs={"imbalanced_threshold": 8})
    assert cfg.request_router_class.endswith("ray_prefix_affinity.RayPrefixCacheAffinityRouter")
    assert cfg.request_router_kwargs == {"imbalanced_threshold": 8}
