"""The metrics hub deployment: engine replicas and ingresses push their metric families to
it, and every ingress's `/metrics` exposes them all (one scrape target for the fleet)."""

from __future__ import annotations

from ray import serve

from .metrics import MetricsHub


@serve.deployment(ray_actor_options={"num_cpus": 0}, num_replicas=1, max_ongoing_requests=1000)
class MetricsHubDeployment(MetricsHub):
    pass
