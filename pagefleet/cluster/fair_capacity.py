"""The ingress's side of fair queuing on Serve: the queue's capacity from the controller.

With `fairness.enabled`, an `Ingress` puts the fair queue (`http/fair_admission.py`) in
front of its backend; `serve_capacity` is where the queue asks its capacity
(`fairness.py` says what saturated means):
`fairness.max_in_flight` when set, else `engine.max_num_seqs` times the engine replicas
Serve's controller reports RUNNING (the configured count when it cannot say, or reports
none), shared evenly by the ingress replicas, at least 1.
"""

from __future__ import annotations

import asyncio

from ray import serve

from .config import ServeConfig
from .fleet_state import LIVE_STATES, FleetState

STATUS_TIMEOUT_S = 5.0


def configured_replicas(config: ServeConfig) -> int:
    scaling = config.autoscaling
    if scaling is None:
        return config.replicas
    return max(1, scaling.initial_replicas or scaling.min_replicas)


def capacity_of(config: ServeConfig, running: int) -> int:
    """One ingress's slots with `running` engine replicas (module docstring)."""
    fairness = config.fairness
    if fairness.max_in_flight is not None:
        return fairness.max_in_flight
    return max(1, config.engine.max_num_seqs * running // config.ingress_replicas)


class ServeCapacity:
    """The queue's capacity as Serve's controller reports the engine deployment."""

    def __init__(self, config: ServeConfig, app_name: str, deployment: str) -> None:
        self._config = config
        self._app_name = app_name
        self._deployment = deployment

    async def __call__(self) -> int:
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
