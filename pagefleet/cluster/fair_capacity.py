"""The ingress's side of fair queuing on Serve: the queue's capacity from the controller.

With `fairness.enabled`, an `Ingress` puts the fair queue (`http/fair_admission.py`) in
front of its backend; `ServeCapacity` is where the queue asks its capacity
(`fairness.py` says what saturated means):
`fairness.max_in_flight` when set, else `engine.max_num_seqs` plus
`fairness.ready_per_replica` times the engine replicas Serve's controller reports RUNNING
(the configured count when it cannot say, or reports none), shared evenly by the ingress
replicas, at least 1. The few ready beyond each batch wait in the engine's own queue, so
a sequence that ends is replaced in the engine's next step, not after its stream's end
has reached the ingress and the next request has come back. The queue holds at most what
the engines' queues would have held at the fleet's largest
(`max_waiting_requests` per replica) plus the ingress's own queue
(`max_queued_requests`): so an ingress holds no more than its `max_ongoing_requests`
allows, as without the queue, and one more waiting is the server's at-capacity 429.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from .config import ServeConfig
from .fleet_state import LIVE_STATES, FleetState
from .http.fair_admission import Slots


def configured_replicas(config: ServeConfig) -> int:
    scaling = config.autoscaling
    if scaling is None:
        return config.replicas
    return max(1, scaling.initial_replicas or scaling.min_replicas)


def capacity_of(config: ServeConfig, running: int) -> Slots:
    """One ingress's slots with `running` engine replicas (module docstring)."""
    fleet = max(config.replicas, config.autoscaling.max_replicas if config.autoscaling else 0)
    waiting = config.max_waiting_requests * fleet + config.ingress_max_queued_requests
    fairness = config.fairness
    if fairness.max_in_flight is not None:
        return Slots(fairness.max_in_flight, waiting)
    per_replica = config.engine.max_num_seqs + fairness.ready_per_replica
    slots = per_replica * running // config.ingress_replicas
    return Slots(max(1, slots), waiting)


class ServeCapacity:
    """The queue's capacity as Serve's controller reports the engine deployment, read
    through the ingress's own cached view of it (`fleet_state`: None when the
    controller cannot say, and the queue keeps its last capacity). The fleet's bounds
    (`replicas`, `autoscaling`) are live keys: the ingress passes each change on
    (`reconfigure`)."""

    def __init__(
        self, config: ServeConfig, fleet_state: Callable[[], Awaitable[FleetState | None]]
    ) -> None:
        self._config = config
        self._fleet_state = fleet_state

    def reconfigure(self, config: ServeConfig) -> None:
        self._config = config

    async def __call__(self) -> Slots:
        if self._config.fairness.max_in_flight is not None:
            return capacity_of(self._config, 0)
        fleet = await self._fleet_state()
        if fleet is None:
            raise RuntimeError("Serve's controller did not report the engine replicas")
        running = fleet.count(LIVE_STATES) or configured_replicas(self._config)
        return capacity_of(self._config, running)
