"""What Serve's controller says of the engine replicas, and what the ingress makes of it.

The ingress asks two questions that must never queue behind generation: is the
fleet healthy (`/health`), and may a request that no replica has admitted yet keep
waiting, or is it a 503 now. Both are answered from the controller's view of the
deployment (`serve.status()`: replicas by state, the deployment's status), never by
calling a replica: a replica's queue is exactly what is full when the fleet is
busiest, and a health check that waits there fails under load.

- Healthy: a replica is RUNNING (Serve health-checks each one itself), or the
  fleet is scaled to zero by choice (autoscaling with `min_replicas: 0`, nothing
  unhealthy): a request would start one, so a load balancer must keep sending.
- Keep waiting: a replica is RUNNING or on its way (STARTING, UPDATING,
  RECOVERING), or the fleet scales from zero (Serve's cold start adds a replica
  for a queued request). Otherwise (every replica gone, none coming, or the
  deployment failed) a request is refused at once with 503.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

LIVE_STATES = ("RUNNING",)
COMING_STATES = ("STARTING", "UPDATING", "RECOVERING")
FAILED_STATUSES = ("UNHEALTHY", "DEPLOY_FAILED")


@dataclass(frozen=True)
class FleetState:
    """The engine deployment as the controller reports it."""

    replicas: Mapping[str, int]  # replica state name -> count
    status: str  # the deployment's status (HEALTHY, UPSCALING, UNHEALTHY, ...)

    @classmethod
    def from_serve_status(cls, serve_status: Any, app_name: str, deployment: str) -> FleetState:
        """From `serve.status()` (duck-typed: fakes in tests)."""
        app = serve_status.applications[app_name]
        dep = app.deployments[deployment]
        return cls(
            replicas={_name(k): int(v) for k, v in dep.replica_states.items()},
            status=_name(dep.status),
        )

    def count(self, states: tuple[str, ...]) -> int:
        return sum(self.replicas.get(s, 0) for s in states)

    @property
    def failed(self) -> bool:
        return self.status in FAILED_STATUSES

    def healthy(self, scales_from_zero: bool) -> bool:
        if self.count(LIVE_STATES) > 0:
            return True
        return scales_from_zero and not self.failed

    def may_wait(self, scales_from_zero: bool) -> bool:
        """Whether a request not yet admitted should keep waiting for a replica."""
        if self.count(LIVE_STATES) + self.count(COMING_STATES) > 0:
            return True
        return scales_from_zero and not self.failed


def _name(value: Any) -> str:
    """An enum member's value, or the string itself (Serve's enums are str enums)."""
    return str(getattr(value, "value", value))
