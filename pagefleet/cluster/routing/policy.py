"""The most_free_blocks routing policy: each request goes to the replica that would have
the most free KV blocks left after taking it, its prompt's cached blocks and ownership
counted. Pure functions over explicit state (`state.RouterState`) with an injected random
generator and clock; no Ray here. The rationale and the figures behind each term and
default are in docs/routing.md.

Inputs. Every replica reports (`reports.ReplicaLoad`) its free and total blocks, block
size, running and waiting counts, demand, prefill backlog, a digest of the block hashes in
its prefix cache, its hash salt and the snapshot's time. The request brings its prompt's
block hashes (`pagefleet.engine.block_hashes`, as the replicas' block managers hash),
`max_tokens` and its sample count (`RouteRequest`).

Score. On replica r with block size bs, a request of `samples` sequences needs

    need = ceil((prompt_tokens + max_tokens) / bs) + (samples - 1) * ceil(max_tokens / bs)

blocks (`blocks_needed`), of which its leading prompt blocks in r's digest, or sent to r
since its report, are hits (at most `(prompt_tokens - 1) // bs`; `prefix_hits`):

    f(r)       = free(r) - demand(r) - in_flight(r)                       (free_now)
    room(r)    = min(f(r), H(r)) + round(headroom_block_weight * max(0, f(r) - H(r))),
                 H(r) = round(memory_headroom * total(r))                 (`room`)
    backlog(r) = round(prefill_weight * ceil(prefill_tokens(r) / bs))     (`backlog_blocks`)
    score(r)   = room(r) - (need - hits(r)) + owner_bonus(r) - backlog(r) (`score`)

where `in_flight(r)` and the backlog's sends since the report are this router's
(`RouterState.pending_load`, `RouterState.prefill_backlog`: drained at r's rate,
`prefill_drain`), and `owner_bonus(r) = round(affinity_owner_weight * min(hits(r),
owner_run))` on the replica that owns the prompt's first block (`RouterState.owners`),
0 elsewhere. Past the cap (`FleetView.within_cap`: load, less the request's hits
there as a share of the pool (`cap_load`: a replica that must compute them would hold a
copy), more than `affinity_max_load_gap` above the least loaded's, or a reported waiting queue more than
`affinity_max_waiting_gap` above the shortest) a replica scores
`room(r) - need - backlog(r)`: no hits, no ownership.

A new prompt (one with no hits on any replica) is scored with room(r) - kept(r) in place
of room(r), kept(r) = round(new_prompt_kept_weight * min(owned(r), total(r)))
(`kept_blocks`): the prompt blocks last sent to r (`RouterState.owned_blocks`), which
its cache keeps for their later requests though free blocks count them as free. So new
prompts spread over the replicas' caches instead of evicting the prompts a replica
holds; a prompt already held anywhere is placed as before.

Ranking. By score, then more free blocks (f), then fewer waiting (reported plus sent
since), then a draw of the injected `random.Random` per replica (never list order). The
result is a full ranking: the adapter falls back down it when Serve finds a replica's
queue full. With no report at all, fewest requests sent wins.

Invariants:

- A replica not yet reported is filled in as having nothing running, waiting or queued,
  the largest reported pool (its block size and hash salt), and as many free blocks as
  the freest reported replica
  (`filled_in`); its reservations count from the first request it is sent.
- Ownership moves with a prompt only when its owner no longer holds it: a spill past the
  cap keeps the owner (`RouteDecision.owner`).
- A choice costs O(replicas + prompt blocks) look-ups, whatever is in flight
  (`RouterState` keeps running totals per replica).

`round_robin_ranking` is the comparison baseline with no load signal; power of two
choices is Serve's own router (`serve_routers.PowerOfTwoRouter`).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Container, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from pagefleet.cluster.routing.config import RoutingConfig
from pagefleet.cluster.routing.reports import ReplicaLoad
from pagefleet.cluster.routing.state import RouterState
from pagefleet.engine import DigestView, block_hashes, salted


@dataclass(frozen=True)
class RouteRequest:
    """What the router knows of one request.

    `prompt_block_hashes` are the chained hashes of the prompt's full blocks
    under `hash_salt` (which fixes the block size), mixed with the request's
    `cache_salt` as the block manager mixes it; hits are counted only on
    replicas that report the same salt. `num_samples`: the sequences the
    engine generates for it (`best_of` if set, else `n`).
    """

    request_id: str
    prompt_tokens: int
    max_tokens: int
    prompt_block_hashes: tuple[int, ...] = ()
    hash_salt: int | None = None
    num_samples: int = 1

    def __post_init__(self) -> None:
        if self.prompt_tokens < 0 or self.max_tokens < 0:
            raise ValueError("prompt_tokens and max_tokens must be >= 0")
        if self.num_samples < 1:
            raise ValueError("num_samples must be >= 1")

    @classmethod
    def from_prompt(
        cls,
        request_id: str,
        token_ids: Sequence[int],
        max_tokens: int,
        block_size: int | None,
        hash_salt: int | None,
        num_samples: int = 1,
        cache_salt: str | None = None,
    ) -> RouteRequest:
        hashes: tuple[int, ...] = ()
        if block_size and hash_salt is not None:
            root = salted(hash_salt, cache_salt)
            hashes = tuple(block_hashes(token_ids, block_size, root))
        return cls(request_id, len(token_ids), max_tokens, hashes, hash_salt, num_samples)


def blocks_needed(request: RouteRequest, block_size: int) -> int:
    """Blocks `request` takes if every sample runs to max_tokens, none cached: the prompt
    once (the samples share it copy-on-write), each sample's output on its own; as the
    engine's `num_demand_blocks` counts it."""
    first = -(-(request.prompt_tokens + request.max_tokens) // block_size)
    if request.prompt_tokens <= 1:
        # Nothing to share: the engine starts such samples apart, each a whole sequence.
        return request.num_samples * first
    return first + (request.num_samples - 1) * -(-request.max_tokens // block_size)


@dataclass(frozen=True)
class RouteDecision:
    """A ranking of replica ids, best first, and what the request costs on each."""

    ranking: tuple[str, ...]
    cost_blocks: Mapping[str, int]  # blocks it would take there (need - real hits)
    hit_blocks: Mapping[str, int]  # prompt blocks found in that replica's digest
    free_after: Mapping[str, int]  # the score: with hits and ownership where the cap allows
    # Who owns the prompt's blocks after this request, whoever takes it: their owner
    # while it still holds them (a spill past the cap does not move a prompt); None:
    # the replica that takes it.
    owner: str | None = None
    # Prompt tokens it would compute there (less its real hits): its reservation's share
    # of that replica's prefill backlog (`RouterState.on_routed`).
    prefill_tokens: Mapping[str, int] = field(default_factory=dict)

    @property
    def replica_id(self) -> str:
        return self.ranking[0]


def prefix_hits(
    request: RouteRequest, load: ReplicaLoad, sent: Container[int] = frozenset()
) -> int:
    """Leading prompt blocks in `load`'s digest (or `sent` there since) that the engine
    would reuse."""
    if request.hash_salt is None or load.hash_salt != request.hash_salt:
        return 0
    usable = max(0, (request.prompt_tokens - 1) // load.block_size)
    hashes, digest = request.prompt_block_hashes, load.prefix_digest
    hits = 0
    if isinstance(digest, DigestView):
        # The leading run in the digest alone, tested at once; at its first miss only
        # `sent` can go on (most replicas: the prompt's first block, in neither).
        hits = digest.leading_run(hashes, usable)
        if hits >= usable or hashes[hits] not in sent:
            return hits
    for h in itertools.islice(hashes, hits, usable):
        # `sent` first: a dict look-up, where the digest (a Bloom filter) hashes h again.
        if h not in sent and h not in digest:
            break  # the engine reuses only a contiguous prefix
        hits += 1
    return hits


def filled_in(loads: Sequence[ReplicaLoad], reported: Sequence[ReplicaLoad]) -> list[ReplicaLoad]:
    """`loads` with each unreported replica's view filled in.

    An unreported replica (a scale-out's, before its first report) has nothing running,
    waiting or queued, and the largest reported pool, block size and hash salt (the same
    model hashes its blocks the same way, so the prompts it is sent before its first
    report count as its hits); its free blocks are the most any
    reported replica has free, not its whole pool: "empty" would outbid every holder of
    a prompt by the blocks their running requests hold and pull held prompts off their
    owners, where "as free as the freest" leaves it the new prompts (it has no demand
    and no backlog) and lets a held prompt go to it only as it would to the freest
    replica. Its reservations count from the first request it is sent."""
    if len(reported) == len(loads):  # every replica reported (most choices): nothing to fill
        return list(loads)
    model = max(reported, key=lambda ld: ld.total_blocks)
    freest = min(max(ld.free_blocks for ld in reported), model.total_blocks)
    return [
        ld
        if ld.reported
        else ReplicaLoad(
            ld.replica_id,
            freest,
            model.total_blocks,
            model.block_size,
            hash_salt=model.hash_salt,
        )
        for ld in loads
    ]


@dataclass(frozen=True)
class ReplicaTerms:
    """One replica as a choice reads it: its report (unreported ones filled in,
    `filled_in`) and what this router sent it since (`RouterState`)."""

    load: ReplicaLoad
    free_now: int  # free less demand and in-flight reservations: f(r)
    room: int  # f(r), past memory_headroom of the pool discounted: room(r)
    room_new: int  # room(r) as a new prompt reads it: less kept(r)
    waiting: int  # reported waiting plus requests sent since: a tie-break
    backlog: int  # the prefill backlog in blocks, weighted by prefill_weight
    load_frac: float  # used fraction after demand and in-flight: what the cap reads
    sent: Container[int]  # prompt hashes sent since the report (`RouterState.sent_hashes`)


def room(free_now: int, total_blocks: int, config: RoutingConfig) -> int:
    """Free blocks as a score counts them: in full up to memory_headroom of the pool,
    each past it headroom_block_weight."""
    headroom = round(config.memory_headroom * total_blocks)
    past = round(config.headroom_block_weight * max(0, free_now - headroom))
    return min(free_now, headroom) + past


def kept_blocks(owned: int, total_blocks: int, config: RoutingConfig) -> int:
    """What a new prompt is charged on a replica for the prompt blocks it keeps: those
    last sent to it, at most its pool, each new_prompt_kept_weight."""
    return round(config.new_prompt_kept_weight * min(owned, total_blocks))


def backlog_blocks(prefill_tokens: int, block_size: int, config: RoutingConfig) -> int:
    """The prefill backlog's cost in free blocks: its blocks times prefill_weight."""
    return round(config.prefill_weight * -(-prefill_tokens // block_size))


def owner_bonus(hits: int, owner_run: int, config: RoutingConfig) -> int:
    """What the owner of a prompt's leading blocks gains for the run it holds."""
    return round(config.affinity_owner_weight * min(hits, owner_run))


def replica_terms(
    view: ReplicaLoad, state: RouterState, config: RoutingConfig, now: float
) -> ReplicaTerms:
    """`view`'s terms, with this router's pending sends there (`RouterState`)."""
    pending = state.pending_load(view, config, now)
    free = view.free_blocks - view.demand_blocks - pending.blocks
    tokens = state.prefill_backlog(view, config, now)
    kept = kept_blocks(state.owned_blocks(view.replica_id), view.total_blocks, config)
    free_room = room(free, view.total_blocks, config)
    return ReplicaTerms(
        load=view,
        free_now=free,
        room=free_room,
        room_new=free_room - kept,
        waiting=view.waiting + pending.requests,
        backlog=backlog_blocks(tokens, view.block_size, config),
        load_frac=1.0 - free / view.total_blocks,
        sent=state.sent_hashes(view, config, now),
    )


@dataclass(frozen=True)
class FleetView:
    """Every replica's terms (`ReplicaTerms`, by replica id, in the loads' order) and
    the least loaded's load and reported queue: what the cap compares with."""

    terms: dict[str, ReplicaTerms]
    min_load: float
    min_queued: int
    least: str  # the least loaded replica (the first of them)

    def within_cap(self, replica_id: str, config: RoutingConfig, hits: int = 0) -> bool:
        """Whether affinity may pull a request onto the replica: after taking it, it is
        not much busier than the least busy one would be after taking it (its load and
        its reported waiting queue). `hits`: the prompt blocks it holds that the least
        busy one does not (would have to compute, a copy), credited to it (`cap_load`)."""
        t = self.terms[replica_id]
        return (
            cap_load(t, hits) <= self.min_load + config.affinity_max_load_gap
            and t.load.waiting <= self.min_queued + config.affinity_max_waiting_gap
        )


def cap_load(t: ReplicaTerms, hits: int) -> float:
    """The load the cap compares: the replica's, less the pool's share of the request's
    `hits` there that the least loaded replica would have to compute (a copy of them)."""
    return t.load_frac - hits / t.load.total_blocks


def fleet_view(
    loads: Sequence[ReplicaLoad], state: RouterState, config: RoutingConfig, now: float
) -> FleetView:
    """The fleet as a choice (or a hand-off) reads it; some replica has reported."""
    views = filled_in(loads, [ld for ld in loads if ld.reported])
    terms = {v.replica_id: replica_terms(v, state, config, now) for v in views}
    least = min(terms.values(), key=lambda t: t.load_frac)
    return FleetView(terms, least.load_frac, min(v.waiting for v in views), least.load.replica_id)


def score(
    t: ReplicaTerms, need: int, hits: int, owned_bonus: int, capped: bool, new: bool = False
) -> int:
    """score(r): room (a `new` prompt's: less what r keeps) less the blocks the request
    costs there and the backlog; within the cap its hits cost nothing and its owner
    gains `owned_bonus`."""
    base = t.room_new if new else t.room
    if not capped:
        return base - need - t.backlog
    return base - (need - hits) + owned_bonus - t.backlog


def _by_fewest_sent(
    request: RouteRequest,
    loads: Sequence[ReplicaLoad],
    state: RouterState,
    config: RoutingConfig,
    rng: random.Random,
    now: float,
) -> RouteDecision:
    """No replica has reported: the fewest requests sent first."""
    counts = {ld.replica_id: state.pending_load(ld, config, now).requests for ld in loads}
    order = sorted(loads, key=lambda ld: (counts[ld.replica_id], rng.random()))
    ids = tuple(ld.replica_id for ld in order)
    zeros = dict.fromkeys(ids, 0)
    return RouteDecision(
        ids, zeros, zeros, zeros, prefill_tokens=dict.fromkeys(ids, request.prompt_tokens)
    )


def choose_replica(
    request: RouteRequest,
    loads: Sequence[ReplicaLoad],
    state: RouterState,
    config: RoutingConfig,
    rng: random.Random,
    now: float,
) -> RouteDecision:
    """Rank `loads` for `request` by the most_free_blocks policy (module docstring)."""
    if not loads:
        raise ValueError("no replicas to choose from")
    if not any(ld.reported for ld in loads):
        return _by_fewest_sent(request, loads, state, config, rng, now)
    fv = fleet_view(loads, state, config, now)
    # Ownership counts from a prompt's first block, so only that block's owner can own
    # a leading run.
    hashes = request.prompt_block_hashes
    owner = state.owners.get(hashes[0]) if hashes else None
    owner_run = state.owned_run(hashes, owner) if owner is not None else 0
    cost: dict[str, int] = {}
    hits: dict[str, int] = {}
    prefill: dict[str, int] = {}
    scores: dict[str, int] = {}
    for rid, t in fv.terms.items():
        hits[rid] = prefix_hits(request, t.load, t.sent)
    new = not any(hits.values())
    for rid, t in fv.terms.items():
        need = blocks_needed(request, t.load.block_size)
        hit = hits[rid]
        cost[rid] = need - hit
        prefill[rid] = max(0, request.prompt_tokens - hit * t.load.block_size)
        bonus = owner_bonus(hit, owner_run, config) if rid == owner else 0
        within = fv.within_cap(rid, config, hit - hits[fv.least])
        scores[rid] = score(t, need, hit, bonus, within, new)
    # Ties: more free blocks, then fewer waiting, then the injected rng (drawn once per
    # replica in order), never list order.
    order = sorted(
        fv.terms.values(),
        key=lambda t: (-scores[t.load.replica_id], -t.free_now, t.waiting, rng.random()),
    )
    # A spill (the owner past the cap) leaves the prompt with its owner while the owner
    # still holds it.
    keeps = owner_run > 0 and owner in hits and hits[owner] >= owner_run
    return RouteDecision(
        tuple(t.load.replica_id for t in order),
        cost,
        hits,
        scores,
        owner if keeps else None,
        prefill,
    )


def round_robin_ranking(replica_ids: Iterable[str], counter: int) -> tuple[str, ...]:
    """Replicas in a fixed (sorted) order, rotated by `counter`: the i-th request's first
    choice is the (i mod n)-th replica, the rest follow as fallbacks."""
    ids = sorted(replica_ids)
    if not ids:
        return ()
    k = counter % len(ids)
    return tuple(ids[k:] + ids[:k])
