"""Scale-in: what happens to the prompt chains a leaving replica owns.

The hand-off (`hand_off_and_retain`, `hand_off_plan`): before a replica Serve no longer
offers is forgotten, each prompt chain it owns (a chain root, a prompt's first block
hash, with the blocks of it it owns, `RouterState.owned_chains`) goes whole to ONE
survivor that holds the chain's root (its digest, or what this router sent it since its
report) and is within the cap: of those, the one with the most room less backlog, less
the blocks of ownership handed to it so far in this hand-off, then the shorter queue,
then the injected rng; heaviest chain first. A chain no survivor holds is dropped:
ownership counts only as far as its owner holds the prompt.

The notice (`ScaleInNotice`, `scale_in_notice_plan`): while a leaver still serves, each
chain it owns goes to a survivor that holds it at once, or, when none does, to the
survivor with the most room less what the plan put on it so far, which is sent a warm-up
first (the chain's reused blocks, `RouterState.warm_prefix`, one token out, one warm-up in
flight per survivor); the chain is handed over when its warm-up ends.

The autoscaler announces a scale-in `scale_in_notice_s` before it is due
(`autoscaling.Decision.leaving`: how many replicas will go). `ScaleInNotice` holds what
a router does with it between the announcement and the scale-in (the algorithm is
above); the adapters (`serve_routers.py` on
Serve, the lab's simulator) feed it and carry out what it says:

- `remember` each prompt routed, under the owner and chain root the router recorded it
  with, so that a chain can be computed again elsewhere (its tokens);
- `hear` the notice with the replicas expected to leave (`newest`): the plan
  (`scale_in_notice_plan`) hands the chains a survivor holds to it at once and queues
  one warm-up per other reused chain on the survivor it names;
- `due`: the warm-ups to send now, at most one in flight per survivor (a user's request
  there waits behind one prefill at most), each under an id of its own; the adapter
  routes it to its survivor with `RouterState.on_routed`, the leaver still the owner;
- `ended` when one finishes: its chain is handed to the survivor that now caches it;
- `routable`: under a notice a leaver takes only the chains it still owns (until their
  warm-ups end), prompts too short to start a chain, or what no one else can take.

A withdrawn notice (`hear` with no leavers) drops what is queued; the chains already
handed over stay where they went. Everything is bounded: the remembered prompts by
`memory` (in the adapter's `cost` units, least recently routed dropped first), the
queues by the leavers' chains.
"""

from __future__ import annotations

import itertools
import random
import threading
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any, Generic, NamedTuple, Protocol, TypeVar

from pagefleet.cluster.routing.config import RoutingConfig
from pagefleet.cluster.routing.policy import fleet_view
from pagefleet.cluster.routing.reports import ReplicaLoad
from pagefleet.cluster.routing.state import RouterState


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
    return plan_chains(leaving, survivors, state, config, rng, now, warm=False)[0]


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
    return plan_chains(leaving, survivors, state, config, rng, now, warm=True)


def plan_chains(
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
        fv = fleet_view(survivors, state, config, now)
        room = {rid: t.room - t.backlog for rid, t in fv.terms.items()}
        waiting = {rid: t.waiting for rid, t in fv.terms.items()}
        capped = {rid for rid in ids if not fv.within_cap(rid, config)}
        views = [t.load for t in fv.terms.values()]
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


P = TypeVar("P")


class WarmUpSource(Protocol):
    """A router with warm-ups for its process to send (`serve_routers.MostFreeBlocksRouter`)."""

    warm_up_outbox: deque[Any]


# The routers of this process with warm-ups to send. Here, not in serve_routers.py:
# Serve pickles a router's module by value (`RequestRouterConfig`), so every router
# class it unpickles has its own copy of that module's globals, and a registry there
# would not be the one the ingress reads.
_SOURCES: weakref.WeakSet[Any] = weakref.WeakSet()
_SOURCES_LOCK = threading.Lock()  # routers register on Serve's loop, the ingress reads on its own


def register_warm_up_source(source: WarmUpSource) -> None:
    with _SOURCES_LOCK:
        _SOURCES.add(source)


def take_warm_ups() -> list[Any]:
    """The warm-ups this process's routers want sent now, each pinned to its replica
    (`replica_messages.ReplicaRequest.replica`); taken, so each is returned once.
    Thread-safe: the routers fill their outboxes on Serve's router loop."""
    out: list[Any] = []
    with _SOURCES_LOCK:
        sources = list(_SOURCES)
    for source in sources:
        box = source.warm_up_outbox
        while box:
            out.append(box.popleft())
    return out


def spare_compute(
    loads: Sequence[ReplicaLoad], state: RouterState, config: RoutingConfig, now: float
) -> Callable[[str], bool]:
    """Whether a replica has compute to spare for a warm-up: it reported no waiting
    request, and no prompt tokens are left to compute there by this router's reckoning
    (`RouterState.prefill_backlog`: its report's and the prefills sent since, drained)."""
    by_id = {ld.replica_id: ld for ld in loads}

    def spare(replica_id: str) -> bool:
        ld = by_id.get(replica_id)
        if ld is None or not ld.reported or ld.waiting > 0:
            return False
        return state.prefill_backlog(ld, config, now) <= 0

    return spare


def route_warm_up(
    state: RouterState, request_id: str, warm_up: WarmUp, prompt_tokens: int, now: float
) -> None:
    """Record a warm-up sent to its survivor as `request_id`: its blocks and its one
    token's reserved there, its prompt blocks sent there, their owner still the leaver
    (`ScaleInNotice.ended` hands them over once it is cached)."""
    state.on_routed(
        request_id,
        warm_up.replica_id,
        len(warm_up.hashes) + 1,
        now,
        warm_up.hashes,
        warm_up.leaver,
        prompt_tokens,
    )


def newest(order: Sequence[str], leaving: int) -> frozenset[str]:
    """The replicas a scale-in of `leaving` will stop: the newest of `order` (oldest
    first), as Serve stops the newest replicas on a node first; never all of them."""
    n = min(leaving, len(order) - 1)
    return frozenset(order[len(order) - n :]) if n > 0 else frozenset()


class WarmUpSend(NamedTuple, Generic[P]):
    """A warm-up to send now: its id, what it computes, and the prompt it comes from
    (its first `len(warm_up.hashes)` blocks' tokens are the warm-up's prompt)."""

    warm_id: str
    warm_up: WarmUp
    prompt: P


class ScaleInNotice(Generic[P]):
    """The notice's state (module docstring): leavers, the remembered prompts, the
    warm-ups queued per survivor and those in flight."""

    def __init__(
        self,
        memory: int = 1 << 16,
        cost: Callable[[P], int] = lambda p: 1,
        id_prefix: str = "warm-up",
    ) -> None:
        """`memory`: the remembered prompts' total `cost` at most; `id_prefix`: the
        warm-ups' ids are it and a count (unique across routers: the engine keys requests
        by id)."""
        self.memory = memory
        self._cost = cost
        self._id_prefix = id_prefix
        self.leaving: frozenset[str] = frozenset()
        self._prompts: OrderedDict[tuple[str, int], P] = OrderedDict()
        self._remembered = 0  # the prompts' total cost
        self._queued: dict[str, deque[WarmUp]] = {}
        self._in_flight: dict[str, WarmUp] = {}  # warm id -> warm-up
        self._ids = itertools.count()

    def remember(self, owner: str, hashes: Sequence[int], prompt: P) -> None:
        """`prompt` was routed, its chain recorded under (`owner`, its first hash)."""
        if not hashes:
            return
        key = (owner, hashes[0])
        old = self._prompts.pop(key, None)
        if old is not None:
            self._remembered -= self._cost(old)
        self._prompts[key] = prompt
        self._remembered += self._cost(prompt)
        while self._remembered > self.memory and len(self._prompts) > 1:
            _, dropped = self._prompts.popitem(last=False)
            self._remembered -= self._cost(dropped)

    def hear(
        self,
        leaving: Collection[str],
        loads: Sequence[ReplicaLoad],
        state: RouterState,
        config: RoutingConfig,
        rng: random.Random,
        now: float,
    ) -> None:
        """The notice names `leaving` (empty: withdrawn, or the scale-in came). Hands
        the leavers' held chains over and queues the warm-ups of the rest."""
        self.leaving = frozenset(leaving)
        self._queued.clear()
        if not self.leaving:
            return
        survivors = [ld for ld in loads if ld.replica_id not in self.leaving]
        plan, warm = scale_in_notice_plan(self.leaving, survivors, state, config, rng, now)
        for rid, chains in plan.items():
            state.hand_off(rid, chains)
        for w in warm:
            if (w.leaver, w.root) in self._prompts:
                self._queued.setdefault(w.replica_id, deque()).append(w)

    def due(self, spare: Callable[[str], bool] = lambda replica_id: True) -> list[WarmUpSend[P]]:
        """The warm-ups to send now: the next queued one of each survivor with none in
        flight and, by `spare`, compute to spare (a warm-up yields to users' requests).
        The adapter routes each to `warm_up.replica_id`, its prompt the first
        `len(warm_up.hashes)` blocks of `prompt`, the leaver still their owner. Cheap
        when nothing is queued: adapters call it often (a survivor that had no compute
        to spare is asked again)."""
        if not self.queued:
            return []
        busy = {w.replica_id for w in self._in_flight.values()}
        out: list[WarmUpSend[P]] = []
        for rid, queue in self._queued.items():
            if not queue or rid in busy or not spare(rid):
                continue
            while queue:
                w = queue.popleft()
                prompt = self._prompts.get((w.leaver, w.root))
                if prompt is None or w.leaver not in self.leaving:
                    continue
                warm_id = f"{self._id_prefix}-{next(self._ids)}"
                self._in_flight[warm_id] = w
                out.append(WarmUpSend(warm_id, w, prompt))
                break
        return out

    @property
    def queued(self) -> bool:
        """Whether warm-ups wait to be sent."""
        return any(self._queued.values())

    def ended(self, warm_id: str, state: RouterState) -> bool:
        """The warm-up `warm_id` finished (any outcome): its chain goes to the survivor
        that computed it, if its leaver is still leaving. False for an unknown id."""
        w = self._in_flight.pop(warm_id, None)
        if w is None:
            return False
        if w.leaver in self.leaving:
            state.hand_off(w.leaver, {w.root: w.replica_id})
        return True

    def routable(
        self, loads: Sequence[ReplicaLoad], hashes: Sequence[int], state: RouterState
    ) -> Sequence[ReplicaLoad]:
        """The replicas a request may go to: under a notice, not a leaver, unless its
        chain is still a leaver's, or it has no full block (it starts no chain to lose),
        or no one else is left."""
        if not self.leaving or not hashes or state.owners.get(hashes[0]) in self.leaving:
            return loads
        return [ld for ld in loads if ld.replica_id not in self.leaving] or loads

    def retain(self, live: Collection[str]) -> None:
        """Serve offers only `live` now: leavers that left are no longer leaving."""
        self.leaving = frozenset(r for r in self.leaving if r in live)
        if not self.leaving:
            self._queued.clear()
