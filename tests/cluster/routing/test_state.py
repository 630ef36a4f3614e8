"""RouterState's incremental totals against a from-scratch recomputation.

`Naive` is the state as it was before it kept running totals: every query scans every
entry. A seeded random sequence of sends (some re-sending a request, some with a clock
that steps back), completions, withdrawals, reconciles against random reports, and
replicas leaving drives both; after each event the entries, the totals and every query
agree, and `choose_replica` makes exactly the same decision over either.
"""

from __future__ import annotations

import random
from collections import Counter, OrderedDict
from collections.abc import Callable, Container, Iterable, Sequence
from dataclasses import dataclass, field

import pytest

from pagefleet.cluster.routing.config import RoutingConfig
from pagefleet.cluster.routing.ledger import InFlight, Pending, SentPrompt
from pagefleet.cluster.routing.policy import RouteRequest, choose_replica
from pagefleet.cluster.routing.prefill_drain import PrefillDrain
from pagefleet.cluster.routing.reports import ReplicaLoad
from pagefleet.cluster.routing.scale_in import hand_off_and_retain
from pagefleet.cluster.routing.state import RouterState
from pagefleet.engine import DigestView
from pagefleet.engine.prefix_hash import PrefixDigest

REPLICAS = ("a", "b", "c", "d")
BS = 16
SALT = 12345
CFG = RoutingConfig(stats_include_slack_s=1.0, max_in_flight_age_s=30.0)


@dataclass
class Naive:
    """The reference: entries only, each query a scan (the code before the running
    totals). Ownership, which the totals left alone, is a real RouterState's."""

    memory_blocks: int = 64
    in_flight: dict[str, InFlight] = field(default_factory=dict)
    sent: dict[str, SentPrompt] = field(default_factory=dict)
    ownership: RouterState = field(init=False)
    # Each replica's rate from its reports: the real estimator (its own tests are in
    # test_prefill_drain.py); the backlog below is replayed from scratch on every query.
    rates: PrefillDrain = field(default_factory=PrefillDrain)

    def __post_init__(self) -> None:
        self.ownership = RouterState(memory_blocks=self.memory_blocks)

    @property
    def owners(self) -> OrderedDict[int, str]:
        return self.ownership.owners

    def owned_run(self, hashes: Sequence[int], replica_id: str) -> int:
        return self.ownership.owned_run(hashes, replica_id)

    def owned_blocks(self, replica_id: str) -> int:
        return sum(1 for rid in self.owners.values() if rid == replica_id)

    def on_routed(
        self,
        request_id: str,
        replica_id: str,
        blocks: int,
        now: float,
        hashes: Sequence[int] = (),
        owner: str | None = None,
        prefill_tokens: int = 0,
    ) -> None:
        self.in_flight[request_id] = InFlight(replica_id, blocks, now, prefill_tokens)
        if hashes:
            self.sent[request_id] = SentPrompt(replica_id, frozenset(hashes), now)
        self.ownership.on_routed(request_id, replica_id, blocks, now, hashes, owner)

    def on_completed(self, request_id: str) -> None:
        self.in_flight.pop(request_id, None)

    def withdraw(self, request_id: str) -> None:
        self.in_flight.pop(request_id, None)
        self.sent.pop(request_id, None)

    @staticmethod
    def counts(report_time: float | None, routed_at: float, now: float) -> bool:
        """Sent and not yet in the report, nor too old."""
        included = report_time is not None and report_time >= routed_at + CFG.stats_include_slack_s
        return not included and now - routed_at <= CFG.max_in_flight_age_s

    def reconcile(self, loads: Iterable[ReplicaLoad], config: RoutingConfig, now: float) -> None:
        report_time = {ld.replica_id: ld.timestamp for ld in loads if ld.reported}
        for ld in loads:
            if ld.reported:
                self.rates.observe(ld.replica_id, ld.timestamp, ld.prefill_done, 8)
        for table in (self.in_flight, self.sent):
            for rid, f in list(table.items()):
                if not self.counts(report_time.get(f.replica_id), f.routed_at, now):
                    del table[rid]

    def retain(self, live: Container[str] | Callable[[str], bool]) -> None:
        keep = live if callable(live) else live.__contains__
        for table in (self.in_flight, self.sent):
            for rid in [r for r, f in table.items() if not keep(f.replica_id)]:
                del table[rid]
        self.ownership.retain(keep)
        self.rates.forget(keep)

    def pending(self, load: ReplicaLoad, config: RoutingConfig, now: float) -> tuple[int, int]:
        p = self.pending_load(load, config, now)
        return p.blocks, p.requests

    def pending_load(self, load: ReplicaLoad, config: RoutingConfig, now: float) -> Pending:
        report_time = load.timestamp if load.reported else None
        mine = [
            f
            for f in self.in_flight.values()
            if f.replica_id == load.replica_id and self.counts(report_time, f.routed_at, now)
        ]
        return Pending(sum(f.blocks for f in mine), len(mine), sum(f.prefill_tokens for f in mine))

    def prefill_backlog(self, load: ReplicaLoad, config: RoutingConfig, now: float) -> int:
        """The reported backlog, then every send the report does not include (aged or not)
        in the order sent, each after draining at the replica's rate; drained to now."""
        report_time = load.timestamp if load.reported else None
        rate = self.rates.rate(load.replica_id)
        sends = sorted(
            (f.routed_at, f.prefill_tokens)
            for f in self.in_flight.values()
            if f.replica_id == load.replica_id
            and not (
                report_time is not None and report_time >= f.routed_at + CFG.stats_include_slack_s
            )
        )
        queue, t = float(load.prefill_tokens if load.reported else 0), report_time
        for routed_at, tokens in [*sends, (now, 0)]:
            if t is not None and routed_at > t:
                queue = max(0.0, queue - rate * (routed_at - t))
            t = routed_at if t is None else max(t, routed_at)
            queue += tokens
        return round(queue)

    def sent_hashes(self, load: ReplicaLoad, config: RoutingConfig, now: float) -> set[int]:
        report_time = load.timestamp if load.reported else None
        out: set[int] = set()
        for f in self.sent.values():
            if f.replica_id == load.replica_id and self.counts(report_time, f.routed_at, now):
                out |= f.hashes
        return out


def random_loads(rng: random.Random, now: float) -> list[ReplicaLoad]:
    """Reports of some replicas (in random order), some unreported, taken a while ago."""
    loads = []
    for rid in rng.sample(REPLICAS, rng.randint(1, len(REPLICAS))):
        if rng.random() < 0.15:
            loads.append(ReplicaLoad.unreported(rid))
            continue
        digest: Container[int] = frozenset(rng.sample(range(40), rng.randint(0, 12)))
        if rng.random() < 0.8:  # as a replica reports it: a Bloom filter (false positives too)
            bloom = PrefixDigest(num_bits=256)
            for h in digest:
                bloom.add(h)
            digest = DigestView(bloom.to_bytes())
        loads.append(
            ReplicaLoad(
                rid,
                rng.randint(0, 200),
                200,
                BS,
                waiting=rng.randint(0, 10),
                prefix_digest=digest,
                timestamp=now - rng.uniform(0.0, 6.0),
                hash_salt=SALT,
                demand_blocks=rng.randint(0, 20),
                prefill_tokens=rng.choice((0, rng.randint(0, 4000))),
                # About 500 prompt tokens a second, so that backlogs drain.
                prefill_done=round(500 * (now - rng.uniform(0.0, 6.0))),
            )
        )
    return loads


def random_request(rng: random.Random, request_id: str) -> RouteRequest:
    """A prompt whose block hashes start at one of a few roots (shared prefixes)."""
    root = rng.choice((0, 10, 20, 30))
    blocks = rng.randint(0, 9)
    hashes = tuple(range(root, root + blocks))
    tokens = blocks * BS + rng.randint(0, BS - 1)
    return RouteRequest(request_id, tokens, rng.randint(0, 64), hashes, SALT, rng.randint(1, 3))


def totals_from_scratch(state: RouterState) -> tuple[dict[str, int], dict[str, int], dict]:
    blocks: Counter[str] = Counter()
    count: Counter[str] = Counter()
    prefill: Counter[str] = Counter()
    for f in state.in_flight.values():
        blocks[f.replica_id] += f.blocks
        count[f.replica_id] += 1
        prefill[f.replica_id] += f.prefill_tokens
    assert state._reservations.prefill == {r: prefill[r] for r in count}
    hashes: dict[str, Counter[int]] = {}
    for p in state.sent.values():
        hashes.setdefault(p.replica_id, Counter()).update(p.hashes)
    return dict(blocks), dict(count), {r: dict(c) for r, c in hashes.items()}


def assert_same(state: RouterState, naive: Naive, rng: random.Random, now: float) -> None:
    assert dict(state.in_flight) == naive.in_flight
    assert dict(state.sent) == naive.sent
    assert list(state.owners.items()) == list(naive.owners.items())
    # The chain index: its per-owner roots are its keys, and every chain whose root a
    # replica owns (a request's hashes start at a multiple of 10 here) is in it.
    index = state._chain_hashes
    assert set(index) == {(rid, root) for rid, roots in state._roots.items() for root in roots}
    for h, rid in state.owners.items():
        root = h - h % 10
        if state.owners.get(root) == rid:
            assert (rid, root) in index and root in state.owned_chains(rid)
    # The running totals are the sums over the entries, replicas without entries absent.
    blocks, count, hashes = totals_from_scratch(state)
    assert state._reservations.blocks == blocks
    assert state._reservations.count == count
    sent = state._sent
    assert {r: {h: sent.count(r, h) for h in held} for r, held in sent.held.items()} == hashes
    assert set(sent.shared) == set(sent.held)
    assert all(n > 1 for counts in sent.shared.values() for n in counts.values())
    assert set(state._reservations.replicas()) == {f.replica_id for f in naive.in_flight.values()}
    assert set(state._sent.replicas()) == {p.replica_id for p in naive.sent.values()}
    for rid in REPLICAS:
        assert state.owned_blocks(rid) == naive.owned_blocks(rid)
        assert state.reserved_blocks(rid) == sum(
            f.blocks for f in naive.in_flight.values() if f.replica_id == rid
        )
    # Every query, under reports older and newer than the sends, now and later.
    for ld in random_loads(rng, now):
        for at in (now, now + rng.uniform(0.0, 40.0)):
            assert state.pending_load(ld, CFG, at) == naive.pending_load(ld, CFG, at)
            assert state.pending(ld, CFG, at) == naive.pending(ld, CFG, at)
            assert state.prefill_backlog(ld, CFG, at) == naive.prefill_backlog(ld, CFG, at)
            held = state.sent_hashes(ld, CFG, at)
            assert {h for h in range(50) if h in held} == naive.sent_hashes(ld, CFG, at)


@pytest.mark.parametrize("seed", range(6))
def test_incremental_state_equals_a_recomputation_and_chooses_the_same(seed: int) -> None:
    rng = random.Random(seed)
    state, naive = RouterState(memory_blocks=64), Naive(memory_blocks=64)
    now, ids = 100.0, [f"q{i}" for i in range(40)]
    for step in range(600):
        now += rng.uniform(-0.5, 0.6) if rng.random() < 0.1 else rng.uniform(0.0, 0.3)
        event = rng.random()
        if event < 0.4:  # a choice, routed as the adapter routes it
            loads = random_loads(rng, now)
            request = random_request(rng, rng.choice(ids))
            if rng.random() < 0.8:  # the adapter reconciles first; a test may not
                state.reconcile(loads, CFG, now)
                naive.reconcile(loads, CFG, now)
            # Every replica's pending terms are what a recomputation gives.
            for ld in loads:
                assert state.pending_load(ld, CFG, now) == naive.pending_load(ld, CFG, now)
                assert state.prefill_backlog(ld, CFG, now) == naive.prefill_backlog(ld, CFG, now)
                held = state.sent_hashes(ld, CFG, now)
                assert {h for h in range(50) if h in held} == naive.sent_hashes(ld, CFG, now)
            d = choose_replica(request, loads, state, CFG, random.Random(step), now)
            ref = choose_replica(request, loads, naive, CFG, random.Random(step), now)  # type: ignore[arg-type]
            assert d == ref
            rid = d.replica_id
            for s in (state, naive):
                s.on_routed(
                    request.request_id,
                    rid,
                    d.cost_blocks[rid],
                    now,
                    request.prompt_block_hashes,
                    d.owner,
                    d.prefill_tokens[rid],
                )
        elif event < 0.6:
            rid = rng.choice(ids)
            state.on_completed(rid)
            naive.on_completed(rid)
        elif event < 0.7:
            rid = rng.choice(ids)
            state.withdraw(rid)
            naive.withdraw(rid)
        elif event < 0.9:
            loads = random_loads(rng, now)
            state.reconcile(loads, CFG, now)
            naive.reconcile(loads, CFG, now)
        elif event < 0.93:
            live = set(rng.sample(REPLICAS, 3))
            state.retain(live)
            naive.retain(live)
        elif event < 0.96:  # a scale-in: the leavers' chains handed to their holders first
            survivors = random_loads(rng, now)
            plan = hand_off_and_retain(state, survivors, CFG, random.Random(step), now)
            for rid, chains in plan.items():
                naive.ownership.hand_off(rid, chains)
                assert set(chains.values()) <= {ld.replica_id for ld in survivors}
            naive.retain({ld.replica_id for ld in survivors})
        else:
            gone = rng.choice(REPLICAS)
            state.forget_replica(gone)
            naive.retain(lambda r, gone=gone: r != gone)
        assert_same(state, naive, rng, now)


def test_a_report_includes_the_oldest_sends_even_after_the_clock_stepped_back() -> None:
    state = RouterState()
    state.on_routed("q1", "a", 1, now=10.0, hashes=[1])
    state.on_routed("q2", "a", 2, now=12.0, hashes=[2])
    state.on_routed("q3", "a", 4, now=9.0, hashes=[3])  # the clock stepped back
    # A report taken at 11.5 includes what was sent up to 10.5: q3 and q1, not q2.
    report = ReplicaLoad("a", 50, 100, BS, timestamp=11.5)
    assert state.pending(report, CFG, now=12.0) == (2, 1)
    held = state.sent_hashes(report, CFG, now=12.0)
    assert (1 in held, 2 in held, 3 in held) == (False, True, False)
    state.reconcile([report], CFG, now=12.0)
    assert set(state.in_flight) == set(state.sent) == {"q2"}
    assert state.pending(report, CFG, now=12.0) == (2, 1)


def test_finished_requests_leave_nothing_behind_without_any_report() -> None:
    """Completions never reconciled (no replica reports) do not pile up: a replica's
    order of sends is compacted as its entries finish, and dropped with the last."""
    state = RouterState()
    for i in range(1000):
        state.on_routed(f"q{i}", "a", 3, now=float(i))
        if i >= 4:
            state.on_completed(f"q{i - 4}")
        sends = state._reservations._by_replica["a"]
        assert len(sends.items) - sends.head <= 2 * 5 + 1
    assert (state.reserved_blocks("a"), len(state.in_flight)) == (12, 4)
    for i in range(996, 1000):
        state.on_completed(f"q{i}")
    assert state._reservations._by_replica == {}
    assert state._reservations.blocks == state._reservations.count == {}
    assert state.replicas() == set()


def test_an_owned_run_follows_the_owners_as_they_change() -> None:
    """`owned_run` answers the leading run the replica owns; a send that moves any owner,
    or a hand-off, changes it."""
    state = RouterState()
    prompt = tuple(range(100, 110))
    state.on_routed("a", "r1", 10, 0.0, prompt)
    assert state.owned_run(prompt, "r1") == 10
    state.on_routed("b", "r2", 3, 1.0, prompt[:3])  # the first three blocks move to r2
    assert state.owned_run(prompt, "r1") == 0
    assert state.owned_run(prompt, "r2") == 3
    state.hand_off("r2", {100: "r1"})  # r2's chain rooted at 100 goes back to r1
    assert state.owned_run(prompt, "r1") == 10
