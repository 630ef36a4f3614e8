"""The router's state (`RouterState`): what it sent each replica that the replica's report
does not include yet, and the replica each prompt block was last sent to.

Mutated only by the adapter's lifecycle calls (`on_routed`, `on_completed`, `withdraw`,
`reconcile`, `retain`, `hand_off`); the policy (`policy.choose_replica`) reads it.

Invariants:

- Every entry names a replica, so `retain` with the replicas Serve still offers keeps the
  state bounded by the live set.
- Per replica, the reservations and sent prompts are kept in the order sent with running
  totals (`ledger.Ledger`): after `reconcile` with the latest reports, `pending_load`,
  `prefill_backlog` and `sent_hashes` read O(1) per replica, whatever is in flight.
- `owners` is an LRU of prompt block hash -> replica, as many as the fleet's caches hold
  (within [affinity_memory_blocks, affinity_memory_max_blocks]); the chain index beside it
  (owner, chain root) -> the last prompt's hashes sent under that root covers at most the
  sends of the LRU's window and is what a hand-off moves. Its count of blocks per
  replica (`owned_blocks`) changes with every entry set or dropped: O(1) to read.
"""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict, deque
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from pagefleet.cluster.routing.config import RoutingConfig
from pagefleet.cluster.routing.ledger import (
    HashesLess,
    InFlight,
    Pending,
    Reservations,
    SentPrompt,
    SentPrompts,
    reported_or_stale,
)
from pagefleet.cluster.routing.prefill_drain import PrefillDrain
from pagefleet.cluster.routing.reports import ReplicaLoad

# How many of its own ownership records a router keeps for its peers (`owner_log`).
OWNER_LOG_RECORDS = 65536
# (seq, time sent, owner, the prompt's block hashes): one ownership this router set.
OwnerRecord = tuple[int, float, str, tuple[int, ...]]


def peer_key(peer: str, request_id: str) -> str:
    """A peer router's request under a key no local request id has."""
    return f"\x1f{peer}\x1f{request_id}"


def is_peer_key(key: str) -> bool:
    return key.startswith("\x1f")


class PromptOwners(OrderedDict[int, str]):
    """Prompt block hash -> the replica it was last sent to, least recently sent first,
    with the number of blocks each replica owns kept as entries are set and dropped."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.counts: dict[str, int] = {}
        super().__init__(*args, **kwargs)

    def __setitem__(self, h: int, replica_id: str) -> None:
        old = self.get(h)
        if old != replica_id:
            if old is not None:
                self._uncount(old)
            self.counts[replica_id] = self.counts.get(replica_id, 0) + 1
        super().__setitem__(h, replica_id)

    def __delitem__(self, h: int) -> None:
        self._uncount(self[h])
        super().__delitem__(h)

    def popitem(self, last: bool = True) -> tuple[int, str]:
        h, replica_id = super().popitem(last)
        self._uncount(replica_id)
        return h, replica_id

    def pop(self, h: int, *default: str) -> str:  # type: ignore[override]
        if h in self:
            self._uncount(self[h])
        return super().pop(h, *default)

    def clear(self) -> None:
        self.counts.clear()
        super().clear()

    def __reduce__(self) -> tuple[type[PromptOwners], tuple[list[tuple[int, str]]]]:
        return type(self), (list(self.items()),)

    def _uncount(self, replica_id: str) -> None:
        left = self.counts[replica_id] - 1
        if left:
            self.counts[replica_id] = left
        else:
            del self.counts[replica_id]


def common_run(a: Iterable[object], b: Iterable[object]) -> int:
    """How many leading items `a` and `b` share (up to the shorter's end)."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


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
    (`Ledger`, `SentPrompts`). What a report includes is the front of that order,
    so `pending` and `sent_hashes` are the totals less that front, which `reconcile`
    (run before each choice with the same reports) has just removed: O(1) per
    replica, and one dict look-up per prompt block instead of a union of every
    pending prompt's hashes. Sends, completions and expiries cost O(prompt blocks)
    each, once per request.
    """

    owners: PromptOwners = field(default_factory=PromptOwners)
    memory_blocks: int = RoutingConfig.affinity_memory_blocks
    memory_max_blocks: int = RoutingConfig.affinity_memory_max_blocks
    # The reported fleet's KV blocks (`reconcile`): `owners` keeps that many, within
    # [memory_blocks, max(memory_blocks, memory_max_blocks)], so a prompt still cached
    # keeps its owner.
    fleet_blocks: int = field(default=0, init=False)
    # Each replica's prefill rate and its backlog between reports (`prefill_backlog`);
    # told of every reservation that leaves.
    _drain: PrefillDrain = field(default_factory=PrefillDrain, init=False, repr=False)
    _reservations: Reservations = field(init=False, repr=False)
    _sent: SentPrompts = field(default_factory=SentPrompts, init=False, repr=False)
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
    _oldest_front: float = field(default=math.inf, init=False, repr=False)
    # The shared view: per peer router, the keys of its entries in the ledgers; the time
    # of the ownership record last applied per chain root (pruned with `owners`); this
    # router's own ownership records, newest last, numbered from 1.
    _peers: dict[str, tuple[set[str], set[str]]] = field(
        default_factory=dict, init=False, repr=False
    )
    _root_time: dict[int, float] = field(default_factory=dict, init=False, repr=False)
    owner_log: deque[OwnerRecord] = field(
        default_factory=lambda: deque(maxlen=OWNER_LOG_RECORDS), init=False, repr=False
    )
    _owner_seq: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        self._reservations = Reservations(self._drain.changed)

    @property
    def in_flight(self) -> Mapping[str, InFlight]:
        """Reservations by request id (read-only)."""
        return MappingProxyType(self._reservations.entries)

    @property
    def sent(self) -> Mapping[str, SentPrompt]:
        """Prompts sent and not yet seen in their replica's report, by request id."""
        return MappingProxyType(self._sent.entries)

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
            self._own(hashes, owner or replica_id)
            self._record_owner(tuple(hashes), owner or replica_id, now)

    def _record_owner(self, hashes: tuple[int, ...], owner: str, now: float) -> None:
        """Log an ownership this router set, for its peers (`owner_log`)."""
        self._root_time[hashes[0]] = now
        self._owner_seq += 1
        self.owner_log.append((self._owner_seq, now, owner, hashes))

    def _own(self, hashes: Sequence[int], new: str) -> None:
        """Record `new` as the owner of each of `hashes` (the LRU's newest, in prompt
        order), drop the least recently sent past the memory, and index the chain."""
        owners, chains, root = self.owners, self._chain_hashes, hashes[0]
        # The root's last prompt (its owner's entry), before this send takes it over.
        prev = chains.get((owners.get(root), root))  # type: ignore[arg-type]
        for h in hashes:
            owners[h] = new
            owners.move_to_end(h)
        memory = max(self.memory_blocks, min(self.fleet_blocks, self.memory_max_blocks))
        while len(owners) > memory:
            self._root_time.pop(owners.popitem(last=False)[0], None)
        if prev is not None and prev is not hashes:  # not this request's own, again
            self._chain_shared[(new, root)] = common_run(prev, hashes)
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
        self._reconciled_config = config

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
            self._root_time.pop(h, None)

    def own_entries(self) -> tuple[dict[str, InFlight], dict[str, SentPrompt]]:
        """This router's own reservations and sent prompts (peers' left out), by request
        id: what it publishes to the shared view."""
        return (
            {k: e for k, e in self._reservations.entries.items() if not is_peer_key(k)},
            {k: e for k, e in self._sent.entries.items() if not is_peer_key(k)},
        )

    def merge_peer(
        self,
        peer: str,
        reservations: Mapping[str, InFlight],
        sent: Mapping[str, SentPrompt],
        config: RoutingConfig,
        now: float,
    ) -> None:
        """Make `peer`'s entries in this router's ledgers exactly its snapshot, less what
        the replicas' last reports include (`reported_or_stale`)."""
        held = self._peers.setdefault(peer, (set(), set()))
        for ledger, keys, snapshot in (
            (self._reservations, held[0], reservations),
            (self._sent, held[1], sent),
        ):
            fresh = {
                peer_key(peer, rid): e
                for rid, e in snapshot.items()
                if not self._reported(e.replica_id, e.routed_at, config, now)
            }
            for key in keys - fresh.keys():
                ledger.remove(key)  # type: ignore[attr-defined]
            for key, entry in fresh.items():
                if ledger.entries.get(key) != entry:  # type: ignore[attr-defined]
                    ledger.add(key, entry)  # type: ignore[attr-defined]
                    self._drain.changed(entry.replica_id)
            keys.clear()
            keys.update(fresh)

    def _reported(
        self, replica_id: str, routed_at: float, config: RoutingConfig, now: float
    ) -> bool:
        """Whether `replica_id`'s last report seen includes a send at `routed_at`."""
        load = self._observed.get(replica_id)
        report_time = load.timestamp if load is not None and load.reported else None
        return reported_or_stale(report_time, routed_at, config, now)

    def merge_owners(self, records: Iterable[OwnerRecord]) -> None:
        """Apply a peer's ownership records, oldest first: each only if it is at least as
        recent as the last applied for its chain root, so routers agree on the latest."""
        for _seq, at, owner, hashes in records:
            if hashes and at >= self._root_time.get(hashes[0], -math.inf):
                self._own(hashes, owner)
                self._root_time[hashes[0]] = at

    def drop_peers(self, keep: Container[str] = ()) -> None:
        """Forget the entries of every peer not in `keep` (all: the router's own view)."""
        for peer in [p for p in self._peers if p not in keep]:
            reservations, sent = self._peers.pop(peer)
            for key in reservations:
                self._reservations.remove(key)
            for key in sent:
                self._sent.remove(key)

    def peers(self) -> list[str]:
        """The peer routers whose entries are merged."""
        return list(self._peers)

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

    def sent_hashes(self, load: ReplicaLoad, config: RoutingConfig, now: float) -> Container[int]:
        """Prompt block hashes sent to `load`'s replica that its report does not include."""
        rid = load.replica_id
        report_time = load.timestamp if load.reported else None
        minus: dict[int, int] = {}
        for f in self._sent.excluded(rid, report_time, config, now):
            for h in f.hashes:
                minus[h] = minus.get(h, 0) + 1
        return HashesLess(self._sent, rid, minus) if minus else self._sent.held.get(rid, set())

    def owned_run(self, hashes: Sequence[int], replica_id: str) -> int:
        """Leading `hashes` whose last recorded destination is `replica_id`."""
        return common_run((self.owners.get(h) for h in hashes), itertools.repeat(replica_id))

    def owned_blocks(self, replica_id: str) -> int:
        """Prompt blocks whose last recorded destination is `replica_id`."""
        return self.owners.counts.get(replica_id, 0)

    def reserved_blocks(self, replica_id: str) -> int:
        return self._reservations.blocks.get(replica_id, 0)
