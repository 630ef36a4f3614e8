"""One router's lifecycle around the policy: the calls the Serve adapter
(`serve_routers.MostFreeBlocksRouter`) and the lab's simulator both make, written once.

Per request: `reconcile` with the latest reports, then `choose` among the replicas a
scale-in notice leaves it (`ScaleInNotice.routable`), then `record` the choice on its
first replica (a reservation, its prompt blocks sent there, their owner; and the prompt,
for a warm-up should its owner leave). Per report poll nothing but `reconcile`; per
completion `RouterState.on_completed`. On a scale-in notice `hear`; while warm-ups wait,
`due_warm_ups` on replicas with compute to spare, each sent with `send_warm_up` and
ended with `warm_up_ended`. When the replica set shrinks, `retain` the survivors (the
leavers' prompt chains handed to them first).

The router holds no state of its own: the settings, the state, the random generator and
the notice are the caller's, passed in.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from pagefleet.cluster.routing.config import RoutingConfig
from pagefleet.cluster.routing.policy import RouteDecision, RouteRequest, choose_replica
from pagefleet.cluster.routing.reports import ReplicaLoad
from pagefleet.cluster.routing.scale_in import (
    ScaleInNotice,
    WarmUp,
    WarmUpSend,
    hand_off_and_retain,
    route_warm_up,
    spare_compute,
)
from pagefleet.cluster.routing.state import RouterState

P = TypeVar("P")


@dataclass(frozen=True)
class Router(Generic[P]):
    """The most_free_blocks router over `state` (module docstring)."""

    config: RoutingConfig
    state: RouterState
    rng: random.Random
    notice: ScaleInNotice[P]

    def reconcile(self, loads: Sequence[ReplicaLoad], now: float) -> None:
        self.state.reconcile(loads, self.config, now)

    def choose(
        self, request: RouteRequest, loads: Sequence[ReplicaLoad], now: float
    ) -> RouteDecision:
        """Rank the replicas `request` may go to (after `reconcile`)."""
        routable = self.notice.routable(loads, request.prompt_block_hashes, self.state)
        return choose_replica(request, routable, self.state, self.config, self.rng, now)

    def record(
        self, request: RouteRequest, decision: RouteDecision, now: float, prompt: P | None
    ) -> None:
        """Reserve `request` on its first choice; remember `prompt` unless None."""
        first, hashes = decision.replica_id, request.prompt_block_hashes
        self.state.on_routed(
            request.request_id,
            first,
            decision.cost_blocks[first],
            now,
            hashes,
            decision.owner,
            decision.prefill_tokens.get(first, 0),
        )
        if prompt is not None:
            self.notice.remember(decision.owner or first, hashes, prompt)

    def hear(self, leavers: Collection[str], loads: Sequence[ReplicaLoad], now: float) -> None:
        """A scale-in notice names `leavers` (empty: withdrawn)."""
        self.notice.hear(leavers, loads, self.state, self.config, self.rng, now)

    def due_warm_ups(self, loads: Sequence[ReplicaLoad], now: float) -> list[WarmUpSend[P]]:
        """The warm-ups to send now, on survivors with compute to spare."""
        return self.notice.due(spare_compute(loads, self.state, self.config, now))

    def send_warm_up(
        self, request_id: str, warm_up: WarmUp, prompt_tokens: int, now: float
    ) -> None:
        route_warm_up(self.state, request_id, warm_up, prompt_tokens, now)

    def warm_up_ended(self, warm_id: str) -> bool:
        return self.notice.ended(warm_id, self.state)

    def retain(self, survivors: Sequence[ReplicaLoad], now: float) -> None:
        """Serve offers only `survivors` now: the leavers' chains go to them first."""
        hand_off_and_retain(self.state, survivors, self.config, self.rng, now)
        self.notice.retain({ld.replica_id for ld in survivors})
