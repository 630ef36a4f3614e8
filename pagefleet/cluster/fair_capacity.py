"""The ingress's side of fair queuing on Serve: the queue's capacity from the controller.

With `fairness.enabled`, an `Ingress` puts the fair queue (`http/fair_admission.py`) in
front of its backend; `serve_capacity` is where the queue asks its capacity
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

import asyncio

from ray import serve

from .config import ServeConfig
from .fleet_state import LIVE_STATES, FleetState
from .http.fair_admission import Slots

STATUS_TIMEOUT_S = 5.0


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
    """The queue's capacity as Serve's controller reports the engine deployment."""

    def __init__(self, config: ServeConfig, app_name: str, deployment: str) -> None:
        self._config = config
        self._app_name = app_name
        self._deployment = deployment

    async def __call__(self) -> Slots:
        if self._config.fairness.max_in_flight is not None:
            return capacity_of(self._config, 0)
        status = await asyncio.wait_for(asyncio.to_thread(serve.status), STATUS_TIMEOUT_S)
        fleet = FleetState.from_serve_status(status, self._app_name, self._deployment)
        running = fleet.count(LIVE_STATES) or configured_replicas(self._config)
        return capacity_of(self._config, running)


def serve_capacity(config: ServeConfig, deployment: str) -> ServeCapacity:
    """The capacity of this ingress's fair queue, for the engine deployment `deployment`."""
    ctx = serve.get_replica_context()
    app_name = (ctx.app_name if ctx is not None else None) or "default"
    return ServeCapacity(config, app_name, deployment)
