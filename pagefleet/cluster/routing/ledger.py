"""What a router sent each replica that the replica's report does not include yet: its
reservations and its prompts, per replica in the order sent with running totals.

Invariants, after every public method of `Ledger`:

- `_by_replica` has a key exactly for the replicas some entry names, and each replica's
  totals are the sum over its entries (subclasses keep them, `tally`); a replica with no
  entries has no totals.
- Each live entry appears once in its replica's `Sends`, in `routed_at` order; tombstones
  never outnumber live entries and the spent front never outgrows the rest, so memory
  follows the entries.
- What a report includes is the front of that order (`reported_or_stale` is monotone in
  `routed_at`), so "what this replica was sent that its report does not include" is the
  totals less the front entries the report includes, and `expire` removes exactly those.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Generic, NamedTuple, TypeVar

from pagefleet.cluster.routing.config import RoutingConfig


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


def reported_or_stale(
    report_time: float | None, routed_at: float, config: RoutingConfig, now: float
) -> bool:
    """Whether an entry sent at `routed_at` no longer counts as pending: the replica's
    report (taken at `report_time`; None: no report) includes it, or it is too old.

    Both tests are monotone in `routed_at` (a float sum or difference with a fixed
    operand rounds monotonically), so among a replica's entries in the order sent
    those it holds for are always the oldest ones: `Ledger` relies on that."""
    return (
        report_time is not None and report_time >= routed_at + config.stats_include_slack_s
    ) or now - routed_at > config.max_in_flight_age_s


Entry = TypeVar("Entry", InFlight, SentPrompt)


@dataclass
class Sends(Generic[Entry]):
    """One replica's entries of a `Ledger`, oldest sent first.

    `items[head:]` holds every live entry of the replica once, sorted by `routed_at`
    (ties in insertion order), among `dead` tombstones: entries removed from the
    ledger since (finished, withdrawn, sent again), recognised because the ledger
    no longer maps their request id to that very object. `items[:head]` is spent.

    `checked_report`, `checked_config` and `front_at` remember the last `expire`: with
    that report and config, the entry sent at `front_at` (the first it kept) was not
    due, so no entry is until the clock ages it (`Ledger.nothing_due`). Entries leave
    only from the front or as tombstones and arrive at the back, which only makes the
    real front newer than `front_at`: the shortcut can run `expire` for nothing, never
    skip one that would remove something. An entry sorted in out of order (a clock
    that stepped back) clears it."""

    items: list[tuple[float, str, Entry]] = field(default_factory=list)
    head: int = 0
    dead: int = 0
    checked_report: float | None = None
    checked_config: RoutingConfig | None = None
    front_at: float = math.inf

    @property
    def live(self) -> int:
        return len(self.items) - self.head - self.dead


class Ledger(Generic[Entry]):
    """Entries by request id (`entries`, one per request), and per replica the same
    entries in the order sent (`Sends`) with a running total of them (`_tally`).

    Invariants, after every public method:

    - `_by_replica` has a key exactly for the replicas some entry names, and each
      replica's totals are the sum over its entries in `entries` (subclasses keep
      them, `_tally`); a replica with no entries has no totals.
    - Each live entry appears once in its replica's `Sends`, in `routed_at` order;
      tombstones never outnumber live entries (`remove` compacts) and the spent
      front never outgrows the rest (`expire` trims it), so memory follows the
      entries.

    So a query "what has this replica been sent that its report does not include"
    is the totals minus the entries at the front of the order that the report does
    include (or that aged out, `reported_or_stale`), and `expire` removes exactly
    those front entries. Right after `expire` with the same report and clock the
    front holds none: the query costs O(1) however many requests are in flight.
    """

    def __init__(self) -> None:
        self.entries: dict[str, Entry] = {}
        self._by_replica: dict[str, Sends[Entry]] = {}
        # Replicas sent an entry since the router last checked them all (`RouterState.
        # reconcile` clears it): the only ones whose new entries a report may include.
        self.touched: set[str] = set()

    def _tally(self, entry: Entry, sign: int) -> None:
        """Add (`sign` 1) or subtract (-1) `entry` to its replica's totals."""
        raise NotImplementedError

    def _drop_totals(self, replica_id: str) -> None:
        """`replica_id` has no entries left: forget its (zero) totals."""
        raise NotImplementedError

    def replicas(self) -> list[str]:
        return list(self._by_replica)

    def add(self, request_id: str, entry: Entry) -> None:
        self.remove(request_id)
        self.entries[request_id] = entry
        self._tally(entry, 1)
        self.touched.add(entry.replica_id)
        sends = self._by_replica.setdefault(entry.replica_id, Sends())
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

    def _is_live(self, item: tuple[float, str, Entry]) -> bool:
        return self.entries.get(item[1]) is item[2]

    def live_items(self, replica_id: str) -> Sequence[tuple[float, str, Entry]]:
        """`replica_id`'s (routed_at, request id, entry) in the order sent, tombstones
        among them (an entry no longer in `entries` under its id)."""
        sends = self._by_replica.get(replica_id)
        return () if sends is None else sends.items[sends.head :]

    def excluded(
        self, replica_id: str, report_time: float | None, config: RoutingConfig, now: float
    ) -> list[Entry]:
        """`replica_id`'s entries that its report includes or that aged out, oldest first."""
        out: list[Entry] = []
        sends = self._by_replica.get(replica_id)
        if sends is None or self.nothing_due(sends, report_time, config, now):
            return out
        entries = self.entries
        for i in range(sends.head, len(sends.items)):
            routed_at, request_id, entry = sends.items[i]
            if entries.get(request_id) is not entry:
                continue  # a tombstone
            if not reported_or_stale(report_time, routed_at, config, now):
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
                if not reported_or_stale(report_time, item[0], config, now):
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
        sends: Sends[Entry], report_time: float | None, config: RoutingConfig, now: float
    ) -> bool:
        """Whether no entry of `sends` can be due (`reported_or_stale`): the last `expire`
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


class Reservations(Ledger[InFlight]):
    """`InFlight` entries; per replica their blocks, prefill tokens and number.
    `on_remove(replica_id)` hears every entry that leaves (`PrefillDrain.changed`)."""

    def __init__(self, on_remove: Callable[[str], None] = lambda rid: None) -> None:
        super().__init__()
        self.on_remove = on_remove
        self.blocks: dict[str, int] = {}
        self.count: dict[str, int] = {}
        self.prefill: dict[str, int] = {}

    def _tally(self, entry: InFlight, sign: int) -> None:
        rid = entry.replica_id
        self.blocks[rid] = self.blocks.get(rid, 0) + sign * entry.blocks
        self.count[rid] = self.count.get(rid, 0) + sign
        self.prefill[rid] = self.prefill.get(rid, 0) + sign * entry.prefill_tokens
        if sign < 0:
            self.on_remove(rid)

    def _drop_totals(self, replica_id: str) -> None:
        del self.blocks[replica_id], self.count[replica_id], self.prefill[replica_id]


class SentPrompts(Ledger[SentPrompt]):
    """`SentPrompt` entries; per replica the multiset of their hashes, as the set of
    hashes some entry holds (`held`) and the count of those more than one entry holds
    (`shared`, hash -> count >= 2).

    A replica's sends rarely share hashes within a report period, so adding and removing
    an entry is mostly set arithmetic over its frozenset; only the shared hashes are
    counted one by one."""

    def __init__(self) -> None:
        super().__init__()
        self.held: dict[str, set[int]] = {}
        self.shared: dict[str, dict[int, int]] = {}

    def _tally(self, entry: SentPrompt, sign: int) -> None:
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
class HashesLess:
    """`replica_id`'s sent hashes (a multiset) less those of `minus`: membership only."""

    sent: SentPrompts
    replica_id: str
    minus: Mapping[int, int]

    def __contains__(self, h: object) -> bool:
        n = self.sent.count(self.replica_id, h)  # type: ignore[arg-type]
        return n > self.minus.get(h, 0)  # type: ignore[call-overload]
