"""One routing view across ingress replicas: each router publishes what it sent, and merges
what every other router of the deployment sent (`RouterState.merge_peer`,
`RouterState.merge_owners`).

Protocol. Every `shared_view_period_s` a router makes one exchange with the deployment's
`ViewHub` (one small actor per deployment, `serve_routers`), off its requests' path: it
sends its `Publication` (its own reservations and sent prompts that no report includes
yet, a snapshot; and its ownership records since the hub last acknowledged them, a log)
and gets back, per peer router heard from within `peer_ttl_s`, that peer's latest
snapshot and its ownership records it has not seen (`PeerUpdate`). A choice never waits
for it: it reads the state as last merged.

Bound. A send is in every other router's view at most one period plus one exchange after
it was made: the sender's next exchange puts it in the hub, each peer's next exchange
takes it (both at most a period apart), each exchange one round trip of the hub actor.
A burst that arrives faster than that is placed by each router on its own view plus what
it merged before the burst; each router still spreads its own share.

Merge (exact). A peer's snapshot replaces its previous one in this router's ledgers (under
keys of its own, `peer_key`), less what the replicas' reports already include; ownership
records are applied in the order each peer made them, a record only if it is at least as
recent as the last one applied for its prompt's first block, so every router converges on
the latest sender's owner whatever order the records reach it.

Degraded. An exchange that fails or does not answer within `shared_view_timeout_s` drops
every peer's entries (the router routes on its own view and the reports, as without the
hub) and is retried next period; `ViewHealth.shared` says which (the router's gauge
`pagefleet:router_shared_view`).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pagefleet.cluster.routing.config import RoutingConfig
from pagefleet.cluster.routing.ledger import InFlight, SentPrompt
from pagefleet.cluster.routing.state import OwnerRecord, RouterState


@dataclass(frozen=True)
class Publication:
    """What one router tells the hub: its reservations and sent prompts (request id ->
    entry) that no report includes yet, and its ownership records after `acked`."""

    reservations: Mapping[str, InFlight]
    sent: Mapping[str, SentPrompt]
    owners: Sequence[OwnerRecord] = ()


@dataclass(frozen=True)
class PeerUpdate:
    """One peer as the hub answers it: its latest snapshot and its ownership records
    after the sequence number the asking router last merged."""

    reservations: Mapping[str, InFlight]
    sent: Mapping[str, SentPrompt]
    owners: Sequence[OwnerRecord]


@dataclass
class _Peer:
    publication: Publication
    heard_at: float
    log: deque[OwnerRecord]


@dataclass
class ViewHub:
    """The deployment's routers' publications (the actor `serve_routers` runs).

    Keeps each router's latest snapshot and its last `max_records` ownership records; a
    router not heard from within `peer_ttl_s` (a stopped ingress) is dropped."""

    peer_ttl_s: float = 10.0
    max_records: int = 65536
    _peers: dict[str, _Peer] = field(default_factory=dict)

    def exchange(
        self, router: str, publication: Publication, since: Mapping[str, int], now: float
    ) -> dict[str, PeerUpdate]:
        """Store `router`'s publication; every other live router's update for it."""
        peer = self._peers.get(router)
        if peer is None:
            peer = self._peers[router] = _Peer(publication, now, deque(maxlen=self.max_records))
        peer.publication, peer.heard_at = publication, now
        last = peer.log[-1][0] if peer.log else 0
        peer.log.extend(r for r in publication.owners if r[0] > last)
        for gone in [k for k, p in self._peers.items() if now - p.heard_at > self.peer_ttl_s]:
            del self._peers[gone]
        return {k: self._update(p, since.get(k, 0)) for k, p in self._peers.items() if k != router}

    @staticmethod
    def _update(peer: _Peer, after: int) -> PeerUpdate:
        records = records_after(peer.log, after)
        pub = peer.publication
        return PeerUpdate(pub.reservations, pub.sent, records)


def records_after(log: Sequence[OwnerRecord], seq: int) -> list[OwnerRecord]:
    """The records of `log` (in rising sequence order) after sequence number `seq`, read
    from the newest end: a full log is not walked for the few new ones."""
    newer = list(itertools.takewhile(lambda r: r[0] > seq, reversed(log)))
    newer.reverse()
    return newer


@dataclass
class ViewClient:
    """One router's side of the protocol: what it publishes (`publication`) and how it
    merges the hub's answer (`merged`) or routes on its own view (`failed`).

    `acked`: its last ownership record the hub has; `since`: per peer, the last of that
    peer's records merged here; `shared`: whether the last exchange merged its peers."""

    acked: int = 0
    since: dict[str, int] = field(default_factory=dict)
    shared: bool = False

    def publication(self, state: RouterState) -> Publication:
        reservations, sent = state.own_entries()
        records = records_after(state.owner_log, self.acked)
        return Publication(reservations, sent, records)

    def merged(
        self,
        state: RouterState,
        publication: Publication,
        answer: Mapping[str, PeerUpdate],
        config: RoutingConfig,
        now: float,
    ) -> None:
        """The hub took `publication` and answered `answer`: merge every peer in it,
        forget the peers it no longer lists."""
        if publication.owners:
            self.acked = publication.owners[-1][0]
        state.drop_peers(answer.keys())
        for peer, update in answer.items():
            state.merge_peer(peer, update.reservations, update.sent, config, now)
            state.merge_owners(update.owners)
            if update.owners:
                self.since[peer] = update.owners[-1][0]
        self.since = {k: v for k, v in self.since.items() if k in answer}
        self.shared = True

    def failed(self, state: RouterState) -> None:
        """The hub did not answer: route on this router's own view."""
        state.drop_peers()
        self.since.clear()
        self.acked = 0  # a new hub has none of them: send them all again
        self.shared = False
