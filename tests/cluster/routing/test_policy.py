"""most_free_blocks: exact choices and reservations, random ties, the affinity cap, stale stats."""

from __future__ import annotations

import random
from collections import Counter
from types import SimpleNamespace

import pytest

from pagefleet.cluster.routing.config import RoutingConfig
from pagefleet.cluster.routing.ledger import InFlight
from pagefleet.cluster.routing.policy import (
    RouteRequest,
    blocks_needed,
    choose_replica,
    fleet_view,
    prefix_hits,
    round_robin_ranking,
)
from pagefleet.cluster.routing.reports import ReplicaLoad, routing_stats_from_engine
from pagefleet.cluster.routing.scale_in import (
    WarmUp,
    hand_off_and_retain,
    hand_off_plan,
    scale_in_notice_plan,
)
from pagefleet.cluster.routing.state import RouterState
from pagefleet.engine import SamplingParams
from pagefleet.engine.block_manager import BlockManager
from pagefleet.engine.prefix_hash import block_hashes, prefix_hash_salt
from pagefleet.engine.sequence import Sequence
from pagefleet.engine.stats import EngineStats
from pagefleet.engine.token_engine import TokenEngine

BS = 16
SALT = prefix_hash_salt("models/tiny", BS)
# Free blocks count in full (memory_headroom 1): the pools here are small and the tests
# about free blocks assert their exact figures; the headroom has its own test.
CFG = RoutingConfig(memory_headroom=1.0)


def load(rid: str, free: int, total: int = 100, waiting: int = 0, **kw: object) -> ReplicaLoad:
    return ReplicaLoad(rid, free, total, BS, waiting=waiting, hash_salt=SALT, **kw)  # type: ignore[arg-type]


def req(tokens: list[int], max_tokens: int = 0, rid: str = "r", samples: int = 1) -> RouteRequest:
    return RouteRequest.from_prompt(rid, tokens, max_tokens, BS, SALT, samples)


def test_picks_the_replica_with_most_free_blocks_after_the_request() -> None:
    loads = [load("a", 40), load("b", 60), load("c", 50)]
    d = choose_replica(
        req(list(range(40)), max_tokens=24), loads, RouterState(), CFG, random.Random(0), 0.0
    )
    # 40 + 24 tokens = 4 blocks everywhere: 36, 56, 46 left.
    assert d.ranking == ("b", "c", "a")
    assert dict(d.free_after) == {"a": 36, "b": 56, "c": 46}
    assert dict(d.cost_blocks) == {"a": 4, "b": 4, "c": 4}


def test_samples_reserve_their_own_output_blocks_and_share_the_prompt() -> None:
    prompt = list(range(40))  # 2 full blocks + 8 tokens
    loads = [load("a", 40, prefix_digest=frozenset(block_hashes(prompt, BS, SALT))), load("b", 60)]
    # n=8 (or best_of=8) of 24 tokens: ceil(64 / 16) = 4 for the first sample, prompt
    # included, and 7 x ceil(24 / 16) = 14 for the other samples' outputs.
    d = choose_replica(req(prompt, 24, samples=8), loads, RouterState(), CFG, random.Random(0), 0.0)
    assert dict(d.cost_blocks) == {"a": 18 - 2, "b": 18}  # a holds the 2 full prompt blocks
    assert dict(d.free_after) == {"a": 40 - 16, "b": 60 - 18}
    assert blocks_needed(req(prompt, 24), BS) == 4  # one sample: as before
    # A one-token prompt has nothing to share: the engine starts the samples apart.
    assert blocks_needed(req([7], 16, samples=4), BS) == 4 * 2
    with pytest.raises(ValueError, match="num_samples"):
        RouteRequest("r", 1, 1, num_samples=0)


@pytest.mark.parametrize(
    ("prompt_len", "max_tokens", "samples"),
    [(40, 24, 8), (40, 30, 3), (64, 1, 2), (17, 100, 5), (1, 16, 4), (33, 16, 1)],
)
def test_reservations_match_what_the_engine_counts_in_demand_blocks(
    prompt_len: int, max_tokens: int, samples: int
) -> None:
    """A waiting request's `num_demand_blocks` (the replica's next report) equals what the
    router reserved for it: prompt blocks once, each sample's output on its own."""
    params = SamplingParams(max_tokens=max_tokens, n=samples)
    seq = Sequence("q", list(range(prompt_len)), params)
    waiting = [seq]
    if samples > 1 and prompt_len > 1:
        seq.num_forks_pending = samples - 1  # as TokenEngine.add_request sets it
    elif samples > 1:
        waiting += [seq.fork(i) for i in range(1, samples)]
    engine = SimpleNamespace(
        block_manager=BlockManager(256, BS, hash_salt=SALT),
        capacity=SimpleNamespace(max_model_len=4096),
        scheduler=SimpleNamespace(running=[], waiting=waiting),
        _awaiting_grammar_seqs=lambda: [],  # no constrained request compiling its grammar
    )
    demand = TokenEngine._demand_blocks(engine)  # type: ignore[arg-type]
    assert blocks_needed(req(list(range(prompt_len)), max_tokens, samples=samples), BS) == demand


def test_prefix_blocks_held_cost_nothing() -> None:
    prompt = list(range(100))  # 6 full blocks + 4 tokens
    hashes = block_hashes(prompt, BS, SALT)
    # a holds the first 5 blocks of the prompt; b has 3 more free blocks and nothing cached.
    loads = [load("a", 50, prefix_digest=frozenset(hashes[:5])), load("b", 53)]
    d = choose_replica(req(prompt, max_tokens=28), loads, RouterState(), CFG, random.Random(0), 0.0)
    # need = ceil(128 / 16) = 8; a: 50 - (8 - 5) = 47; b: 53 - 8 = 45.
    assert d.ranking == ("a", "b")
    assert dict(d.hit_blocks) == {"a": 5, "b": 0}
    assert dict(d.cost_blocks) == {"a": 3, "b": 8}


def test_hits_stop_at_the_first_miss_and_leave_the_last_token() -> None:
    prompt = list(range(64))  # exactly 4 full blocks
    hashes = block_hashes(prompt, BS, SALT)
    r = req(prompt)
    # The engine computes the last prompt token itself: at most (64 - 1) // 16 = 3 hits.
    assert prefix_hits(r, load("a", 10, prefix_digest=frozenset(hashes))) == 3
    # Only a contiguous prefix is reused.
    assert prefix_hits(r, load("a", 10, prefix_digest=frozenset(hashes[1:]))) == 0
    # Another model's (salt's) replica never counts hits.
    other = ReplicaLoad(
        "o", 10, 100, BS, hash_salt=prefix_hash_salt("other", BS), prefix_digest=frozenset(hashes)
    )
    assert prefix_hits(r, other) == 0


def test_ties_go_to_fewer_waiting_then_spread_at_random() -> None:
    loads = [load("a", 50, waiting=2), load("b", 50, waiting=1), load("c", 50, waiting=1)]
    firsts = Counter(
        choose_replica(
            req([1] * 20), loads, RouterState(), CFG, random.Random(seed), 0.0
        ).replica_id
        for seed in range(200)
    )
    assert set(firsts) == {"b", "c"}  # never a: more waiting
    assert min(firsts.values()) > 60  # and not list order


def test_a_burst_spreads_over_equal_replicas_by_reservation() -> None:
    """Between stats reports, the router's own reservations spread a burst exactly."""
    loads = [load("a", 50), load("b", 50)]
    state, rng = RouterState(), random.Random(7)
    chosen = []
    for i in range(6):
        d = choose_replica(req([1] * 30, max_tokens=34, rid=f"q{i}"), loads, state, CFG, rng, 1.0)
        chosen.append(d.replica_id)
        state.on_routed(f"q{i}", d.replica_id, d.cost_blocks[d.replica_id], 1.0)
    # Each request reserves 4 blocks; the replicas alternate, the first pick at random.
    assert sorted(chosen[0:2]) == sorted(chosen[2:4]) == sorted(chosen[4:6]) == ["a", "b"]
    assert state.reserved_blocks("a") == state.reserved_blocks("b") == 12
    # Both replicas take the first request of a burst for some seed.
    starts = {
        choose_replica(req([1] * 30), loads, RouterState(), CFG, random.Random(s), 1.0).replica_id
        for s in range(20)
    }
    assert starts == {"a", "b"}


def test_affinity_cap_stops_a_hot_prefix_piling_onto_one_replica() -> None:
    prompt = list(range(200))  # 12 full blocks
    hot = frozenset(block_hashes(prompt, BS, SALT))
    config = RoutingConfig(
        affinity_max_load_gap=0.25, affinity_max_waiting_gap=4, memory_headroom=1.0
    )
    state = RouterState()
    loads = [load("hot", 60, prefix_digest=hot), load("cold", 70)]
    # Within the gap (usage 0.40 vs 0.30): the cached prefix wins although cold has more free blocks.
    d = choose_replica(req(prompt, 56, "q0"), loads, state, config, random.Random(0), 0.0)
    assert d.replica_id == "hot"
    assert dict(d.free_after) == {"hot": 60 - (16 - 12), "cold": 70 - 16}
    # Hot is now much busier (usage 0.70 vs 0.30): affinity no longer counts there.
    loads = [load("hot", 30, prefix_digest=hot), load("cold", 70)]
    d = choose_replica(req(prompt, 56, "q1"), loads, state, config, random.Random(0), 0.0)
    assert d.replica_id == "cold"
    assert dict(d.free_after) == {"hot": 30 - 16, "cold": 70 - 16}
    assert d.cost_blocks["hot"] == 4  # were it chosen, it would still reuse its 12 blocks
    # The waiting gap caps it too, even at equal usage.
    loads = [load("hot", 60, waiting=6, prefix_digest=hot), load("cold", 60, waiting=1)]
    d = choose_replica(req(prompt, 56, "q2"), loads, state, config, random.Random(0), 0.0)
    assert d.replica_id == "cold"


def test_a_prompt_just_sent_counts_as_held_until_the_digest_shows_it() -> None:
    prompt = list(range(200))  # 12 full blocks + 8 tokens
    hashes = block_hashes(prompt, BS, SALT)
    state = RouterState()
    state.on_routed("q0", "a", 16, now=1.0, hashes=hashes)
    stale = [load("a", 60, timestamp=0.5), load("b", 60, timestamp=0.5)]
    d = choose_replica(req(prompt, 56, "q1"), stale, state, CFG, random.Random(0), 1.1)
    # Neither digest lists the prompt yet. a: 60 - 16 reserved - (16 - 12 hits) + 4 x 12
    # owned = 88; b: 60 - 16 = 44. Without the sent blocks a would score 28 and lose.
    assert d.ranking == ("a", "b")
    assert dict(d.hit_blocks) == {"a": 12, "b": 0}
    assert dict(d.free_after) == {"a": 88, "b": 44}
    # A report taken after the request arrived lists the blocks itself: the router's own
    # record of them is dropped, the ownership stays.
    fresh = [load("a", 44, timestamp=2.5, prefix_digest=frozenset(hashes)), stale[1]]
    state.reconcile(fresh, CFG, now=3.0)
    assert state.sent == {} and state.in_flight == {}
    assert state.owned_run(hashes, "a") == 12
    d = choose_replica(req(prompt, 56, "q2"), fresh, state, CFG, random.Random(0), 3.0)
    assert dict(d.free_after) == {"a": 44 - 4 + 4 * 12, "b": 60 - 16}
    # A choice withdrawn (its replica refused it) leaves nothing behind.
    state.on_routed("q3", "b", 16, now=3.0, hashes=hashes)
    state.withdraw("q3")
    assert state.sent == {} and state.in_flight == {}


def test_a_prompt_both_replicas_hold_stays_with_its_owner_within_the_cap() -> None:
    prompt = list(range(200))
    hashes = block_hashes(prompt, BS, SALT)
    digest = frozenset(hashes)
    state = RouterState()
    state.on_routed("q0", "a", 4, now=0.0, hashes=hashes)  # a was sent it last
    state.on_completed("q0")
    loads = [
        load("a", 40, prefix_digest=digest, timestamp=4.0),
        load("b", 56, prefix_digest=digest),
    ]
    cfg = RoutingConfig(affinity_max_load_gap=0.25, affinity_owner_weight=2.0, memory_headroom=1.0)
    d = choose_replica(req(prompt, 56, "q1"), loads, state, cfg, random.Random(0), 5.0)
    # Equal hits; a owns the prompt: 40 - 4 + 2 x 12 = 60 beats b's 56 - 4 = 52 although b
    # has 16 more free blocks. Without ownership the prompt's traffic would split by free
    # blocks.
    assert d.ranking == ("a", "b")
    assert dict(d.free_after) == {"a": 60, "b": 52}
    # Past the cap (usage 0.80 vs 0.44) a competes on free blocks alone; the prompt moves
    # to b, which becomes its owner.
    loads = [load("a", 20, prefix_digest=digest, timestamp=4.0), loads[1]]
    d = choose_replica(req(prompt, 56, "q2"), loads, state, cfg, random.Random(0), 5.0)
    assert d.ranking == ("b", "a")
    assert dict(d.free_after) == {"a": 20 - 16, "b": 52}
    # A spill: a still holds the prompt, so it keeps owning it and gets it back once it
    # has room again.
    assert d.owner == "a"
    state.on_routed("q2", "b", 4, now=5.0, hashes=hashes, owner=d.owner)
    assert state.owned_run(hashes, "a") == 12
    assert state.owned_run(hashes, "b") == 0
    # Once a has evicted it (its digest no longer lists it), the prompt moves whole to
    # the replica that takes it.
    loads = [load("a", 20, timestamp=6.5), load("b", 52, prefix_digest=digest, timestamp=6.5)]
    d = choose_replica(req(prompt, 56, "q3"), loads, state, cfg, random.Random(0), 7.0)
    assert (d.replica_id, d.owner) == ("b", None)
    state.on_routed("q3", "b", 4, now=7.0, hashes=hashes, owner=d.owner)
    assert state.owned_run(hashes, "b") == 12
    assert state.owned_run(hashes, "a") == 0


def test_a_short_prefix_every_prompt_shares_weighs_little() -> None:
    template = [7] * 16  # one block, say a chat template's opening, shared by every prompt
    first = template + list(range(100, 184))
    state = RouterState()
    state.on_routed("q0", "a", 7, now=0.0, hashes=block_hashes(first, BS, SALT))
    state.on_completed("q0")
    held = frozenset(block_hashes(template, BS, SALT))
    loads = [
        load("a", 50, prefix_digest=held, timestamp=4.0),
        load("b", 55, prefix_digest=held, timestamp=4.0),
    ]
    other = template + list(range(300, 384))  # another user's prompt: 8 blocks with 28 more
    d = choose_replica(req(other, 28, "q1"), loads, state, CFG, random.Random(0), 5.0)
    # Both reuse the template's block; a owns that one block only: 50 - 7 + 4 = 47 < 48.
    assert dict(d.hit_blocks) == {"a": 1, "b": 1}
    assert dict(d.free_after) == {"a": 47, "b": 48}
    assert d.replica_id == "b"


def test_ownership_memory_is_bounded_and_forgets_dead_replicas() -> None:
    state = RouterState(memory_blocks=3)
    state.on_routed("q0", "a", 1, now=0.0, hashes=[1, 2, 3, 4, 5])
    assert list(state.owners) == [3, 4, 5]  # least recently sent dropped first
    state.on_routed("q1", "b", 1, now=0.0, hashes=[3])
    assert list(state.owners.items()) == [(4, "a"), (5, "a"), (3, "b")]
    state.forget_replica("a")
    assert list(state.owners.items()) == [(3, "b")]
    assert set(state.in_flight) == set(state.sent) == {"q1"}
    with pytest.raises(ValueError, match="affinity_memory_blocks"):
        RoutingConfig(affinity_memory_blocks=-1)


def test_ownership_memory_grows_to_what_the_fleets_caches_hold() -> None:
    state = RouterState(memory_blocks=3)
    # Two replicas of 3 blocks each report: the fleet caches 6, so 6 owners are kept.
    state.reconcile([load("a", 3, total=3), load("b", 3, total=3)], CFG, now=0.0)
    assert state.fleet_blocks == 6
    state.on_routed("q0", "a", 1, now=0.0, hashes=[1, 2, 3, 4, 5, 6, 7, 8])
    assert list(state.owners) == [3, 4, 5, 6, 7, 8]
    # An unreported replica adds nothing; a smaller fleet than the floor keeps the floor.
    state.reconcile([load("a", 1, total=1), ReplicaLoad.unreported("c")], CFG, now=1.0)
    assert state.fleet_blocks == 1
    state.on_routed("q1", "a", 1, now=1.0, hashes=[9])
    assert list(state.owners) == [7, 8, 9]
    # A fleet larger than the ceiling keeps the ceiling.
    capped = RouterState(memory_blocks=2, memory_max_blocks=4)
    capped.reconcile([load("a", 9, total=9)], CFG, now=0.0)
    capped.on_routed("q0", "a", 1, now=0.0, hashes=[1, 2, 3, 4, 5, 6])
    assert list(capped.owners) == [3, 4, 5, 6]
    with pytest.raises(ValueError, match="affinity_owner_weight"):
        RoutingConfig(affinity_owner_weight=-1.0)


def test_retain_forgets_every_replica_not_offered_any_more() -> None:
    state = RouterState()
    for i in range(100):  # replicas come and go; each was sent a request and a prompt
        state.on_routed(f"q{i}", f"r{i}", 3, now=0.0, hashes=[1000 + i, 2000 + i])
        state.retain({f"r{i}", f"r{i - 1}"})  # the live set: this replica and the last
        assert state.replicas() <= {f"r{i}", f"r{i - 1}"}
    assert set(state.in_flight) == set(state.sent) == {"q98", "q99"}
    assert dict(state.owners) == {1098: "r98", 2098: "r98", 1099: "r99", 2099: "r99"}
    state.retain(lambda r: r == "r99")  # a predicate works too
    assert (set(state.in_flight), state.reserved_blocks("r99")) == ({"q99"}, 3)


def test_the_router_own_reservations_count_until_a_fresher_report() -> None:
    state = RouterState()
    cfg = RoutingConfig(stats_include_slack_s=1.0, memory_headroom=1.0)
    state.on_routed("q1", "a", 10, now=100.0)
    state.on_routed("q2", "a", 5, now=104.0)
    state.on_routed("q3", "b", 7, now=100.0)
    stale = load("a", 50, timestamp=99.0)
    assert state.pending(stale, cfg, now=105.0) == (15, 2)
    # A report taken at 101.5 includes q1 (sent at 100, + 1 s slack) but not q2.
    fresh = load("a", 40, timestamp=101.5)
    assert state.pending(fresh, cfg, now=105.0) == (5, 1)
    d = choose_replica(
        req([1] * 16, 0),
        [fresh, load("b", 45, timestamp=99.0)],
        state,
        cfg,
        random.Random(0),
        105.0,
    )
    assert dict(d.free_after) == {"a": 40 - 5 - 1, "b": 45 - 7 - 1}
    state.reconcile([fresh, load("b", 45, timestamp=99.0)], cfg, now=105.0)
    assert state.in_flight == {"q2": InFlight("a", 5, 104.0), "q3": InFlight("b", 7, 100.0)}
    state.on_completed("q3")
    state.on_completed("never-routed")  # rejected or cancelled requests: nothing to do
    assert set(state.in_flight) == {"q2"}
    # Reservations whose completion was never seen expire.
    state.reconcile([], cfg, now=104.0 + cfg.max_in_flight_age_s + 1)
    assert state.in_flight == {}


def test_demand_blocks_and_in_flight_count_as_used() -> None:
    state = RouterState()
    state.on_routed("q", "a", 8, now=0.0)
    loads = [load("a", 50, waiting=1, demand_blocks=6), load("b", 40)]
    d = choose_replica(req([1] * 16), loads, state, CFG, random.Random(0), 0.5)
    assert dict(d.free_after) == {"a": 50 - 6 - 8 - 1, "b": 39}
    assert d.ranking == ("b", "a")


def test_unreported_replicas_are_assumed_as_free_as_the_freest() -> None:
    """A replica that has not reported (a scale-out's) has nothing running or queued, the
    largest pool reported and the most free blocks any replica reports."""
    loads = [load("a", 30, total=80, demand_blocks=5), load("b", 20), ReplicaLoad.unreported("new")]
    d = choose_replica(req([1] * 16), loads, RouterState(), CFG, random.Random(0), 0.0)
    # new: 30 - 1 (a's free, not its whole pool of 100); a: 30 - 5 - 1; b: 20 - 1.
    assert d.ranking == ("new", "a", "b")
    assert dict(d.free_after) == {"a": 24, "b": 19, "new": 29}
    # Nobody reported: fewest in-flight requests first.
    state = RouterState()
    state.on_routed("q", "x", 0, now=0.0)
    loads = [ReplicaLoad.unreported("x"), ReplicaLoad.unreported("y")]
    assert choose_replica(req([1]), loads, state, CFG, random.Random(0), 0.0).ranking == ("y", "x")


def test_a_new_replica_takes_new_prompts_and_leaves_held_ones_with_their_owners() -> None:
    prompt = list(range(200))  # 12 full blocks + 8 tokens: need 16 blocks with 56 out
    hashes = block_hashes(prompt, BS, SALT)
    state = RouterState()
    state.on_routed("q0", "a", 4, now=0.0, hashes=hashes)
    state.on_completed("q0")
    loads = [
        load("a", 40, prefix_digest=frozenset(hashes), timestamp=4.0, demand_blocks=4),
        load("b", 60, timestamp=4.0, demand_blocks=4),
        ReplicaLoad.unreported("new"),
    ]
    # a's prompt: a scores 40 - 4 - 4 + 4 x 12 = 80; new, as free as b (60) with nothing
    # running, 60 - 16 = 44. Assumed empty (a pool of 100 free) it would score 84 and take
    # the prompt from the replica that holds it, to compute it again.
    d = choose_replica(req(prompt, 56, "q1"), loads, state, CFG, random.Random(0), 5.0)
    assert d.ranking == ("a", "new", "b")
    assert dict(d.free_after) == {"a": 80, "b": 40, "new": 44}
    # A new prompt (no hits, no owner anywhere) goes to the new replica first.
    other = list(range(1000, 1200))
    d = choose_replica(req(other, 56, "q2"), loads, state, CFG, random.Random(0), 5.0)
    assert d.ranking == ("new", "b", "a")
    assert (d.free_after["new"], d.owner) == (44, None)
    # Past the cap (a reports 12 waiting, 8 more than the shortest queue) the held prompt
    # spills, to the new replica, and stays a's: a still holds it.
    loads[0] = load("a", 40, prefix_digest=frozenset(hashes), timestamp=4.0, waiting=12)
    d = choose_replica(req(prompt, 56, "q3"), loads, state, CFG, random.Random(0), 5.0)
    assert (d.replica_id, d.owner) == ("new", "a")


def test_a_new_prompt_is_charged_the_prompt_blocks_a_replica_keeps() -> None:
    """Free blocks count a prompt cached and idle as free; a new prompt is charged the
    blocks last sent to each replica (`RouterState.owned_blocks`, at most its pool), so it
    goes where it evicts no prompt kept for later requests. A held prompt is not."""
    held = list(range(200))  # 12 full blocks + 8 tokens
    hashes = block_hashes(held, BS, SALT)
    state = RouterState()
    state.on_routed("q0", "a", 16, now=0.0, hashes=hashes)
    state.on_completed("q0")
    assert (state.owned_blocks("a"), state.owned_blocks("b")) == (12, 0)
    # a's report (after q0 ended) counts its 12 cached prompt blocks among its 70 free.
    loads = [
        load("a", 70, prefix_digest=frozenset(hashes), timestamp=4.0),
        load("b", 60, timestamp=4.0),
    ]
    new = req(list(range(1000, 1200)), 56, "q1")  # 16 blocks, no hits anywhere
    d = choose_replica(new, loads, state, CFG, random.Random(0), 5.0)
    # a: 70 - 12 kept - 16 = 42; b: 60 - 16 = 44.
    assert d.ranking == ("b", "a")
    assert dict(d.free_after) == {"a": 42, "b": 44}
    # Without the charge the new prompt would go to a, to evict the held one.
    free_only = RoutingConfig(memory_headroom=1.0, new_prompt_kept_weight=0.0)
    d = choose_replica(new, loads, state, free_only, random.Random(0), 5.0)
    assert (d.ranking, dict(d.free_after)) == (("a", "b"), {"a": 54, "b": 44})
    # The held prompt is scored as before: 70 - (16 - 12) + 4 x 12 on a, 60 - 16 on b.
    d = choose_replica(req(held, 56, "q2"), loads, state, CFG, random.Random(0), 5.0)
    assert (d.ranking, dict(d.free_after)) == (("a", "b"), {"a": 114, "b": 44})


def test_an_unreported_replica_counts_the_prompts_sent_to_it_as_hits() -> None:
    """A replica before its first report hashes its blocks as the reported ones do (the
    same model and block size): a prompt sent to it is its hit and stays its own."""
    prompt = list(range(200))
    loads = [load("a", 60, timestamp=0.0), ReplicaLoad.unreported("new")]
    state = RouterState()
    first = req(prompt, 56, "q0")
    d = choose_replica(first, loads, state, CFG, random.Random(0), 1.0)
    assert d.replica_id == "new"
    state.on_routed("q0", "new", d.cost_blocks["new"], 1.0, first.prompt_block_hashes)
    d = choose_replica(req(prompt, 56, "q1"), loads, state, CFG, random.Random(0), 1.1)
    assert dict(d.hit_blocks) == {"a": 0, "new": 12}
    assert d.replica_id == "new"


def test_a_burst_of_new_prompts_does_not_herd_onto_an_unreported_replica() -> None:
    """Each request sent to the new replica counts against it (its blocks and prompt
    tokens, `RouterState.pending_load`) until it reports: it takes the first, then shares."""
    loads = [
        load("a", 60, timestamp=4.0, demand_blocks=10),
        load("b", 60, timestamp=4.0, demand_blocks=10),
        ReplicaLoad.unreported("new"),
    ]
    state, rng, chosen = RouterState(), random.Random(3), []
    for i in range(9):
        r = req(list(range(1000 * i, 1000 * i + 200)), 56, f"q{i}")  # 9 different prompts
        d = choose_replica(r, loads, state, CFG, rng, 5.0)
        rid = d.replica_id
        state.on_routed(
            f"q{i}",
            rid,
            d.cost_blocks[rid],
            5.0,
            r.prompt_block_hashes,
            d.owner,
            d.prefill_tokens[rid],
        )
        chosen.append(rid)
    # 16 blocks and 13 backlog blocks (ceil(200 / 16)) a request: new starts at 60 - 16 =
    # 44, a and b at 60 - 10 - 16 = 34; each send takes ~29 off the score where it goes,
    # so new takes every third. (Assumed empty, 100 free, it took the first two: 84, 55.)
    assert chosen == ["new", "a", "b", "new", "b", "a", "new", "a", "b"]
    assert Counter(chosen) == {"new": 3, "a": 3, "b": 3}


def hand_off_fleet() -> tuple[RouterState, list[list[int]]]:
    """`gone` owns three prompt chains (12 blocks each, sent in that order); x owns a
    fourth."""
    prompts = [list(range(k * 1000, k * 1000 + 200)) for k in range(4)]
    state = RouterState()
    for k, p in enumerate(prompts):
        state.on_routed(f"q{k}", "x" if k == 3 else "gone", 4, 0.0, block_hashes(p, BS, SALT))
        state.on_completed(f"q{k}")
    return state, [block_hashes(p, BS, SALT) for p in prompts]


def test_a_leaving_replica_hands_each_chain_to_one_survivor_that_holds_it() -> None:
    state, (h0, h1, h2, h3) = hand_off_fleet()
    assert list(state.owned_chains("gone")) == [h0[0], h1[0], h2[0]]
    survivors = [
        # x and y both hold chains 0 and 1; y has 5 blocks more room. Nobody holds chain 2.
        load("x", 60, timestamp=4.0, prefix_digest=frozenset(h0 + h1 + h3)),
        load("y", 65, timestamp=4.0, prefix_digest=frozenset(h0 + h1)),
        load("z", 90, timestamp=4.0),
    ]
    plan = hand_off_and_retain(state, survivors, CFG, random.Random(0), 5.0)
    # Chain 0 to the holder with the most room (y); y's room less the 12 blocks handed to
    # it is then below x's, so chain 1 goes to x. z has the most room but holds neither.
    # Chain 2 is held nowhere: it is dropped, as before (ownership counts only as far as
    # a replica holds the prompt: its next request goes by load).
    assert plan == {"gone": {h0[0]: "y", h1[0]: "x"}}
    assert dict(state.owners) == {**dict.fromkeys(h0, "y"), **dict.fromkeys(h1 + h3, "x")}
    assert list(state.owners) == h0 + h1 + h3  # a hand-off keeps each hash's LRU place
    assert state.owning_replicas() == ["x", "y"] and state.replicas() == {"x", "y"}
    assert dict(state.owned_chains("x")) == {h3[0]: set(h3), h1[0]: set(h1)}
    # The next request for chain 0 stays on its new owner, with the ownership bonus:
    # y 65 - 4 + 4 x 12 = 109 against z's 90 - 16 = 74 (and x's 60 - 4 = 56: it holds the
    # prompt, not the ownership). Dropped, z would take it and compute it again: 74 > 61.
    d = choose_replica(req(list(range(200)), 56), survivors, state, CFG, random.Random(0), 5.0)
    assert (d.ranking, dict(d.free_after)) == (("y", "z", "x"), {"x": 56, "y": 109, "z": 74})
    dropped, _ = hand_off_fleet()
    dropped.retain({"x", "y", "z"})
    d = choose_replica(req(list(range(200)), 56), survivors, dropped, CFG, random.Random(0), 5.0)
    assert d.ranking == ("z", "y", "x")


def test_a_scale_in_notice_hands_held_chains_and_warms_the_reused_rest() -> None:
    """Chains a and b were each sent twice (a 10-block system prompt, then two different
    queries), c once; a survivor holds b. On the notice: b is handed to its holder, a is
    warmed on the survivor with the most room (its 10 shared blocks, not the query's), c
    is left (a root sent once is not worth a warm-up)."""
    system = {k: list(range(i * 1000, i * 1000 + 160)) for i, k in enumerate("abc")}  # 10 blocks
    state, last = RouterState(), {}
    for k, queries in (("a", 2), ("b", 2), ("c", 1)):
        for i in range(queries):
            prompt = system[k] + list(range(50_000 + 100 * i, 50_000 + 100 * i + 40))
            last[k] = block_hashes(prompt, BS, SALT)
            state.on_routed(f"{k}{i}", "gone", 4, 0.0, last[k])
            state.on_completed(f"{k}{i}")
    assert state.warm_prefix("gone", last["a"][0]) == tuple(last["a"][:10])
    assert state.warm_prefix("gone", last["c"][0]) == ()
    survivors = [
        load("x", 60, timestamp=4.0, prefix_digest=frozenset(last["b"][:10])),
        load("y", 65, timestamp=4.0),
        load("z", 90, timestamp=4.0),
    ]
    plan, warm = scale_in_notice_plan(["gone"], survivors, state, CFG, random.Random(0), 5.0)
    assert plan == {"gone": {last["b"][0]: "x"}}
    assert warm == [WarmUp("gone", last["a"][0], "z", tuple(last["a"][:10]))]
    # The plan changes nothing; the hand-off alone (no warm-ups) drops a and c.
    assert state.owning_replicas() == ["gone"]
    assert hand_off_plan(["gone"], survivors, state, CFG, random.Random(0), 5.0) == plan


def test_a_hand_off_skips_holders_past_the_cap_and_breaks_ties_at_random() -> None:
    state, (h0, h1, h2, _) = hand_off_fleet()
    both = frozenset(h0 + h1 + h2)
    survivors = [
        load("x", 60, timestamp=4.0, prefix_digest=both, waiting=20),  # past the waiting gap
        load("y", 30, timestamp=4.0, prefix_digest=frozenset(h1)),
        load("z", 30, timestamp=4.0, prefix_digest=frozenset(h1)),
    ]
    plan = hand_off_plan(["gone"], survivors, state, CFG, random.Random(0), 5.0)
    assert set(plan["gone"]) == {h1[0]}  # x holds all three, but is past the cap
    ties = {
        hand_off_plan(["gone"], survivors, state, CFG, random.Random(s), 5.0)["gone"][h1[0]]
        for s in range(20)
    }
    assert ties == {"y", "z"}  # equal room: the injected rng, never list order
    assert hand_off_plan(["gone"], [], state, CFG, random.Random(0), 5.0) == {}
    assert hand_off_plan(["nobody"], survivors, state, CFG, random.Random(0), 5.0) == {}
    # A survivor that has not reported holds what this router sent it since.
    state.on_routed("q9", "fresh", 4, 4.5, h2)
    state.on_routed("q10", "gone", 4, 4.6, h2)  # and then gone was sent it again
    plan = hand_off_plan(
        ["gone"], [ReplicaLoad.unreported("fresh")], state, CFG, random.Random(0), 5.0
    )
    assert plan == {"gone": {h2[0]: "fresh"}}


def test_stats_round_trip_through_the_replica_contract() -> None:
    bm = BlockManager(32, BS, hash_salt=SALT)
    s = Sequence("s", list(range(40)), SamplingParams())
    assert bm.allocate_prefilled(s, [], s.num_tokens)
    s.num_computed_tokens = s.num_tokens
    bm.cache_computed_blocks(s)
    stats = EngineStats(
        num_total_blocks=32,
        num_free_blocks=bm.num_free_blocks,
        block_size=BS,
        num_running=1,
        num_waiting=2,
        num_preemptions=0,
        prompt_tokens_total=40,
        generation_tokens_total=0,
        prefix_digest=bm.prefix_digest(),
        prefix_hash_salt=bm.hash_salt,
        num_demand_blocks=3,
    )
    d = routing_stats_from_engine(stats, now=12.5)
    ld = ReplicaLoad.from_routing_stats("a", d)
    assert (ld.free_blocks, ld.total_blocks, ld.block_size, ld.running, ld.waiting) == (
        29,
        32,
        BS,
        1,
        2,
    )
    assert (ld.demand_blocks, ld.timestamp, ld.hash_salt, ld.reported) == (3, 12.5, SALT, True)
    assert ld.prefill_done == 40  # the prompt tokens computed in all: the drain's rate
    # The router, hashing the same prompt, finds the replica's two cached blocks.
    assert prefix_hits(req([*range(40), 7]), ld) == 2
    assert not ReplicaLoad.from_routing_stats("a", {}).reported
    assert not ReplicaLoad.from_routing_stats("a", {"total_blocks": "x"}).reported


def test_round_robin_rotates_a_fixed_order() -> None:
    assert [round_robin_ranking(["b", "a", "c"], i)[0] for i in range(4)] == ["a", "b", "c", "a"]
    assert round_robin_ranking(["b", "a", "c"], 1) == ("b", "c", "a")
    assert round_robin_ranking([], 3) == ()


def test_config_validates() -> None:
    with pytest.raises(ValueError):
        RoutingConfig(policy="fastest")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        RoutingConfig(affinity_max_load_gap=1.5)
    with pytest.raises(ValueError):
        RoutingConfig(memory_headroom=0.0)
    with pytest.raises(ValueError):
        RoutingConfig(prefill_rate_window=-1)
    with pytest.raises(ValueError):
        RoutingConfig(headroom_block_weight=1.5)
    with pytest.raises(ValueError):
        ReplicaLoad("a", 5, 4, BS)
    with pytest.raises(ValueError):
        choose_replica(req([1]), [], RouterState(), CFG, random.Random(0), 0.0)


def test_a_prefill_backlog_costs_the_score_and_spills_a_held_prompt() -> None:
    """Free blocks do not show compute: a replica that holds a prompt but has long prompts
    still to prefill loses it once its backlog (reported plus sent since) outweighs the
    hits and ownership."""
    prompt = list(range(200))  # 12 full blocks + 8 tokens
    hashes = block_hashes(prompt, BS, SALT)
    digest = frozenset(hashes)
    state = RouterState()
    state.on_routed("q0", "a", 4, now=0.0, hashes=hashes)
    state.on_completed("q0")
    cfg = RoutingConfig(prefill_weight=1.0, memory_headroom=1.0)
    # a reports 320 prompt tokens to compute (20 blocks): 80 - 4 + 4 x 12 - 20 = 104 still
    # beats b's 80 - 16 = 64.
    loads = [
        load("a", 80, prefix_digest=digest, timestamp=4.0, prefill_tokens=320),
        load("b", 80, timestamp=4.0),
    ]
    d = choose_replica(req(prompt, 56, "q1"), loads, state, cfg, random.Random(0), 5.0)
    assert d.ranking == ("a", "b")
    assert dict(d.free_after) == {"a": 104, "b": 64}
    # The request computes 200 - 12 x 16 = 8 tokens on a, all 200 on b.
    assert dict(d.prefill_tokens) == {"a": 8, "b": 200}
    # What the router sent a since its report counts too: with 40 tokens reserved, the
    # backlog is ceil(360 / 16) = 23 blocks, and the send's 4 blocks are reserved: 97.
    state.on_routed("q1", "a", 4, 5.0, hashes, d.owner, d.prefill_tokens["a"] + 32)
    d = choose_replica(req(prompt, 56, "q2"), loads, state, cfg, random.Random(0), 5.0)
    assert dict(d.free_after) == {"a": 80 - 4 - 4 + 48 - 23, "b": 64}
    # A long backlog (a 1,000-token prompt mid prefill, plus the 40 sent: 65 blocks) spills
    # the prompt to b; ownership stays with a, which still holds it.
    loads = [
        load("a", 80, prefix_digest=digest, timestamp=4.0, prefill_tokens=1000),
        load("b", 80, timestamp=4.0),
    ]
    d = choose_replica(req(prompt, 56, "q3"), loads, state, cfg, random.Random(0), 5.0)
    assert d.ranking == ("b", "a")
    assert dict(d.free_after) == {"a": 80 - 4 - 4 + 48 - 65, "b": 64}
    assert d.owner == "a"
    # prefill_weight 0: blocks alone, as before the term.
    d = choose_replica(
        req(prompt, 56, "q3"),
        loads,
        state,
        RoutingConfig(prefill_weight=0.0, memory_headroom=1.0),
        random.Random(0),
        5.0,
    )
    assert dict(d.free_after) == {"a": 80 - 4 - 4 + 48, "b": 64}


def test_free_blocks_past_the_headroom_do_not_outbid_a_held_prompt() -> None:
    """On a large pool a few running requests move free blocks by more than a held prompt
    is worth: past `memory_headroom` of the pool they count no more."""
    prompt = list(range(321))  # 20 full blocks and one token: 21 blocks, 20 reusable
    hashes = block_hashes(prompt, BS, SALT)
    state = RouterState()
    state.on_routed("q0", "hold", 21, now=0.0, hashes=hashes)
    state.on_completed("q0")
    loads = [
        load("hold", 600, total=1000, prefix_digest=frozenset(hashes), timestamp=4.0),
        load("other", 900, total=1000, timestamp=4.0),
    ]
    # Every free block counts: other's 900 - 21 beats hold's 600 - 1 + 4 x 20.
    full = RoutingConfig(memory_headroom=1.0)
    d = choose_replica(req(prompt, 0, "q1"), loads, state, full, random.Random(0), 5.0)
    assert dict(d.free_after) == {"hold": 679, "other": 879}
    assert d.ranking == ("other", "hold")
    # The default headroom, half the pool: 500 count in full, each block past it 1/8
    # (hold 500 + 100 / 8, other 500 + 400 / 8), and the holder wins.
    d = choose_replica(req(prompt, 0, "q1"), loads, state, RoutingConfig(), random.Random(0), 5.0)
    assert dict(d.free_after) == {"hold": 512 - 1 + 80, "other": 550 - 21}
    assert d.ranking == ("hold", "other")


def test_a_backlog_drained_since_the_report_keeps_a_held_prompt_on_its_owner() -> None:
    """What the router sent a replica since its report drains at the replica's rate (the
    prefill tokens it computed between its last two reports, over their interval)."""
    prompt = list(range(321))
    hashes = block_hashes(prompt, BS, SALT)

    def free_after(config: RoutingConfig) -> dict[str, int]:
        state = RouterState()
        state.on_routed("q0", "hold", 21, now=0.0, hashes=hashes)
        state.on_completed("q0")
        for t, done in ((2.0, 0), (4.0, 40_000)):  # 20,000 prompt tokens a second
            loads = [
                load(
                    "hold",
                    1000,
                    total=1000,
                    prefix_digest=frozenset(hashes),
                    timestamp=t,
                    prefill_done=done,
                ),
                load("other", 1000, total=1000, timestamp=t, prefill_done=done),
            ]
            state.reconcile(loads, config, t)
        for i in range(3):  # 15,000 tokens of new prompts sent to hold since its report
            state.on_routed(f"n{i}", "hold", 10, 4.1, prefill_tokens=5_000)
        state.reconcile(loads, config, 5.0)
        d = choose_replica(req(prompt, 0, "q1"), loads, state, config, random.Random(0), 5.0)
        return dict(d.free_after)

    # Drained: 15,000 - 20,000 x 0.9 s is nothing left; hold's 500 + 470 / 8 - 1 + 80
    # wins over other's 500 + 500 / 8 - 21.
    assert free_after(RoutingConfig()) == {"hold": 638, "other": 541}
    # Without the rate (window 0) the 15,000 tokens count until a report has them: 938
    # blocks of backlog, and the prompt would leave its holder.
    assert free_after(RoutingConfig(prefill_rate_window=0)) == {"hold": 638 - 938, "other": 541}


def test_the_engine_reports_its_prefill_backlog() -> None:
    """`num_prefill_tokens`: a prompt mid chunked prefill counts what is left, a waiting
    one its tokens less the cached prefix, a decoding one nothing."""
    from pagefleet.engine.scheduler import Scheduler

    bm = BlockManager(64, BS, True, SALT)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, enable_chunked_prefill=True)
    engine = TokenEngine.__new__(TokenEngine)
    engine.block_manager, engine.scheduler = bm, sched
    engine._awaiting_grammar = {}  # no constrained request compiling its grammar
    params = SamplingParams(max_tokens=4)
    long = Sequence("long", list(range(100)), params)
    sched.add(long)
    out = sched.schedule()  # 64 of its 100 tokens this step
    sched.update(out, [None])
    assert engine._prefill_tokens() == 36
    waiting = Sequence("w", list(range(40)), params)
    sched.waiting.append(waiting)
    # The first 2 full blocks of "w" (tokens 0-31) are those "long" registered: 40 - 32.
    assert engine._prefill_tokens() == 36 + 8


def test_the_shared_run_of_two_prompts_counts_equal_hashes_not_only_the_same_objects() -> None:
    from pagefleet.cluster.routing.state import common_run

    a = (2**70, 2**70 + 1, 2**70 + 2, 7)
    copies = tuple(int(str(h)) for h in a)  # equal values, other objects
    assert copies[0] is not a[0]
    assert common_run(a, a) == 4
    assert common_run(a, (*a[:2], *copies[2:])) == 4  # same objects, then equal ones
    assert common_run(a, (*copies[:3], 8)) == 3
    assert common_run(a, a[:2]) == 2
    assert common_run((), a) == 0


def test_a_salted_prompt_is_hashed_as_its_replica_hashes_it() -> None:
    from pagefleet.cluster.replica_messages import ReplicaRequest
    from pagefleet.cluster.routing.serve_common import cache_salt_of

    salt = prefix_hash_salt("m", 4)
    ids = list(range(12))
    plain = RouteRequest.from_prompt("r", ids, 1, 4, salt)
    salted_request = RouteRequest.from_prompt("r", ids, 1, 4, salt, cache_salt="tenant-a")
    bm = BlockManager(16, 4, hash_salt=salt)
    seq = Sequence("s", ids, SamplingParams(), cache_salt="tenant-a")
    assert salted_request.prompt_block_hashes == tuple(bm.block_hashes(seq))
    assert salted_request.prompt_block_hashes != plain.prompt_block_hashes
    assert salted_request.hash_salt == salt  # still comparable with the replicas' reports
    # The router reads the salt off the handle call's request.
    call = ReplicaRequest("r", ids, SamplingParams(), cache_salt="tenant-a")
    assert cache_salt_of(SimpleNamespace(args=[call])) == "tenant-a"  # type: ignore[arg-type]
    assert cache_salt_of(SimpleNamespace(args=[ReplicaRequest("r", ids, SamplingParams())])) is None  # type: ignore[arg-type]


def test_the_cap_credits_the_holder_the_prompt_blocks_the_least_loaded_would_copy() -> None:
    """bench router's prefix scenario at 2 replicas of 128 blocks: the holder of a 36-block
    system prompt is computing it with a few requests queued behind; the other replica is
    idle. Spilling would cost the idle one a second copy of the prompt (and, on a small
    pool, preemptions later): the cap compares their loads after taking the request."""
    prompt = list(range(584))  # 36 full blocks of system prompt, a question
    hashes = block_hashes(prompt, BS, SALT)
    state = RouterState()
    state.on_routed("q0", "a", 0, now=0.0, hashes=hashes)
    state.on_completed("q0")
    cfg = RoutingConfig(affinity_max_load_gap=0.75)
    # a: 90 free less 42 of demand and 30 reserved since: load 0.86; b: idle, load 0.
    state.on_routed("q1", "a", 30, now=1.5)
    loads = [
        load("a", 90, total=128, demand_blocks=42, prefix_digest=frozenset(hashes), timestamp=1.0),
        load("b", 128, total=128, timestamp=1.0),
    ]
    state.reconcile(loads, cfg, 2.0)
    d = choose_replica(req(prompt, 32, "q2"), loads, state, cfg, random.Random(0), 2.0)
    # 0.86 - 36 / 128 = 0.58 after its hits: within 0.75 of b's 0, so a keeps it.
    assert d.hit_blocks == {"a": 36, "b": 0}
    assert d.ranking == ("a", "b")
    # Without the credit a would be past the cap (0.86 > 0.75) and lose it to b.
    fv = fleet_view(loads, state, cfg, 2.0)
    assert not fv.within_cap("a", cfg) and fv.within_cap("a", cfg, 36)
