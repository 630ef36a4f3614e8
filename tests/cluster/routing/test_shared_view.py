"""The shared routing view (`routing/shared_view.py`): two or three routers' states merged
through a `ViewHub`, exactly (no Ray: the hub's exchange is called directly)."""

from __future__ import annotations

import random

from pagefleet.cluster.routing.config import RoutingConfig
from pagefleet.cluster.routing.ledger import Pending
from pagefleet.cluster.routing.policy import RouteRequest, choose_replica
from pagefleet.cluster.routing.reports import ReplicaLoad
from pagefleet.cluster.routing.shared_view import ViewClient, ViewHub
from pagefleet.cluster.routing.state import RouterState

CFG = RoutingConfig(stats_include_slack_s=1.0)
BS = 16
SALT = 7


class Ingress:
    """One ingress's router: its state and its side of the protocol."""

    def __init__(self, name: str, hub: ViewHub) -> None:
        self.name, self.hub = name, hub
        self.state = RouterState()
        self.view = ViewClient()

    def exchange(self, now: float) -> None:
        pub = self.view.publication(self.state)
        answer = self.hub.exchange(self.name, pub, self.view.since, now)
        self.view.merged(self.state, pub, answer, CFG, now)

    def send(
        self, rid: str, replica: str, blocks: int, now: float, hashes: tuple[int, ...] = ()
    ) -> None:
        self.state.on_routed(rid, replica, blocks, now, hashes, prefill_tokens=blocks * BS)


def load(rid: str, timestamp: float = 0.0, free: int = 100) -> ReplicaLoad:
    return ReplicaLoad(rid, free, 100, BS, timestamp=timestamp, hash_salt=SALT)


def pending(ingress: Ingress, replica: str, now: float = 10.0) -> Pending:
    return ingress.state.pending_load(load(replica), CFG, now)


def test_a_peer_s_reservations_and_sends_count_exactly_after_one_exchange_each() -> None:
    hub = ViewHub()
    a, b = Ingress("a", hub), Ingress("b", hub)
    a.send("q1", "r1", 4, 1.0, (11, 12))
    a.send("q2", "r1", 3, 1.1, (21,))
    a.send("q3", "r2", 5, 1.2)
    b.send("p1", "r2", 2, 1.3, (31,))
    assert pending(b, "r1") == Pending(0, 0, 0)  # not exchanged yet: its own view
    a.exchange(1.5)  # a publishes (b not heard from yet: nothing to merge)
    assert a.state.peers() == []
    b.exchange(1.6)  # b takes a's snapshot and publishes its own
    assert pending(b, "r1") == Pending(7, 2, 7 * BS)
    assert pending(b, "r2") == Pending(7, 2, 7 * BS)  # a's 5 blocks and its own 2
    assert 11 in b.state.sent_hashes(load("r1"), CFG, 10.0)
    assert b.state.owners == {11: "r1", 12: "r1", 21: "r1", 31: "r2"}
    a.exchange(1.7)
    assert pending(a, "r2") == Pending(7, 2, 7 * BS)
    assert a.state.owners == {11: "r1", 12: "r1", 21: "r1", 31: "r2"}
    # The merged entries are a's own view of them: none of them published back.
    assert set(b.view.publication(b.state).reservations) == {"p1"}


def test_a_completion_leaves_the_peer_s_view_and_reported_sends_never_enter_it() -> None:
    hub = ViewHub()
    a, b = Ingress("a", hub), Ingress("b", hub)
    a.send("q1", "r1", 4, 1.0)
    a.send("q2", "r1", 3, 5.0)
    a.exchange(5.1)
    b.exchange(5.2)
    assert pending(b, "r1") == Pending(7, 2, 7 * BS)
    a.state.on_completed("q2")
    a.exchange(5.3)
    b.exchange(5.4)
    assert pending(b, "r1") == Pending(4, 1, 4 * BS)
    # r1's report at t=3 includes q1 (sent at 1, plus the 1 s slack): b drops it and does
    # not take it back from a's snapshot, which still lists it (a has not seen the report).
    b.state.reconcile([load("r1", timestamp=3.0)], CFG, 5.5)
    assert pending(b, "r1") == Pending(0, 0, 0)
    b.exchange(5.6)
    assert b.state.in_flight == {}


def test_owners_converge_on_the_latest_send_whatever_order_the_records_arrive() -> None:
    hub = ViewHub()
    a, b = Ingress("a", hub), Ingress("b", hub)
    a.exchange(0.0)
    b.exchange(0.0)
    prompt = (101, 102, 103)
    a.send("q1", "r1", 4, 2.0, prompt)  # earlier
    b.send("p1", "r2", 4, 2.5, prompt[:2])  # later, a shorter prompt of the same chain
    b.exchange(3.0)
    a.exchange(3.1)  # a hears b's later record: r2 owns the chain's root now
    b.exchange(3.2)  # b hears a's earlier one: ignored
    assert a.state.owners[101] == b.state.owners[101] == "r2"
    assert a.state.owned_run(prompt, "r2") == b.state.owned_run(prompt, "r2") == 2
    # A record is merged once: the hub sends each peer only what it has not merged.
    a.send("q2", "r3", 1, 4.0, (201,))
    a.exchange(4.1)
    assert [
        r[3] for r in hub.exchange("b", b.view.publication(b.state), b.view.since, 4.2)["a"].owners
    ] == [(201,)]


def test_an_unreachable_hub_leaves_each_router_its_own_view() -> None:
    hub = ViewHub()
    a, b = Ingress("a", hub), Ingress("b", hub)
    a.send("q1", "r1", 4, 1.0, (11,))
    b.send("p1", "r1", 2, 1.0)
    a.exchange(1.1)
    b.exchange(1.2)
    assert b.view.shared and pending(b, "r1") == Pending(6, 2, 6 * BS)
    b.view.failed(b.state)
    assert not b.view.shared
    assert pending(b, "r1") == Pending(2, 1, 2 * BS)
    assert b.state.peers() == []
    assert b.state.owners == {11: "r1"}  # what it learnt of owners stays
    # A new hub (the old actor gone): b publishes its ownership records again.
    assert b.view.publication(b.state).owners == list(b.state.owner_log)


def test_a_router_not_heard_from_within_the_ttl_leaves_every_view() -> None:
    hub = ViewHub(peer_ttl_s=5.0)
    a, b, c = Ingress("a", hub), Ingress("b", hub), Ingress("c", hub)
    a.send("q1", "r1", 4, 1.0)
    c.send("s1", "r1", 1, 1.0)
    a.exchange(1.0)
    c.exchange(1.0)
    b.exchange(2.0)
    assert sorted(b.state.peers()) == ["a", "c"]
    assert pending(b, "r1") == Pending(5, 2, 5 * BS)
    c.exchange(6.5)
    b.exchange(7.0)  # a last heard at 1.0: gone
    assert b.state.peers() == ["c"]
    assert pending(b, "r1") == Pending(1, 1, BS)


def test_a_burst_split_over_two_routers_spreads_as_through_one() -> None:
    """Four replicas, 64 equal requests, the two routers exchanging after every request: each
    replica gets exactly 16, as one router places them."""

    def run(ingresses: list[Ingress]) -> dict[str, int]:
        rng = random.Random(0)
        loads = [load(f"r{i}", timestamp=0.0, free=100) for i in range(4)]
        counts = dict.fromkeys((ld.replica_id for ld in loads), 0)
        for i in range(64):
            ing = ingresses[(i * 7 // 5) % len(ingresses)]  # runs of 1 or 2 through each
            ing.state.reconcile(loads, CFG, 1.0)
            req = RouteRequest(f"{ing.name}{i}", 40, 8)
            d = choose_replica(req, loads, ing.state, CFG, rng, 1.0)
            ing.state.on_routed(req.request_id, d.replica_id, d.cost_blocks[d.replica_id], 1.0)
            counts[d.replica_id] += 1
            for other in ingresses:
                other.exchange(1.0)
        return counts

    even = {f"r{i}": 16 for i in range(4)}
    hub = ViewHub()
    assert run([Ingress("solo", ViewHub())]) == even
    assert run([Ingress("a", hub), Ingress("b", hub)]) == even
    # Each on its own view (a hub each: no peers), each spreads only its own share.
    alone = run([Ingress("a", ViewHub()), Ingress("b", ViewHub())])
    assert alone == {"r0": 16, "r1": 15, "r2": 16, "r3": 17}
