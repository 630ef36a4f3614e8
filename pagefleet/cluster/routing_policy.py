"""Replica choice for the fleet, as pure functions over explicit state (no Ray here).

`choose_replica` implements the `most_free_blocks` policy: each request goes to
the replica that would have the most free KV blocks left after taking it.

Inputs. Every replica reports, through Serve's `record_routing_stats`
(`routing_stats_from_engine` builds the dict), its free and total blocks, block
size, running and waiting counts, a digest of the block hashes in its prefix cache,
the salt of its hash chains and the snapshot's time. The request brings its
prompt's token ids, `max_tokens` and its sample count (`best_of` if set, else `n`);
its prompt block hashes come from `pagefleet.engine.block_hashes`, the function the
replicas' block managers use (`RouteRequest.from_prompt`).

Scoring. On replica r with block size bs, a request of `samples` sequences needs

    need = ceil((prompt_tokens + max_tokens) / bs) + (samples - 1) * ceil(max_tokens / bs)

blocks (`blocks_needed`): the samples share the prompt copy-on-write, as the
engine's `num_demand_blocks` counts them, so a reservation matches what r's next
report counts. Its leading prompt blocks in r's digest are hits (at most
`(prompt_tokens - 1) // bs`: the last prompt token is always computed) and cost
nothing:

    f(r)     = free(r) - demand(r) - in_flight(r)
    room(r)  = min(f(r), H(r)) + headroom_block_weight * max(0, f(r) - H(r)),
               H(r) = memory_headroom * total(r)
    score(r) = room(r) - (need - hits(r)) + affinity_owner_weight * owner_blocks(r)
               - prefill_weight * ceil(backlog(r) / bs)

`demand(r)` is what r's own requests will still allocate if each runs to its
max_tokens; `in_flight(r)` the blocks this router sent r that r's latest report
does not count yet. `backlog(r)` is r's compute queue: the prompt tokens r reported
it has still to compute (`EngineStats.num_prefill_tokens`: prompts mid chunked
prefill, waiting prompts less their cached prefix) plus those of the requests this
router sent r since (each its prompt less its hits there, `RouteDecision.prefill_tokens`),
drained at the rate r computes prompts (`prefill_drain`: the reports are up to a stats
period old, and a GPU clears most of what it was sent long before its next report).

Why the headroom. Free blocks are worth keeping while they are scarce: a replica near
full preempts. On a large pool they are not, and a few running requests move them by
more than a held prompt is worth: at 16 simulated H200 replicas (51k blocks each) a
holder running three other tenants' requests has ~1,400 blocks fewer free than an idle
replica, against ~1,100 for its 6k-token prompt's hits and ownership, so a sixth of the
requests left replicas that held their prompt (p90 TTFT 0.134 s, one full prefill; 0.031
s with the headroom, every request but the first of a tenant a hit). Past
`memory_headroom` of the pool (default half) each free block counts
`headroom_block_weight` (1/8): between replicas with that much room, hits, ownership and
the backlog decide, and free blocks still order the rest (an idle replica still wins new
prompts over one running a long request). The cap below still reads the whole load.

Why the backlog. On a large pool (an H200 holds ~51k blocks of Llama-3.1-8B) free
blocks barely move with load: a replica that holds a hot prompt keeps winning on
hits and ownership while its requests queue behind one another's 7k-token prefills,
and neither cap binds (they are admitted, so they do not wait, and their blocks are a
few percent of the pool). The backlog is the signal Dynamo's KV router scores on
(prompt blocks still to compute). A prompt's hits and ownership are worth
(1 + affinity_owner_weight) blocks each, so with the default weights (owner 4, prefill
1) a holder keeps a prompt until its backlog exceeds another's by about 5 x the held
prompt: a 6k-token system prompt moves once ~30k more tokens queue there (a few prefill
steps). The simulator's before/after is in BENCHMARKS.md ("The fleet at 4-64 replicas,
simulated").

Why owner 4, not 2. The Gateway API Inference Extension's endpoint picker, in its
default profile, weighs its approximate prefix index at 3 against two load scores at 2
each, so a prompt all but never leaves the replica its index names. Simulated at 16 H200
replicas on llm-d's shared-prefix workload it matched this policy at 32 QPS and beat it
at 80 and 128 (p90 TTFT 0.038 against 0.042 s, 0.050 against 0.065 s): at owner weight
2 a few percent of the requests still left a holder for a short backlog and computed
their prompt again. At 4 the two tie at every rate (BENCHMARKS.md).

Ties go to the replica with more free blocks (after demand and reservations; the
headroom makes scores tie between replicas with room: a burst of new prompts still goes
to the idlest, and spreads as its reservations count), then to fewer waiting requests,
then to the injected `random.Random` (never list order, so a burst over equal replicas
spreads). The
result is a full ranking: the adapter falls back down it when Serve finds a
replica's queue full.

Invariants that keep a prompt on one replica:

- Hits count against the digest plus the prompt blocks this router sent r since
  r's last report (`RouterState.sent_hashes`): a burst on a new system prompt
  follows its first request instead of missing everywhere until the next report.
- Ownership: the router remembers, per prompt block hash, the replica it last sent
  the block to (`RouterState.owners`, an LRU of as many blocks as the fleet's caches
  hold, within bounds, so a prompt still cached keeps its owner). A replica that holds a
  prompt's leading blocks and owns them scores `affinity_owner_weight` (4) free
  blocks per block (`owner_blocks`). A spill past the cap leaves ownership with the
  owner while it still holds the prompt (`RouteDecision.owner`); a prompt moves
  only once its owner evicted it. A short prefix every prompt shares (a chat
  template's first block) weighs only a few blocks and herds nothing.
- The cap: hits and ownership count only for a replica whose load (used fraction
  after demand and in-flight) is within `affinity_max_load_gap` of the least-loaded
  replica's and whose reported waiting queue is within `affinity_max_waiting_gap`
  of the shortest; past it the replica competes on free blocks alone (its
  reservation still counts the hits it will reuse). The waiting queue is what
  stops a hot prefix: its holder queues requests first.

Stale stats. Serve polls replicas every `request_routing_stats_period_s` at best,
so `RouterState` remembers every request this router sent and has not seen finish,
with the blocks reserved and the time sent. A reservation ends when the request
completes, or when a report taken at least `stats_include_slack_s` after the send
arrives (that report counts the request). Each router (one per ingress replica)
sees its own traffic; the reports carry everyone's. With no report at all, fewest
in-flight wins. State is pruned to the replicas Serve still offers
(`RouterState.retain`), after a hand-off (below).

Scale-out: a replica that has not reported yet (a scale-out's, for its first stats
period) is assumed to have nothing running, waiting or queued, the largest pool any
replica reports, and as many free blocks as the freest reported replica: not its whole
pool. Assumed empty, it outbid every holder of a prompt by the blocks the holder's
running requests occupy (thousands on an H200 pool, against ~5 x 375 for a held 6k-token
prompt), so a burst's held prompts left their owners to be computed again on the new
replica, and it took the first few requests of any kind before its reservations evened
it out. As free as the freest, it still takes new prompts (no hits, no owner anywhere)
first: it has no demand and no backlog. A prompt held elsewhere goes to it only as it
would go to the freest reported replica: past the cap, or once the holder's backlog
outweighs the hits and ownership (a spill, so the owner keeps it). The herd is bounded
by its reservations: each request sent to it counts its blocks and prompt tokens against
it (`RouterState.pending_load`, every one of them until its first report), so it takes
new prompts until those even out its head start of the others' demand and backlog, then
shares (`test_a_burst_of_new_prompts_does_not_herd_onto_an_unreported_replica`).

Scale-in hand-off (`hand_off_and_retain`, `hand_off_plan`): a replica Serve stops
offering takes its ownership with it, and its prompts used to fall to whoever took their
next request by load, so a survivor that also held one (a spill copy, an older owner)
got no ownership bonus over a freer replica that must compute it again. Before its state
is dropped, each prompt chain the leaver owns (a chain root, a prompt's first block hash,
whose ownership it holds, with the blocks of it it owns, `RouterState.owned_chains`) goes
whole to ONE survivor that holds the chain's root (its digest, or what this router sent
it since its report) and is within the cap: of those, the one with the most room (free
blocks after demand and reservations, less the backlog, less the blocks of ownership
handed to it so far in this hand-off, so a leaver's chains spread over their holders),
then the shorter queue, then the injected rng; heaviest chain first. Its next request
then finds one owner that holds it. A chain no survivor holds is dropped as before:
ownership counts only as far as its owner holds the prompt, so handing it to a replica
that does not would decide nothing (its next request goes by load, and the replica that
takes it becomes the owner; the sent ledger keeps a burst on it). What moves is the
hashes of the last prompt sent to the leaver under that root that it still owns (the
chain index `RouterState` keeps beside `owners`: one entry per send, O(1), the request's
own hash tuple); its older prompts' own tails are never hit again and are dropped with
the rest. Cost: O(those hashes + the leaver's chains x survivors) dictionary look-ups,
once per scale-in; a send pays one index entry, not one per block.

Scale-in notice (`scale_in_notice_plan`): the hand-off above can only move ownership to
a survivor that already holds a chain, and with each prompt on one replica few do: what
a scale-in loses is the leaver's cache, recomputed on the survivors by the users whose
requests find it gone, in the minute after, on a fleet one replica smaller. The
autoscaler announces a scale-in `scale_in_notice_s` before it is due
(`autoscaling.Decision.leaving`), and the adapter names the replica expected to leave
(Serve stops the newest on a node first). Then, while the leaver still serves, each
chain it owns goes whole to one survivor: one that holds it, handed at once as in the
hand-off; or, when none does, one chosen by the same room less what this plan already
put on it, which is sent a warm-up: the chain's reused blocks (`RouterState.warm_prefix`:
those the root's last two prompts shared, so a query's own blocks are not recomputed and
a prompt sent once is not warmed), one token out, one warm-up in flight per survivor so
users' requests there wait behind one prefill at most. The chain is handed to it when
its warm-up ends (its blocks then cached there); until then the leaver keeps serving it.
The leaver takes no other prompt of a full block or more while any survivor can (it
would own new chains that would leave with it). If the notice is withdrawn, the chains
stay where they went and the leaver serves again with its cache. The cost is the
warm-ups' prefill, paid while the fleet is below its scale-in level and only on
survivors with compute to spare, not by users' first tokens. `scale_in_notice.py` holds
the router's state for it; `MostFreeBlocksRouter` on Serve (the ingress sends the
warm-ups) and the simulator's most_free_blocks run it.

Cost. A choice must not grow with the requests in flight: an ingress makes one per
request, and scanning every request in flight for every replica (and unioning their
prompts' hash sets) made a choice cost replicas x requests in flight x prompt blocks.
So `RouterState` keeps, per replica, running totals of what it sent that no report
includes yet (reserved blocks and requests; a multiset of the prompt hashes,
`_SentPrompts`), updated once per send, completion and expiry, and its entries in the
order sent: what a report includes is the oldest of them, which `reconcile` (before each
choice) removes. A choice is then O(replicas + prompt blocks) dictionary look-ups,
whatever is in flight: the prompt is hashed once, ownership is read along it once
(only its owner's run goes past the first block), and each replica's hits walk only
its own run of hits plus one miss (so a prompt held on k replicas costs k runs: the
one term past prompt blocks + replicas, and the scores need it). `pagefleet bench
router-cost` measures it (BENCHMARKS.md). The drained backlog is cached per replica and
replays that replica's unreported sends once per report (and once after a completion
among them), not once per choice.

Between two choices mostly nothing is due (the reports are the same objects: Serve
polls each replica every few seconds), so `reconcile` re-checks only the replicas with a
new report or a new send, and every replica only when the replica set or the config
changed or the oldest pending send can have aged out. Sending a prompt its owner already
holds sets only the owners its choice did not find (`owned_run`'s last answer). From
`ARRAY_MIN_REPLICAS` replicas a choice also leaves the per-replica Python pass, which at
64 replicas was most of it: right after `reconcile` the pending terms come from the
running totals in C-level passes (`reconciled_terms`), the scores are array arithmetic
(`_FleetArrays`: the same integer and float operations, so the same decision), and the
digests are probed for the prompt's first block all at once (`_hit_candidates`), so only
the few replicas that may hold it walk the prompt. Both paths are tested to decide alike.

Why these defaults (the weight 2, the gaps 0.75 and 8) and what each fix did to the
router benchmark: BENCHMARKS.md, "Routing policy: how it got here".
`round_robin_ranking` is the comparison baseline with no load signal; power of two
choices is Serve's own router (`pagefleet/cluster/request_router.py`).
"""

from __future__ import annotations

import bisect
import itertools
import math
import operator
import random
from collections import OrderedDict, deque
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from operator import itemgetter
from types import MappingProxyType
from typing import Any, Generic, Literal, NamedTuple, TypeVar, get_args

import numpy as np

from pagefleet.cluster.prefill_drain import NO_RATE, PrefillDrain
from pagefleet.engine import DigestView, EngineStats, block_hashes, probe_bits, salted
from pagefleet.settings import check_settings, setting

RoutingPolicyName = Literal[
    "most_free_blocks", "power_of_two", "round_robin", "prefix_cache_affinity"
]
ROUTING_POLICIES: tuple[str, ...] = get_args(RoutingPolicyName)
# How often Serve polls each replica's `record_routing_stats` (its
# `request_routing_stats_period_s`), unless the config says otherwise.
DEFAULT_ROUTING_STATS_PERIOD_S = 2.0
# From this many replicas a choice scores them over arrays (`_choose_by_arrays`): the
# same decision, cheaper than a Python pass per replica at 64 (the simulated fleet ran
# 5-10% faster), dearer at 2-16, where a few dozen array calls cost more than the pass
# (`bench router-cost`: 125 against 77 µs a choice at 2 replicas). Module docstring, "Cost".
ARRAY_MIN_REPLICAS = 32
_REPLICA_ID = operator.attrgetter("replica_id")

# Keys of the dict a replica returns from `record_routing_stats` (the contract
# between replica.py and this module; `routing_stats_from_engine` builds it).
STAT_FREE_BLOCKS = "free_blocks"  # int: KV blocks free (free-but-cached ones count as free)
STAT_TOTAL_BLOCKS = "total_blocks"  # int
STAT_BLOCK_SIZE = "block_size"  # int: tokens per block
STAT_RUNNING = "running"  # int: sequences scheduled
STAT_WAITING = "waiting"  # int: requests queued, not yet admitted
STAT_DEMAND_BLOCKS = "demand_blocks"  # int, optional: EngineStats.num_demand_blocks
STAT_PREFILL_TOKENS = "prefill_tokens"  # int, optional: EngineStats.num_prefill_tokens
STAT_PREFILL_DONE = "prefill_done"  # int, optional: EngineStats.prompt_tokens_total (a counter)
STAT_PREFIX_DIGEST = "prefix_digest"  # bytes, optional: EngineStats.prefix_digest
STAT_HASH_SALT = "hash_salt"  # int, optional: EngineStats.prefix_hash_salt
STAT_TIMESTAMP = "timestamp"  # float: time.time() on the replica when the snapshot was taken


@dataclass(frozen=True)
class RoutingConfig:
    """Router settings; frozen and checked on construction.

    Each field's default, range and description are declared once, here
    (`pagefleet.settings.setting`); the serving config's `routing:` key is
    `policy` (`pagefleet.cluster.config.ServeConfig.routing`). The other
    fields reach a `most_free_blocks` router as Serve's
    `request_router_kwargs` (`pagefleet.cluster.request_router.request_router_config`).

    `stats_include_slack_s`: how long after a request is sent a replica's
    report is trusted to include it (transit and clock skew between router
    and replica). `max_in_flight_age_s`: a reservation older than this is
    ignored even if its completion was never seen (a safety net, not a
    timeout on requests). The affinity settings (`affinity_max_load_gap`,
    `affinity_max_waiting_gap`: the cap; `affinity_owner_weight`: free blocks
    an owned prompt block is worth; `affinity_memory_blocks`: prompt block
    hashes `RouterState.owners` remembers, least recently sent dropped first),
    `memory_headroom` (the free blocks a score counts at most) and
    `prefill_rate_window` (the backlog's drain between reports, `prefill_drain`)
    are explained in the module docstring.
    """

    policy: RoutingPolicyName = setting(  # noqa: RUF009 (a dataclasses.Field, like field())
        "most_free_blocks",
        "how requests pick a replica: most free KV blocks after placing the request "
        "(prefix-cache aware), or Serve's power-of-two / round robin for comparison",
        choices=ROUTING_POLICIES,
    )
    affinity_max_load_gap: float = setting(
        0.75,
        "prefix hits count only on a replica whose load is within this of the least loaded's",
        ge=0,
        le=1,
    )
    affinity_max_waiting_gap: int = setting(
        8,
        "prefix hits count only on a replica whose waiting queue is within this of the shortest's",
        ge=0,
    )
    stats_include_slack_s: float = setting(
        1.0, "how long after a request is sent a replica's report includes it", ge=0
    )
    max_in_flight_age_s: float = setting(
        600.0, "a reservation older than this is dropped, its completion unseen", gt=0
    )
    affinity_memory_blocks: int = setting(
        65536,
        "prompt block hashes whose owner the router remembers, at least (more for a fleet "
        "whose caches hold more: as many as they hold, up to affinity_memory_max_blocks)",
        ge=0,
    )
    affinity_memory_max_blocks: int = setting(
        1 << 20,
        "the most prompt block hashes the router's owner memory grows to with the fleet "
        "(about 130 bytes each)",
        ge=0,
    )
    affinity_owner_weight: float = setting(
        4.0, "free blocks each prompt block on its owner is worth", ge=0
    )
    prefill_weight: float = setting(
        1.0,
        "free blocks each block of a replica's prefill backlog (prompt tokens it has still "
        "to compute, reported plus sent since) costs its score",
        ge=0,
    )

    prefill_rate_window: int = setting(
        8,
        "reports over which a replica's prefill rate is its best throughput, to drain its "
        "backlog between reports (0: no drain; a prompt sent counts until a report has it)",
        ge=0,
    )
    memory_headroom: float = setting(
        0.5,
        "free blocks count in a score in full only up to this fraction of the replica's pool",
        gt=0,
        le=1,
    )
    headroom_block_weight: float = setting(
        0.125,
        "what each free block past memory_headroom counts in a score (1: as much as any)",
        ge=0,
        le=1,
    )

    def __post_init__(self) -> None:
        check_settings(self)


@dataclass(frozen=True)
class ReplicaLoad:
    """One replica's latest report, as the router sees it.

    `reported` is False for a replica with no report yet (the other numbers
    are then placeholders and the policy assumes it empty).
    """

    replica_id: str
    free_blocks: int
    total_blocks: int
    block_size: int
    running: int = 0
    waiting: int = 0
    prefix_digest: Container[int] = frozenset()
    timestamp: float = 0.0
    hash_salt: int | None = None
    demand_blocks: int = 0
    prefill_tokens: int = 0
    prefill_done: int = 0
    reported: bool = True

    def __post_init__(self) -> None:
        if self.reported and (self.total_blocks < 1 or self.block_size < 1):
            raise ValueError(f"{self.replica_id}: total_blocks and block_size must be >= 1")
        if not 0 <= self.free_blocks <= max(self.total_blocks, 0):
            raise ValueError(f"{self.replica_id}: free_blocks must be in [0, total_blocks]")

    @classmethod
    def unreported(cls, replica_id: str) -> ReplicaLoad:
        return cls(replica_id, 0, 0, 1, reported=False)

    @classmethod
    def from_routing_stats(cls, replica_id: str, stats: Mapping[str, Any] | None) -> ReplicaLoad:
        """Parse what `record_routing_stats` returned; `unreported` if empty or unusable."""
        if not stats or STAT_TOTAL_BLOCKS not in stats:
            return cls.unreported(replica_id)
        digest_bytes = stats.get(STAT_PREFIX_DIGEST)
        digest: Container[int] = frozenset()
        if digest_bytes:
            try:
                digest = DigestView(bytes(digest_bytes))
            except ValueError:
                digest = frozenset()  # a digest we cannot read is no digest, not an error
        try:
            return cls(
                replica_id=replica_id,
                free_blocks=int(stats[STAT_FREE_BLOCKS]),
                total_blocks=int(stats[STAT_TOTAL_BLOCKS]),
                block_size=int(stats[STAT_BLOCK_SIZE]),
                running=int(stats.get(STAT_RUNNING, 0)),
                waiting=int(stats.get(STAT_WAITING, 0)),
                demand_blocks=int(stats.get(STAT_DEMAND_BLOCKS, 0)),
                prefill_tokens=int(stats.get(STAT_PREFILL_TOKENS, 0)),
                prefill_done=int(stats.get(STAT_PREFILL_DONE, 0)),
                prefix_digest=digest,
                hash_salt=stats.get(STAT_HASH_SALT),
                timestamp=float(stats.get(STAT_TIMESTAMP, 0.0)),
            )
        except (KeyError, TypeError, ValueError):
            return cls.unreported(replica_id)


def routing_stats_from_engine(stats: EngineStats, now: float) -> dict[str, Any]:
    """The dict a replica returns from `record_routing_stats` (`now`: its time.time())."""
    return {
        STAT_FREE_BLOCKS: stats.num_free_blocks,
        STAT_TOTAL_BLOCKS: stats.num_total_blocks,
        STAT_BLOCK_SIZE: stats.block_size,
        STAT_RUNNING: stats.num_running,
        STAT_WAITING: stats.num_waiting,
        STAT_DEMAND_BLOCKS: stats.num_demand_blocks,
        STAT_PREFILL_TOKENS: stats.num_prefill_tokens,
        STAT_PREFILL_DONE: stats.prompt_tokens_total,
        STAT_PREFIX_DIGEST: stats.prefix_digest,
        STAT_HASH_SALT: stats.prefix_hash_salt,
        STAT_TIMESTAMP: now,
    }


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
class InFlight:
    replica_id: str
    blocks: int
    routed_at: float
    prefill_tokens: int = 0  # prompt tokens it has to compute there (less its hits)


class Pending(NamedTuple):
    """What this router sent a replica that the replica's report does not include."""

    blocks: int
    requests: int
    prefill_tokens: int


@dataclass(frozen=True)
class SentPrompt:
    """Prompt blocks sent to a replica whose digest may not list them yet."""

    replica_id: str
    hashes: frozenset[int]
    routed_at: float


def _reported_or_stale(
    report_time: float | None, routed_at: float, config: RoutingConfig, now: float
) -> bool:
    """Whether an entry sent at `routed_at` no longer counts as pending: the replica's
    report (taken at `report_time`; None: no report) includes it, or it is too old.

    Both tests are monotone in `routed_at` (a float sum or difference with a fixed
    operand rounds monotonically), so among a replica's entries in the order sent
    those it holds for are always the oldest ones: `_Ledger` relies on that."""
    return (
        report_time is not None and report_time >= routed_at + config.stats_include_slack_s
    ) or now - routed_at > config.max_in_flight_age_s


_Entry = TypeVar("_Entry", InFlight, SentPrompt)


@dataclass
class _Sends(Generic[_Entry]):
    """One replica's entries of a `_Ledger`, oldest sent first.

    `items[head:]` holds every live entry of the replica once, sorted by `routed_at`
    (ties in insertion order), among `dead` tombstones: entries removed from the
    ledger since (finished, withdrawn, sent again), recognised because the ledger
    no longer maps their request id to that very object. `items[:head]` is spent.

    `checked_report`, `checked_config` and `front_at` remember the last `expire`: with
    that report and config, the entry sent at `front_at` (the first it kept) was not
    due, so no entry is until the clock ages it (`_Ledger.nothing_due`). Entries leave
    only from the front or as tombstones and arrive at the back, which only makes the
    real front newer than `front_at`: the shortcut can run `expire` for nothing, never
    skip one that would remove something. An entry sorted in out of order (a clock
    that stepped back) clears it."""

    items: list[tuple[float, str, _Entry]] = field(default_factory=list)
    head: int = 0
    dead: int = 0
    checked_report: float | None = None
    checked_config: RoutingConfig | None = None
    front_at: float = math.inf

    @property
    def live(self) -> int:
        return len(self.items) - self.head - self.dead


class _Ledger(Generic[_Entry]):
    """Entries by request id (`entries`, one per request), and per replica the same
    entries in the order sent (`_Sends`) with a running total of them (`_tally`).

    Invariants, after every public method:

    - `_by_replica` has a key exactly for the replicas some entry names, and each
      replica's totals are the sum over its entries in `entries` (subclasses keep
      them, `_tally`); a replica with no entries has no totals.
    - Each live entry appears once in its replica's `_Sends`, in `routed_at` order;
      tombstones never outnumber live entries (`remove` compacts) and the spent
      front never outgrows the rest (`expire` trims it), so memory follows the
      entries.

    So a query "what has this replica been sent that its report does not include"
    is the totals minus the entries at the front of the order that the report does
    include (or that aged out, `_reported_or_stale`), and `expire` removes exactly
    those front entries. Right after `expire` with the same report and clock the
    front holds none: the query costs O(1) however many requests are in flight.
    """

    def __init__(self) -> None:
        self.entries: dict[str, _Entry] = {}
        self._by_replica: dict[str, _Sends[_Entry]] = {}
        # Replicas sent an entry since the router last checked them all (`RouterState.
        # reconcile` clears it): the only ones whose new entries a report may include.
        self.touched: set[str] = set()

    def _tally(self, entry: _Entry, sign: int) -> None:
        """Add (`sign` 1) or subtract (-1) `entry` to its replica's totals."""
        raise NotImplementedError

    def _drop_totals(self, replica_id: str) -> None:
        """`replica_id` has no entries left: forget its (zero) totals."""
        raise NotImplementedError

    def replicas(self) -> list[str]:
        return list(self._by_replica)

    def add(self, request_id: str, entry: _Entry) -> None:
        self.remove(request_id)
        self.entries[request_id] = entry
        self._tally(entry, 1)
        self.touched.add(entry.replica_id)
        sends = self._by_replica.setdefault(entry.replica_id, _Sends())
        item = (entry.routed_at, request_id, entry)
        if len(sends.items) > sends.head and entry.routed_at < sends.items[-1][0]:
            # A clock that stepped back: keep the order (rare, so a list insert).
            bisect.insort(sends.items, item, lo=sends.head, key=itemgetter(0))
            sends.checked_config = None
        else:
            sends.items.append(item)

    def remove(self, request_id: str) -> None:
        entry = self.entries.pop(request_id, None)
        if entry is None:
            return
        self._tally(entry, -1)
        sends = self._by_replica[entry.replica_id]
        sends.dead += 1
        if not sends.live:
            del self._by_replica[entry.replica_id]
            self._drop_totals(entry.replica_id)
        elif sends.dead > sends.live:
            sends.items = [it for it in sends.items[sends.head :] if self._is_live(it)]
            sends.head = sends.dead = 0

    def _is_live(self, item: tuple[float, str, _Entry]) -> bool:
        return self.entries.get(item[1]) is item[2]

    def live_items(self, replica_id: str) -> Sequence[tuple[float, str, _Entry]]:
        """`replica_id`'s (routed_at, request id, entry) in the order sent, tombstones
        among them (an entry no longer in `entries` under its id)."""
        sends = self._by_replica.get(replica_id)
        return () if sends is None else sends.items[sends.head :]

    def excluded(
        self, replica_id: str, report_time: float | None, config: RoutingConfig, now: float
    ) -> list[_Entry]:
        """`replica_id`'s entries that its report includes or that aged out, oldest first."""
        out: list[_Entry] = []
        sends = self._by_replica.get(replica_id)
        if sends is None or self.nothing_due(sends, report_time, config, now):
            return out
        entries = self.entries
        for i in range(sends.head, len(sends.items)):
            routed_at, request_id, entry = sends.items[i]
            if entries.get(request_id) is not entry:
                continue  # a tombstone
            if not _reported_or_stale(report_time, routed_at, config, now):
                break
            out.append(entry)
        return out

    def expire(
        self, replica_id: str, report_time: float | None, config: RoutingConfig, now: float
    ) -> None:
        """Remove `excluded(...)`, and the tombstones in front of the first entry kept.
        A router runs this for every replica before every choice; mostly nothing is due
        since the last time (`nothing_due`), and it returns at once."""
        sends = self._by_replica.get(replica_id)
        if sends is None or self.nothing_due(sends, report_time, config, now):
            return
        while sends is not None and sends.head < len(sends.items):
            item = sends.items[sends.head]
            if self._is_live(item):
                if not _reported_or_stale(report_time, item[0], config, now):
                    break
                self.remove(item[1])  # counts it dead, may drop or compact `sends`
                sends = self._by_replica.get(replica_id)
                if sends is None or sends.items[sends.head] is not item:
                    continue  # compacted or gone: the front is already fresh
            sends.head += 1
            sends.dead -= 1
        if sends is not None and sends.head > len(sends.items) // 2:
            del sends.items[: sends.head]
            sends.head = 0
        if sends is not None:
            sends.checked_report, sends.checked_config = report_time, config
            sends.front_at = sends.items[sends.head][0]  # live and not due: the loop's stop

    @staticmethod
    def nothing_due(
        sends: _Sends[_Entry], report_time: float | None, config: RoutingConfig, now: float
    ) -> bool:
        """Whether no entry of `sends` can be due (`_reported_or_stale`): the last `expire`
        saw this report and config and kept its front, which has not aged out since."""
        return (
            sends.checked_config is config
            and sends.checked_report == report_time
            and not now - sends.front_at > config.max_in_flight_age_s
        )

    def oldest_front(self, replica_ids: Iterable[str] | None = None) -> float:
        """The earliest `front_at` of the replicas' sends (default: every replica's): no
        entry of theirs ages out (`max_in_flight_age_s`) before that plus the age."""
        by_replica = self._by_replica
        if replica_ids is None:
            return min((sends.front_at for sends in by_replica.values()), default=math.inf)
        fronts = (by_replica.get(rid) for rid in replica_ids)
        return min((sends.front_at for sends in fronts if sends is not None), default=math.inf)

    def drop_replica(self, replica_id: str) -> None:
        sends = self._by_replica.get(replica_id)
        if sends is not None:
            for item in [it for it in sends.items[sends.head :] if self._is_live(it)]:
                self.remove(item[1])


class _Reservations(_Ledger[InFlight]):
    """`InFlight` entries; per replica their blocks, prefill tokens and number.
    `on_remove(replica_id)` hears every entry that leaves (`PrefillDrain.changed`)."""

    def __init__(self, on_remove: Callable[[str], None] = lambda rid: None) -> None:
        super().__init__()
        self.on_remove = on_remove
        self.blocks: dict[str, int] = {}
        self.count: dict[str, int] = {}
        self.prefill: dict[str, int] = {}
        # Counts the changes to the totals (every one is a `_tally`): what a memo checks.
        self.version = 0

    def _tally(self, entry: InFlight, sign: int) -> None:
        self.version += 1
        rid = entry.replica_id
        self.blocks[rid] = self.blocks.get(rid, 0) + sign * entry.blocks
        self.count[rid] = self.count.get(rid, 0) + sign
        self.prefill[rid] = self.prefill.get(rid, 0) + sign * entry.prefill_tokens
        if sign < 0:
            self.on_remove(rid)

    def _drop_totals(self, replica_id: str) -> None:
        del self.blocks[replica_id], self.count[replica_id], self.prefill[replica_id]


class _SentPrompts(_Ledger[SentPrompt]):
    """`SentPrompt` entries; per replica the multiset of their hashes, as the set of
    hashes some entry holds (`held`) and the count of those more than one entry holds
    (`shared`, hash -> count >= 2).

    Why two parts: a replica's sends rarely share hashes within a report period, so
    adding and removing an entry is mostly set arithmetic over its frozenset, at C
    speed; only the shared hashes are counted one by one."""

    def __init__(self) -> None:
        super().__init__()
        self.held: dict[str, set[int]] = {}
        self.shared: dict[str, dict[int, int]] = {}
        # Counts the changes to `held` (every one is a `_tally`): what a memo of hits checks.
        self.version = 0

    def _tally(self, entry: SentPrompt, sign: int) -> None:
        self.version += 1
        rid, hashes = entry.replica_id, entry.hashes
        held = self.held.setdefault(rid, set())
        shared = self.shared.setdefault(rid, {})
        if sign > 0:
            for h in hashes & held:
                shared[h] = shared.get(h, 1) + 1
            held |= hashes
            return
        counted = hashes & shared.keys()
        for h in counted:
            n = shared[h] - 1
            if n > 1:
                shared[h] = n
            else:
                del shared[h]
        held -= hashes - counted

    def count(self, replica_id: str, h: int) -> int:
        """How many of `replica_id`'s entries hold `h`."""
        if h not in self.held.get(replica_id, ()):
            return 0
        return self.shared.get(replica_id, {}).get(h, 1)

    def _drop_totals(self, replica_id: str) -> None:
        self.held.pop(replica_id, None)
        self.shared.pop(replica_id, None)


@dataclass(frozen=True)
class _HashesLess:
    """`replica_id`'s sent hashes (a multiset) less those of `minus`: membership only."""

    sent: _SentPrompts
    replica_id: str
    minus: Mapping[int, int]

    def __contains__(self, h: object) -> bool:
        n = self.sent.count(self.replica_id, h)  # type: ignore[arg-type]
        return n > self.minus.get(h, 0)  # type: ignore[call-overload]


@dataclass
class RouterState:
    """What this router has sent: reservations of requests not yet seen finish
    or reported (`in_flight`), prompt blocks not yet in their replica's digest
    (`sent`), and the replica each prompt block was last sent to (`owners`).

    Mutated only by the adapter's lifecycle hooks (`on_routed`,
    `on_completed`, `withdraw`, `reconcile`, `forget_replica`, `retain`);
    `choose_replica` reads it. Every entry names a replica, so `retain` with
    the replicas Serve still offers keeps it bounded by the live set (replicas
    leave by scale-in and redeploys, which never report a death).

    Incremental, so that a choice does not grow with the requests in flight:
    beside the entries by request id, each replica keeps its entries in the order
    sent with running totals, updated on every send, completion and expiry: its
    reserved blocks and requests, and the multiset of the prompt hashes sent to it
    (`_Ledger`, `_SentPrompts`). What a report includes is the front of that order,
    so `pending` and `sent_hashes` are the totals less that front, which `reconcile`
    (run before each choice with the same reports) has just removed: O(1) per
    replica, and one dict look-up per prompt block instead of a union of every
    pending prompt's hashes. Sends, completions and expiries cost O(prompt blocks)
    each, once per request.
    """

    owners: OrderedDict[int, str] = field(default_factory=OrderedDict)
    memory_blocks: int = RoutingConfig.affinity_memory_blocks
    memory_max_blocks: int = RoutingConfig.affinity_memory_max_blocks
    # The reported fleet's KV blocks (`reconcile`): `owners` keeps that many, within
    # [memory_blocks, max(memory_blocks, memory_max_blocks)]. A fixed memory smaller than
    # the fleet's caches forgets the owners of prompts the caches still hold (the fleet
    # simulation at 16 H200 replicas: 65,536 blocks were 8% of the fleet's, and most
    # tenants' prompts lost their owner between requests).
    fleet_blocks: int = field(default=0, init=False)
    # Each replica's prefill rate and its backlog between reports (`prefill_backlog`);
    # told of every reservation that leaves.
    _drain: PrefillDrain = field(default_factory=PrefillDrain, init=False, repr=False)
    _reservations: _Reservations = field(init=False, repr=False)
    _sent: _SentPrompts = field(default_factory=_SentPrompts, init=False, repr=False)
    # The prompt chains each replica owns, for the hand-off: (owner, chain root: a
    # prompt's first block hash) -> the block hashes of the last prompt sent under that
    # root to that owner, least recently sent first; and per owner its roots there. One
    # entry per send, O(1): the hashes are the request's own tuple. An entry whose root
    # its owner no longer owns is useless (ownership counts from a prompt's first block)
    # and is dropped once it is the oldest, so the index covers at most the sends of the
    # LRU's window.
    _chain_hashes: OrderedDict[tuple[str, int], Sequence[int]] = field(
        default_factory=OrderedDict, init=False, repr=False
    )
    _roots: dict[str, dict[int, None]] = field(default_factory=dict, init=False, repr=False)
    # Per index entry, the leading blocks its last prompt shared with the root's prompt
    # before it (its owner's then; absent: the root's first): what of a chain is reused,
    # and so worth warming (`warm_prefix`).
    _chain_shared: dict[tuple[str, int], int] = field(default_factory=dict, init=False, repr=False)
    # The last report `reconcile` handed the drain, per replica.
    _observed: dict[str, ReplicaLoad] = field(default_factory=dict, init=False, repr=False)
    # What the last `reconcile` checked every replica against (`reconcile`): the loads by
    # replica id (None: check all next time), the config, and the earliest send time
    # still pending, from which the first entry can age out.
    _reconciled: dict[str, ReplicaLoad] | None = field(default=None, init=False, repr=False)
    _reconciled_config: RoutingConfig | None = field(default=None, init=False, repr=False)
    _reconciled_now: float = field(default=math.nan, init=False, repr=False)
    # The last `owned_run` (its hashes, by identity, the replica, the run): `on_routed`
    # of the same prompt to that owner skips the run's owner updates, and `owned_run`
    # asked again answers from it. Any other change to `owners` clears it.
    _owned_memo: tuple[Sequence[int], str, int] | None = field(default=None, init=False, repr=False)
    _oldest_front: float = field(default=math.inf, init=False, repr=False)

    def __post_init__(self) -> None:
        self._reservations = _Reservations(self._drain.changed)

    @property
    def in_flight(self) -> Mapping[str, InFlight]:
        """Reservations by request id (read-only)."""
        return MappingProxyType(self._reservations.entries)

    @property
    def sent(self) -> Mapping[str, SentPrompt]:
        """Prompts sent and not yet seen in their replica's report, by request id."""
        return MappingProxyType(self._sent.entries)

    @property
    def sent_version(self) -> int:
        """Changes whenever the sent prompts do (a memo of what they decide checks it)."""
        return self._sent.version

    @property
    def versions(self) -> tuple[int, int]:
        """Changes whenever the reservations or the sent prompts do (a memo of what the
        two decide checks it)."""
        return self._reservations.version, self._sent.version

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
        """Reserve `blocks` on `replica_id`, and `prefill_tokens` of its compute
        (`RouteDecision.prefill_tokens`); its prompt's block `hashes` now live there,
        and belong to `owner` (`RouteDecision.owner`; None: to `replica_id`)."""
        self._reservations.add(request_id, InFlight(replica_id, blocks, now, prefill_tokens))
        self._drain.sent(replica_id, prefill_tokens, now)
        if hashes:
            self._sent.add(request_id, SentPrompt(replica_id, frozenset(hashes), now))
            new = owner or replica_id
            owners = self.owners
            chains, root = self._chain_hashes, hashes[0]
            # The root's last prompt (its owner's entry), before this send takes it over.
            prev = chains.get((owners.get(root), root))  # type: ignore[arg-type]
            # Each hash to `new` and to the LRU's end in prompt order, as a loop of
            # set-then-move would leave them, in two C-level passes (a prompt is
            # hundreds of blocks, and this runs once per request). The leading run the
            # choice just found `new` owns (`owned_run`, nothing changed since) is set
            # already: an OrderedDict's set costs two look-ups a key, a move one.
            memo, self._owned_memo = self._owned_memo, None
            run = memo[2] if memo is not None and memo[0] is hashes and memo[1] == new else 0
            owners.update(zip(itertools.islice(hashes, run, None), itertools.repeat(new)))
            deque(map(owners.move_to_end, hashes), maxlen=0)
            memory = max(self.memory_blocks, min(self.fleet_blocks, self.memory_max_blocks))
            excess = len(owners) - memory
            if excess > 0:  # the least recently sent, a prompt's worth at a time, at C speed
                deque(map(owners.popitem, itertools.repeat(False, excess)), maxlen=0)
            if prev is not None and prev is not hashes:  # not this request's own, again
                self._chain_shared[(new, root)] = _shared_run(prev, hashes)
            chains[(new, root)] = hashes
            chains.move_to_end((new, root))
            self._roots.setdefault(new, {})[root] = None
            while chains:
                oldest = next(iter(chains))
                if owners.get(oldest[1]) == oldest[0]:
                    break
                self._drop_chain(oldest)

    def _drop_chain(self, key: tuple[str, int]) -> Sequence[int]:
        """Take (owner, root) out of the chain index; its hashes."""
        hashes = self._chain_hashes.pop(key)
        self._chain_shared.pop(key, None)
        roots = self._roots[key[0]]
        del roots[key[1]]
        if not roots:
            del self._roots[key[0]]
        return hashes

    def on_completed(self, request_id: str) -> None:
        """Forget a finished (or failed, or rejected) request's reservation; unknown ids
        are fine. Its prompt blocks stay cached on the replica: `sent` keeps them until
        the replica's digest does."""
        self._reservations.remove(request_id)

    def withdraw(self, request_id: str) -> None:
        """Undo a choice that did not happen (the first choice refused the request)."""
        self._reservations.remove(request_id)
        self._sent.remove(request_id)

    def reconcile(self, loads: Iterable[ReplicaLoad], config: RoutingConfig, now: float) -> None:
        """Drop reservations and sent prompts that the replicas' reports already
        include, and stale ones.

        A router runs this before every choice, and between two choices mostly nothing
        is due: the reports are the same objects (Serve polls each replica every few
        seconds) and nothing has aged out. Then only the replicas whose report is new
        and those sent something since the last call are checked; every replica is
        checked when the set of replicas or the config changed, or when the oldest
        pending send can have aged out (`_oldest_front`). Entries are due only by a
        report that includes them or by age (`_reported_or_stale`), so a replica with
        the same report and no new entry has none due that the last check left."""
        loads = list(loads)
        last = self._reconciled
        ledgers = (self._reservations, self._sent)
        if (
            last is None
            or config is not self._reconciled_config
            or len(last) != len(loads)
            or now - self._oldest_front > config.max_in_flight_age_s
        ):
            changed = loads
            check: set[str] | None = None  # every replica with entries
            self._oldest_front = math.inf
        else:
            changed = [ld for ld in loads if last.get(ld.replica_id) is not ld]
            if any(ld.replica_id not in last for ld in changed):
                self._reconciled = None  # a replica replaced another: check all
                self.reconcile(loads, config, now)
                return
            check = {ld.replica_id for ld in changed}.union(*(ld.touched for ld in ledgers))
        if changed:
            self.fleet_blocks = sum(ld.total_blocks for ld in loads if ld.reported)
        seen = self._observed
        for ld in changed:
            # A report observed before (the same object) has nothing new for the drain
            # (`observe` ignores a report time it has seen).
            if ld.reported and seen.get(ld.replica_id) is not ld:
                self._drain.observe(
                    ld.replica_id, ld.timestamp, ld.prefill_done, config.prefill_rate_window
                )
                seen[ld.replica_id] = ld
        # The loads by replica id: built anew only when every replica is checked; between
        # two reports a call touches only the replicas it checks, not every replica.
        if check is None or last is None:
            self._reconciled = last = {ld.replica_id: ld for ld in loads}
        else:
            last.update((ld.replica_id, ld) for ld in changed)
        for ledger in ledgers:
            for rid in ledger.replicas() if check is None else check:
                ld = last.get(rid)
                ledger.expire(rid, ld.timestamp if ld and ld.reported else None, config, now)
            ledger.touched.clear()
            self._oldest_front = min(self._oldest_front, ledger.oldest_front(check))
        self._reconciled_config, self._reconciled_now = config, now

    def forget_replica(self, replica_id: str) -> None:
        self.retain(lambda r: r != replica_id)

    def retain(self, live: Container[str] | Callable[[str], bool]) -> None:
        """Forget every replica not in `live` (ids, or a predicate): its reservations,
        sent prompts and owned prompt blocks (hand them on first: `hand_off`)."""
        keep = live if callable(live) else live.__contains__
        for ledger in (self._reservations, self._sent):
            for rid in ledger.replicas():
                if not keep(rid):
                    ledger.drop_replica(rid)
        for rid in [r for r in self._roots if not keep(r)]:
            for root in list(self._roots[rid]):
                self._drop_chain((rid, root))
        self._drain.forget(keep)
        for rid in [r for r in self._observed if not keep(r)]:
            del self._observed[rid]
        self._reconciled = None
        for h in [h for h, r in self.owners.items() if not keep(r)]:
            del self.owners[h]
        self._owned_memo = None

    def owning_replicas(self) -> list[str]:
        """The replicas with a prompt chain in the index (`owned_chains`)."""
        return list(self._roots)

    def owned_chains(self, replica_id: str) -> dict[int, frozenset[int]]:
        """The prompt chains `replica_id` owns: chain root -> the hashes of the last prompt
        sent to it under that root that it still owns, first sent first (chains whose
        root it no longer owns left out). O(those prompts' blocks)."""
        owners = self.owners
        out: dict[int, frozenset[int]] = {}
        for root in self._roots.get(replica_id, ()):
            if owners.get(root) == replica_id:
                hashes = self._chain_hashes[(replica_id, root)]
                out[root] = frozenset(h for h in hashes if owners.get(h) == replica_id)
        return out

    def warm_prefix(self, replica_id: str, root: int) -> tuple[int, ...]:
        """What of `replica_id`'s chain under `root` is worth computing elsewhere: the
        leading hashes of the last prompt sent under it that it still owns and that the
        root's prompt before it shared (a query's own blocks are not reused; a root sent
        once is not worth a warm-up: empty)."""
        key = (replica_id, root)
        hashes = self._chain_hashes.get(key, ())
        shared = self._chain_shared.get(key, 0)
        return tuple(hashes[: min(shared, self.owned_run(hashes, replica_id))])

    def hand_off(self, replica_id: str, plan: Mapping[int, str]) -> None:
        """Give each chain `replica_id` owns whose root `plan` names to the replica it
        names (`hand_off_plan`): the hashes of its last prompt there that it still owns.
        Each keeps its place in the LRU: a hand-off is not a send."""
        owners = self.owners
        self._owned_memo = None
        for root, to in plan.items():
            key = (replica_id, root)
            if to == replica_id or key not in self._chain_hashes:
                continue
            shared = self._chain_shared.get(key)
            hashes = self._drop_chain(key)
            for h in hashes:
                if owners.get(h) == replica_id:
                    owners[h] = to
            if (to, root) not in self._chain_hashes:
                self._chain_hashes[(to, root)] = hashes
                self._roots.setdefault(to, {})[root] = None
                if shared is not None:
                    self._chain_shared[(to, root)] = shared

    def replicas(self) -> set[str]:
        """Every replica some entry names."""
        return {*self._reservations.replicas(), *self._sent.replicas(), *self.owners.values()}

    def pending(self, load: ReplicaLoad, config: RoutingConfig, now: float) -> tuple[int, int]:
        """(blocks, requests) sent to `load`'s replica that its report does not include."""
        p = self.pending_load(load, config, now)
        return p.blocks, p.requests

    def pending_load(self, load: ReplicaLoad, config: RoutingConfig, now: float) -> Pending:
        """Blocks, requests and prefill tokens sent to `load`'s replica that its report
        does not include."""
        rid = load.replica_id
        res = self._reservations
        blocks, count = res.blocks.get(rid, 0), res.count.get(rid, 0)
        prefill = res.prefill.get(rid, 0)
        for f in res.excluded(rid, load.timestamp if load.reported else None, config, now):
            blocks -= f.blocks
            count -= 1
            prefill -= f.prefill_tokens
        return Pending(blocks, count, prefill)

    def prefill_backlog(self, load: ReplicaLoad, config: RoutingConfig, now: float) -> int:
        """Prompt tokens `load`'s replica has still to compute now: its reported backlog
        and the prefills sent since that the report does not include, drained at its rate
        (`prefill_drain`; rate 0 before `reconcile` has seen two of its reports). Sends
        too old to count (`max_in_flight_age_s`) leave it when `reconcile` drops them."""
        rid = load.replica_id
        report_time = load.timestamp if load.reported else None
        reported = load.prefill_tokens if load.reported else 0
        res, slack = self._reservations, config.stats_include_slack_s
        if not self._drain.rate(rid):
            # Nothing drains: the running total less the sends the report includes (the
            # front of the order, by the report alone: now -inf ages nothing), which
            # `reconcile` has just dropped: O(1), as before the drain.
            front = res.excluded(rid, report_time, config, float("-inf"))
            return reported + res.prefill.get(rid, 0) - sum(f.prefill_tokens for f in front)

        def sends() -> list[tuple[float, int]]:
            live = res.entries
            return [
                (routed_at, f.prefill_tokens)
                for routed_at, request_id, f in res.live_items(rid)
                if live.get(request_id) is f
                and (report_time is None or report_time < routed_at + slack)
            ]

        return self._drain.backlog(rid, report_time, reported, sends, now)

    def reconciled_terms(
        self,
        loads: Sequence[ReplicaLoad],
        views: Sequence[ReplicaLoad],
        config: RoutingConfig,
        now: float,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[Container[int]]] | None:
        """`replica_terms(views, ...)` as arrays ([n] blocks, requests, backlog tokens) and
        the sent hashes, read from the running totals in a few C-level passes, when this
        state was reconciled with these very `loads`, config and clock and has been sent
        nothing since (`views`: `loads` with the unreported ones filled in); else None.

        Then no entry is due for a replica whose view is its load (`reconcile` checked
        each against that report), so its pending terms are its totals, its backlog the
        reported one plus its sends' (rate 0) or the drain's cached model, and its sent
        hashes the multiset's set; a filled-in view, or a drain model to replay, is read
        through `replica_terms` itself. The same numbers, without a Python pass per
        replica over a dozen look-ups: at 64 replicas that pass was most of a choice."""
        last, res, sent = self._reconciled, self._reservations, self._sent
        if (
            last is None
            or self._reconciled_config is not config
            or self._reconciled_now != now
            or res.touched
            or sent.touched
            or len(last) != len(loads)
            or not all(map(operator.is_, loads, map(last.get, map(_REPLICA_ID, loads))))
        ):
            return None
        n = len(views)
        ids = [ld.replica_id for ld in views]
        blocks = np.fromiter(map(res.blocks.get, ids, itertools.repeat(0)), np.int64, n)
        count = np.fromiter(map(res.count.get, ids, itertools.repeat(0)), np.int64, n)
        prefill = np.fromiter(map(res.prefill.get, ids, itertools.repeat(0)), np.int64, n)
        held: list[Container[int]] = list(map(sent.held.get, ids, itertools.repeat(frozenset())))
        reported = [ld.prefill_tokens if ld.reported else 0 for ld in views]
        times = [ld.timestamp if ld.reported else None for ld in views]
        tokens = np.array(reported, dtype=np.int64) + prefill
        for i, drained in enumerate(self._drain.cached_backlogs(ids, times, reported, now)):
            if drained is None:
                tokens[i] = self.prefill_backlog(views[i], config, now)
            elif drained != NO_RATE:
                tokens[i] = drained
        for i in [i for i, (ld, v) in enumerate(zip(loads, views, strict=True)) if ld is not v]:
            blocks[i], count[i], tokens[i], held[i] = self.replica_terms([views[i]], config, now)[0]
        return blocks, count, tokens, held

    def replica_terms(
        self, loads: Iterable[ReplicaLoad], config: RoutingConfig, now: float
    ) -> list[tuple[int, int, int, Container[int]]]:
        """Per load, in order: (`pending_load`'s blocks and requests, `prefill_backlog`,
        `sent_hashes`), exactly as those give them. Every choice reads them for every
        replica, and right after `reconcile` mostly nothing is due and the drain's model
        is cached: those replicas are read here directly; the rest through the methods."""
        res, sent, drain = self._reservations, self._sent, self._drain
        res_sends, sent_sends = res._by_replica, sent._by_replica
        blocks, count, prefill, held = res.blocks, res.count, res.prefill, sent.held
        nothing_due = _Ledger.nothing_due
        out: list[tuple[int, int, int, Container[int]]] = []
        for ld in loads:
            rid = ld.replica_id
            report_time = ld.timestamp if ld.reported else None
            sends = res_sends.get(rid)
            if sends is None:
                p_blocks = p_count = p_prefill = 0
                due = False
            else:
                due = not nothing_due(sends, report_time, config, now)
                p_blocks, p_count, p_prefill = blocks[rid], count[rid], prefill[rid]
            if due:
                p = self.pending_load(ld, config, now)
                p_blocks, p_count = p.blocks, p.requests
            reported = ld.prefill_tokens if ld.reported else 0
            if drain.rate(rid):
                tokens = drain.cached_backlog(rid, report_time, reported, now)
                if tokens is None:
                    tokens = self.prefill_backlog(ld, config, now)
            elif sends is None or nothing_due(sends, report_time, config, -math.inf):
                tokens = reported + p_prefill
            else:
                tokens = self.prefill_backlog(ld, config, now)
            hashes_sends = sent_sends.get(rid)
            if hashes_sends is None or nothing_due(hashes_sends, report_time, config, now):
                hashes: Container[int] = held.get(rid, set())
            else:
                hashes = self.sent_hashes(ld, config, now)
            out.append((p_blocks, p_count, tokens, hashes))
        return out

    def sent_hashes(self, load: ReplicaLoad, config: RoutingConfig, now: float) -> Container[int]:
        """Prompt block hashes sent to `load`'s replica that its report does not include."""
        rid = load.replica_id
        report_time = load.timestamp if load.reported else None
        minus: dict[int, int] = {}
        for f in self._sent.excluded(rid, report_time, config, now):
            for h in f.hashes:
                minus[h] = minus.get(h, 0) + 1
        return _HashesLess(self._sent, rid, minus) if minus else self._sent.held.get(rid, set())

    def owned_run(self, hashes: Sequence[int], replica_id: str) -> int:
        """Leading `hashes` whose last recorded destination is `replica_id`."""
        memo = self._owned_memo
        # Asked before (a look ahead) and `owners` has not changed since; a tuple only: a
        # list could have changed under its identity.
        if (
            memo is not None
            and memo[0] is hashes
            and memo[1] == replica_id
            and type(hashes) is tuple
        ):
            return memo[2]
        # Every choice reads a prompt's hundreds of blocks here: C-level passes.
        run = _common_run(map(self.owners.get, hashes), itertools.repeat(replica_id))
        self._owned_memo = (hashes, replica_id, run)
        return run

    def reserved_blocks(self, replica_id: str) -> int:
        return self._reservations.blocks.get(replica_id, 0)


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


@dataclass(frozen=True)
class _FleetView:
    """What a choice (or a hand-off) reads of the replicas, unreported ones filled in
    (`_fleet_view`); by replica id."""

    views: list[ReplicaLoad]
    free_now: dict[str, int]  # free less demand and in-flight reservations
    room: dict[
        str, int
    ]  # free_now, past memory_headroom of the pool discounted: what a score reads
    waiting: dict[str, int]  # reported waiting plus requests sent since
    backlog: dict[str, int]  # prefill backlog in blocks, weighted by prefill_weight
    load_frac: dict[str, float]
    queued: dict[str, int]  # reported waiting: what the cap reads
    min_load: float
    min_queued: int
    sent: dict[str, Container[int]]  # prompt hashes sent since the report (`sent_hashes`)

    def within_cap(self, rid: str, config: RoutingConfig) -> bool:
        """Whether affinity may pull a request onto `rid`: it is not already much busier
        than the least busy replica."""
        return (
            self.load_frac[rid] <= self.min_load + config.affinity_max_load_gap
            and self.queued[rid] <= self.min_queued + config.affinity_max_waiting_gap
        )


def _filled_in(loads: Sequence[ReplicaLoad], reported: Sequence[ReplicaLoad]) -> list[ReplicaLoad]:
    """`loads` with each unreported replica's view filled in.

    An unreported replica (a scale-out's, before its first report) has nothing running,
    waiting or queued, and the largest reported pool; its free blocks are the most any
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
        else ReplicaLoad(ld.replica_id, freest, model.total_blocks, model.block_size)
        for ld in loads
    ]


def _fleet_view(
    loads: Sequence[ReplicaLoad],
    reported: Sequence[ReplicaLoad],
    state: RouterState,
    config: RoutingConfig,
    now: float,
) -> _FleetView:
    views = _filled_in(loads, reported)
    # One pass over the replicas: every choice runs it.
    free_now: dict[str, int] = {}
    room: dict[str, int] = {}
    waiting: dict[str, int] = {}
    backlog: dict[str, int] = {}
    load_frac: dict[str, float] = {}
    queued: dict[str, int] = {}
    headroom_frac, past_weight = config.memory_headroom, config.headroom_block_weight
    prefill_weight = config.prefill_weight
    sent: dict[str, Container[int]] = {}
    for ld, (p_blocks, p_requests, tokens, sent[ld.replica_id]) in zip(
        views, state.replica_terms(views, config, now), strict=True
    ):
        rid = ld.replica_id
        free = free_now[rid] = ld.free_blocks - ld.demand_blocks - p_blocks
        waiting[rid] = ld.waiting + p_requests
        # Free blocks past the headroom are worth little: on a large pool a few running
        # requests move free blocks by more than a held prompt is worth, and outbid it.
        headroom = round(headroom_frac * ld.total_blocks)
        room[rid] = min(free, headroom) + round(past_weight * max(0, free - headroom))
        # The compute backlog, in blocks: prompt tokens the replica has still to compute,
        # as it reported them plus what this router sent it since, drained at its rate
        # (`RouterState.prefill_backlog`).
        backlog[rid] = round(prefill_weight * -(-tokens // ld.block_size))
        load_frac[rid] = 1.0 - free / ld.total_blocks
        # The cap reads the waiting queues the replicas report: a request sent since a
        # report is not known to wait (most run at once), and its blocks already count
        # in load_frac.
        queued[rid] = ld.waiting
    return _FleetView(
        views,
        free_now,
        room,
        waiting,
        backlog,
        load_frac,
        queued,
        min(load_frac.values()),
        min(queued.values()),
        sent,
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
    reported = [ld for ld in loads if ld.reported]
    if not reported:
        counts = {ld.replica_id: state.pending(ld, config, now)[1] for ld in loads}
        order = sorted(loads, key=lambda ld: (counts[ld.replica_id], rng.random()))
        ids = tuple(ld.replica_id for ld in order)
        return RouteDecision(
            ids,
            dict.fromkeys(ids, 0),
            dict.fromkeys(ids, 0),
            dict.fromkeys(ids, 0),
            prefill_tokens=dict.fromkeys(ids, request.prompt_tokens),
        )

    if len(loads) >= ARRAY_MIN_REPLICAS:
        return _choose_by_arrays(request, loads, reported, state, config, rng, now)
    fv = _fleet_view(loads, reported, state, config, now)
    views, room, backlog = fv.views, fv.room, fv.backlog
    cost: dict[str, int] = {}
    hits: dict[str, int] = {}
    prefill: dict[str, int] = {}
    score: dict[str, int] = {}
    # Ownership counts from a prompt's first block, so only that block's owner can own a
    # leading run: read along the prompt once, for it alone.
    hashes = request.prompt_block_hashes
    owner = state.owners.get(hashes[0]) if hashes else None
    owner_run = state.owned_run(hashes, owner) if owner is not None else 0
    needs: dict[int, int] = {}  # by block size
    owner_weight, prompt_tokens = config.affinity_owner_weight, request.prompt_tokens
    # Most replicas hold neither the prompt's first block nor a send of it, and so no
    # hit: that test first, its probe positions computed once per digest size.
    first = hashes[0] if hashes else None
    probes: dict[tuple[int, int], tuple[tuple[int, int], ...]] = {}
    for ld in views:
        rid = ld.replica_id
        need = needs.get(ld.block_size)
        if need is None:
            need = needs[ld.block_size] = blocks_needed(request, ld.block_size)
        sent, digest = fv.sent[rid], ld.prefix_digest
        if first is not None and isinstance(digest, DigestView) and first not in sent:
            size = (digest.num_bits, digest.num_probes)
            probe = probes.get(size)
            if probe is None:
                probe = probes[size] = probe_bits(first, *size)
            hit = prefix_hits(request, ld, sent) if digest.has_probe(probe) else 0
        else:
            hit = prefix_hits(request, ld, sent)
        hits[rid] = hit
        cost[rid] = need - hit
        prefill[rid] = max(0, prompt_tokens - hit * ld.block_size)
        # The cap: affinity may pull a request only onto a replica not already
        # much busier than the least busy one.
        if fv.within_cap(rid, config):
            owned = min(hit, owner_run) if rid == owner else 0
            score[rid] = room[rid] - cost[rid] + round(owner_weight * owned)
        else:
            score[rid] = room[rid] - need
        score[rid] -= backlog[rid]
    # Equal scores (replicas past the headroom) go to the one with more free blocks (after
    # demand and reservations), as they did before the headroom, then to fewer waiting; the
    # random key drawn per replica means a full tie never resolves by list order.
    waiting, free_now = fv.waiting, fv.free_now
    order = sorted(
        views,
        key=lambda ld: (
            -score[ld.replica_id],
            -free_now[ld.replica_id],
            waiting[ld.replica_id],
            rng.random(),
        ),
    )
    # A spill (the owner past the cap) leaves the prompt with its owner while the owner
    # still holds it: it comes back once the owner has room, instead of moving whole to
    # a replica that must evict other prompts to hold it.
    keeps = owner_run > 0 and owner in hits and hits[owner] >= owner_run
    return RouteDecision(
        tuple(ld.replica_id for ld in order), cost, hits, score, owner if keeps else None, prefill
    )


_LOAD_FIELDS = operator.attrgetter(
    "free_blocks", "demand_blocks", "total_blocks", "block_size", "waiting"
)
_DIGEST = operator.attrgetter("prefix_digest")
_DIGEST_SIZE = operator.attrgetter("num_bits", "num_probes")
_BITS = operator.attrgetter("bits")


@dataclass(frozen=True)
class _FleetArrays:
    """`_FleetView` for a large fleet's choice (`_fleet_arrays`): one entry per replica,
    in `views` order ([n] each).

    Arrays, not dicts by replica id: every choice reads every replica, and at 64 replicas
    the Python pass per replica over a dozen terms ran the simulated fleet 5-10% slower
    (`ARRAY_MIN_REPLICAS`). The arithmetic is the same and exact: ints in int64, floats in
    float64 with the same operations in the same order, `round` as `np.rint` (both round
    half to even)."""

    views: list[ReplicaLoad]
    ids: list[str]
    free_now: np.ndarray  # free less demand and in-flight reservations
    room: np.ndarray  # free_now, past memory_headroom of the pool discounted: what a score reads
    waiting: np.ndarray  # reported waiting plus requests sent since
    backlog: np.ndarray  # prefill backlog in blocks, weighted by prefill_weight
    load_frac: np.ndarray
    queued: np.ndarray  # reported waiting: what the cap reads
    block_size: np.ndarray
    sent: list[Container[int]]  # prompt hashes sent since the report (`sent_hashes`)

    def within_cap(self, config: RoutingConfig) -> np.ndarray:
        """[n] bool: whether affinity may pull a request onto each replica: it is not
        already much busier than the least busy one."""
        return (self.load_frac <= float(self.load_frac.min()) + config.affinity_max_load_gap) & (
            self.queued <= int(self.queued.min()) + config.affinity_max_waiting_gap
        )


def _same_objects(kept: Sequence[object], now: Sequence[object]) -> bool:
    """Whether `now` holds the very objects `kept` does, in order (what the memos below
    are keyed by: frozen views, kept alive there)."""
    return len(kept) == len(now) and all(map(operator.is_, kept, now))


# A memo of the last result alone, in a list (`_recall`, `_keep`): (objects compared by
# identity, values compared by equality, a sequence whose items are compared by
# identity, the result). The entry keeps its objects alive, so no id is reused while it
# is there; one assignment replaces it, so a reader beside another thread sees the old
# entry or the new one.
_Memo = list[tuple[tuple[object, ...], tuple[object, ...], list[Any], Any]]


def _recall(
    memo: _Memo, same: tuple[object, ...], equal: tuple[object, ...], items: Sequence[object]
) -> Any:
    """The result `memo` keeps for the very objects `same` and `items` and the values
    `equal`; None if it keeps another (or none)."""
    if memo:
        kept_same, kept_equal, kept_items, result = memo[0]
        if (
            all(map(operator.is_, kept_same, same))
            and kept_equal == equal
            and _same_objects(kept_items, items)
        ):
            return result
    return None


def _keep(
    memo: _Memo,
    same: tuple[object, ...],
    equal: tuple[object, ...],
    items: Sequence[object],
    result: Any,
) -> None:
    memo[:] = [(same, equal, list(items), result)]  # one assignment


# The last fleet's reports as an array (`_reports`), keyed by the views it was read from.
_LAST_REPORTS: _Memo = []


def _reports(views: list[ReplicaLoad]) -> np.ndarray:
    """[5, n] int64, read-only: each view's free, demand, total, block size and waiting
    blocks, as reported. The views are frozen and, between two reports, every choice
    reads the same objects: the last array is kept for them (by identity; the entry
    keeps them alive, so no id is reused while it is there)."""
    reports = _recall(_LAST_REPORTS, (), (), views)
    if reports is not None:
        return reports
    reports = np.array(list(map(_LOAD_FIELDS, views)), dtype=np.int64).reshape(len(views), 5).T
    reports.flags.writeable = False
    _keep(_LAST_REPORTS, (), (), views, reports)
    return reports


# The last fleet arrays (`_fleet_arrays`), keyed by the state and the config, its
# ledgers' versions and the time, and the loads.
_LAST_ARRAYS: _Memo = []


def _fleet_arrays(
    loads: Sequence[ReplicaLoad],
    reported: Sequence[ReplicaLoad],
    state: RouterState,
    config: RoutingConfig,
    now: float,
) -> _FleetArrays:
    """The fleet as a choice reads it (`_FleetArrays`), read-only.

    They depend on the loads (frozen), the state's reservations and sent prompts (its
    `versions`), the drain's model (changed only by a report, a send or a reservation
    leaving), the config and the time: the last result is kept for the same of each, so
    a router that prepared its choice (`prepare_choice`) reads them again at the choice
    unless a report, a send or a completion came between."""
    same, equal = (state, config), (state.versions, now)
    fv = _recall(_LAST_ARRAYS, same, equal, loads)
    if fv is not None:
        return fv
    fv = _fleet_arrays_of(loads, reported, state, config, now)
    for array in (fv.free_now, fv.room, fv.waiting, fv.backlog, fv.load_frac, fv.queued):
        array.flags.writeable = False
    _keep(_LAST_ARRAYS, same, equal, loads, fv)
    return fv


def _fleet_arrays_of(
    loads: Sequence[ReplicaLoad],
    reported: Sequence[ReplicaLoad],
    state: RouterState,
    config: RoutingConfig,
    now: float,
) -> _FleetArrays:
    views = _filled_in(loads, reported)
    terms = state.reconciled_terms(loads, views, config, now)
    if terms is None:
        blocks, count, tokens, held = zip(*state.replica_terms(views, config, now), strict=True)
        terms = (
            np.array(blocks, dtype=np.int64),
            np.array(count, dtype=np.int64),
            np.array(tokens, dtype=np.int64),
            list(held),
        )
    p_blocks, p_requests, p_tokens, sent = terms
    free_blocks, demand, total, block_size, queued = _reports(views)
    free = free_blocks - demand - p_blocks
    # Free blocks past the headroom are worth little: on a large pool a few running
    # requests move free blocks by more than a held prompt is worth, and outbid it.
    headroom = np.rint(config.memory_headroom * total).astype(np.int64)
    past = np.rint(config.headroom_block_weight * np.maximum(0, free - headroom))
    room = np.minimum(free, headroom) + past.astype(np.int64)
    # The compute backlog, in blocks: prompt tokens the replica has still to compute,
    # as it reported them plus what this router sent it since, drained at its rate
    # (`RouterState.prefill_backlog`).
    backlog = np.rint(config.prefill_weight * -(-p_tokens // block_size)).astype(np.int64)
    # The cap reads the waiting queues the replicas report (`queued`): a request sent
    # since a report is not known to wait (most run at once), and its blocks already
    # count in load_frac.
    return _FleetArrays(
        views,
        [ld.replica_id for ld in views],
        free,
        room,
        queued + p_requests,
        backlog,
        1.0 - free / total,
        queued,
        block_size,
        sent,
    )


def _hit_candidates(first: int, fv: _FleetArrays) -> list[int]:
    """Indices of the replicas that may hold a prompt whose first block hash is `first`:
    those sent it since their report, and those whose digest may hold it (a replica whose
    digest is no `DigestView` always is: `prefix_hits` decides). The others have no hit.
    Most replicas hold neither, so the digests' probes for `first` are read for every
    replica at once, a probe position at a time."""
    digests = list(map(_DIGEST, fv.views))
    sent_first = list(map(operator.contains, fv.sent, itertools.repeat(first)))
    if set(map(type, digests)) != {DigestView} or len(set(map(_DIGEST_SIZE, digests))) != 1:
        return [
            i
            for i, (d, s) in enumerate(zip(digests, sent_first, strict=True))
            if s or not isinstance(d, DigestView) or first in d
        ]
    (byte, bit), *rest = probe_bits(first, *_DIGEST_SIZE(digests[0]))
    # The first probe over every replica's bitset (most miss it), the rest on those left.
    maybe = [
        i for i, b in enumerate(map(operator.itemgetter(byte), map(_BITS, digests))) if b & bit
    ]
    held = {i for i in maybe if digests[i].has_probe(rest)}
    held.update(itertools.compress(range(len(digests)), sent_first))
    return sorted(held)


# The last prompt's hits (`_prompt_hits`), keyed by the state and the request, the sent
# prompts' version and the time, and the views.
_LAST_HITS: _Memo = []


def _prompt_hits(
    request: RouteRequest, fv: _FleetArrays, state: RouterState, now: float
) -> np.ndarray:
    """[n] int64, read-only: each replica's `prefix_hits` for `request` (0 for most:
    those that hold neither the prompt's first block nor a send of it).

    They depend on the prompt, the reports (frozen views) and the prompts sent since
    them at `now`, nothing else: the last result is kept for the same request, views,
    sent prompts (`RouterState.sent_version`) and time, so a router that works them out
    ahead (`prepare_choice`) finds them at its choice unless a report or a send came
    between."""
    views = fv.views
    same, equal = (state, request), (state.sent_version, now)
    hit = _recall(_LAST_HITS, same, equal, views)
    if hit is not None:
        return hit
    n, hashes = len(views), request.prompt_block_hashes
    hit = np.zeros(n, dtype=np.int64)
    for i in _hit_candidates(hashes[0], fv) if hashes else range(n):
        hit[i] = prefix_hits(request, views[i], fv.sent[i])
    hit.flags.writeable = False
    _keep(_LAST_HITS, same, equal, views, hit)
    return hit


def prepare_choice(
    request: RouteRequest,
    loads: Sequence[ReplicaLoad],
    state: RouterState,
    config: RoutingConfig,
    now: float,
    interrupted: Callable[[], bool] = lambda: False,
) -> None:
    """Work out ahead, for a large fleet, what `choose_replica(request, loads, state,
    config, rng, now)` will read that depends only on the reports and the prompts sent:
    the prompt's hits (`_prompt_hits`). Changes nothing the choice decides by (the state
    as reconciled at `now` stays so). Stops before the hits once `interrupted()` (the
    caller has something more pressing: the choice works out what is left)."""
    reported = [ld for ld in loads if ld.reported]
    if len(loads) < ARRAY_MIN_REPLICAS or not reported:
        return
    fv = _fleet_arrays(loads, reported, state, config, now)
    if not interrupted():
        _prompt_hits(request, fv, state, now)


def _choose_by_arrays(
    request: RouteRequest,
    loads: Sequence[ReplicaLoad],
    reported: Sequence[ReplicaLoad],
    state: RouterState,
    config: RoutingConfig,
    rng: random.Random,
    now: float,
) -> RouteDecision:
    """`choose_replica` for a large fleet: the same decision, over arrays (`_FleetArrays`)."""
    fv = _fleet_arrays(loads, reported, state, config, now)
    ids, n = fv.ids, len(fv.views)
    # Ownership counts from a prompt's first block, so only that block's owner can own a
    # leading run: read along the prompt once, for it alone.
    hashes = request.prompt_block_hashes
    owner = state.owners.get(hashes[0]) if hashes else None
    owner_run = state.owned_run(hashes, owner) if owner is not None else 0
    sizes = fv.block_size.tolist()
    needs = {bs: blocks_needed(request, bs) for bs in set(sizes)}
    need = np.array([needs[bs] for bs in sizes], dtype=np.int64)
    hit = _prompt_hits(request, fv, state, now)
    cost = need - hit
    prefill = np.maximum(0, request.prompt_tokens - hit * fv.block_size)
    # The cap: affinity may pull a request only onto a replica not already much busier
    # than the least busy one; past it a replica competes on its free blocks alone.
    capped = fv.within_cap(config)
    score = np.where(capped, fv.room - cost, fv.room - need)
    o = ids.index(owner) if owner in ids else None
    if o is not None and capped[o]:
        score[o] += round(config.affinity_owner_weight * min(int(hit[o]), owner_run))
    score -= fv.backlog
    # Equal scores (replicas past the headroom) go to the one with more free blocks (after
    # demand and reservations), as they did before the headroom, then to fewer waiting; the
    # random key drawn per replica (in `loads` order) means a full tie never resolves by
    # list order.
    tie = np.array([rng.random() for _ in range(n)])
    order = np.lexsort((tie, fv.waiting, -fv.free_now, -score)).tolist()
    # A spill (the owner past the cap) leaves the prompt with its owner while the owner
    # still holds it: it comes back once the owner has room, instead of moving whole to
    # a replica that must evict other prompts to hold it.
    keeps = owner_run > 0 and o is not None and hit[o] >= owner_run
    return RouteDecision(
        tuple(ids[i] for i in order),
        dict(zip(ids, cost.tolist(), strict=True)),
        dict(zip(ids, hit.tolist(), strict=True)),
        dict(zip(ids, score.tolist(), strict=True)),
        owner if keeps else None,
        dict(zip(ids, prefill.tolist(), strict=True)),
    )


def _common_run(a: Iterable[object], b: Iterable[object]) -> int:
    """How many leading items `a` and `b` share (up to the shorter's end)."""
    wrong = list(map(operator.ne, a, b))  # C-level: a prompt is hundreds of blocks
    return wrong.index(True) if True in wrong else len(wrong)


def _shared_run(a: Sequence[int], b: Sequence[int]) -> int:
    """`_common_run` of two prompts' block hashes, first over the run of the very same
    int objects (a shared prefix's hashes often are, cached once: the identity test
    reads no int, where `!=` reads both), then by value from there."""
    same = list(map(operator.is_, a, b))
    n = same.index(False) if False in same else len(same)
    return n + _common_run(itertools.islice(a, n, None), itertools.islice(b, n, None))


def hand_off_plan(
    leaving: Iterable[str],
    survivors: Sequence[ReplicaLoad],
    state: RouterState,
    config: RoutingConfig,
    rng: random.Random,
    now: float,
) -> dict[str, dict[int, str]]:
    """Where the prompt chains the `leaving` replicas own go (module docstring, "Scale-in
    hand-off"): leaver -> chain root -> survivor. Reads `state`, changes nothing."""
    return _plan_chains(leaving, survivors, state, config, rng, now, warm=False)[0]


class WarmUp(NamedTuple):
    """A prompt chain to compute on a survivor before its owner leaves: the leading
    `hashes` of it worth it (`RouterState.warm_prefix`)."""

    leaver: str
    root: int
    replica_id: str  # the survivor that computes it
    hashes: tuple[int, ...]


def scale_in_notice_plan(
    leaving: Iterable[str],
    survivors: Sequence[ReplicaLoad],
    state: RouterState,
    config: RoutingConfig,
    rng: random.Random,
    now: float,
) -> tuple[dict[str, dict[int, str]], list[WarmUp]]:
    """What to do with the prompt chains the `leaving` replicas own while they still serve
    (module docstring, "Scale-in notice"): the hand-off of the chains a survivor holds, as
    `hand_off_plan`, and a warm-up of each other chain on the survivor with the most room
    (less the blocks handed or warmed on it so far, so the chains spread). Reads `state`,
    changes nothing."""
    return _plan_chains(leaving, survivors, state, config, rng, now, warm=True)


def _plan_chains(
    leaving: Iterable[str],
    survivors: Sequence[ReplicaLoad],
    state: RouterState,
    config: RoutingConfig,
    rng: random.Random,
    now: float,
    warm: bool,
) -> tuple[dict[str, dict[int, str]], list[WarmUp]]:
    chains = [
        (rid, root, len(hashes))
        for rid in leaving
        for root, hashes in state.owned_chains(rid).items()
    ]
    if not chains or not survivors:
        return {}, []
    ids = [ld.replica_id for ld in survivors]
    reported = [ld for ld in survivors if ld.reported]
    if reported:
        fv = _fleet_view(survivors, reported, state, config, now)
        room = {rid: fv.room[rid] - fv.backlog[rid] for rid in ids}
        waiting = fv.waiting
        capped = {rid for rid in ids if not fv.within_cap(rid, config)}
        views = fv.views
    else:  # no report yet: the fewest blocks sent
        pend = {ld.replica_id: state.pending_load(ld, config, now) for ld in survivors}
        room = {rid: -pend[rid].blocks for rid in ids}
        waiting = {rid: pend[rid].requests for rid in ids}
        capped, views = set(), list(survivors)
    # What each survivor holds: its digest, and what this router sent it since its report.
    held = [(ld.replica_id, ld.prefix_digest, state.sent_hashes(ld, config, now)) for ld in views]
    open_ids = [r for r in ids if r not in capped]
    tie = {rid: rng.random() for rid in ids}
    taken = dict.fromkeys(ids, 0)  # blocks of ownership handed (or warmed) on each so far
    plan: dict[str, dict[int, str]] = {}
    warmups: list[WarmUp] = []
    # Heaviest first, so the big chains spread before the small ones fill the gaps.
    for rid, root, weight in sorted(chains, key=lambda c: -c[2]):
        holders = [
            r for r, digest, sent in held if r not in capped and (root in sent or root in digest)
        ]
        if holders:
            to = max(holders, key=lambda r: (room[r] - taken[r], -waiting[r], tie[r]))
            plan.setdefault(rid, {})[root] = to
        elif warm and open_ids:
            to = max(open_ids, key=lambda r: (room[r] - taken[r], -waiting[r], tie[r]))
            hashes = state.warm_prefix(rid, root)
            if not hashes:
                continue  # nothing reused: not worth a warm-up
            warmups.append(WarmUp(rid, root, to, hashes))
        else:
            continue
        taken[to] += weight
    return plan, warmups


def hand_off_and_retain(
    state: RouterState,
    survivors: Sequence[ReplicaLoad],
    config: RoutingConfig,
    rng: random.Random,
    now: float,
) -> dict[str, dict[int, str]]:
    """`RouterState.retain` the `survivors`, first handing the leavers' prompt chains to
    them (`hand_off_plan`); returns the plan."""
    live = {ld.replica_id for ld in survivors}
    leaving = [rid for rid in state.owning_replicas() if rid not in live]
    plan = hand_off_plan(leaving, survivors, state, config, rng, now)
    for rid, chains in plan.items():
        state.hand_off(rid, chains)
    state.retain(live)
    return plan


def round_robin_ranking(replica_ids: Iterable[str], counter: int) -> tuple[str, ...]:
    """Replicas in a fixed (sorted) order, rotated by `counter`: the i-th request's first
    choice is the (i mod n)-th replica, the rest follow as fallbacks."""
    ids = sorted(replica_ids)
    if not ids:
        return ()
    k = counter % len(ids)
    return tuple(ids[k:] + ids[:k])
