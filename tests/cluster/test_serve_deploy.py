"""The router class and the autoscaling policy deploy and serve on a real local Ray (slow)."""

from __future__ import annotations

import time

import pytest


@pytest.mark.slow
def test_router_and_policy_deploy_on_local_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    ray = pytest.importorskip("ray")
    from prometheus_client import REGISTRY
    from ray import serve

    from pagefleet.cluster.autoscaling import AutoscalingPolicyConfig, serve_autoscaling_config
    from pagefleet.cluster.replica_messages import ReplicaRequest
    from pagefleet.cluster.request_router import request_router_config
    from pagefleet.engine import SamplingParams

    def routed() -> float:
        return sum(
            s.value
            for m in REGISTRY.collect()
            if m.name == "pagefleet:routed_requests"
            for s in m.samples
            if s.name.endswith("_total") and s.labels.get("policy") == "most_free_blocks"
        )

    # A local cluster of our own (never someone else's), no HTTP proxy (no port to collide on).
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(proxy_location="Disabled")

        # Defined here, importing only installed packages, so replicas can unpickle it.
        @serve.deployment(
            ray_actor_options={"num_cpus": 0},
            request_router_config=request_router_config("most_free_blocks", stats_period_s=0.5),
            autoscaling_config=serve_autoscaling_config(
                AutoscalingPolicyConfig(min_replicas=2, max_replicas=2)
            ),
        )
        class Engine:
            def record_routing_stats(self) -> dict:
                import time as _time

                from pagefleet.cluster.routing_policy import routing_stats_from_engine
                from pagefleet.engine.stats import EngineStats

                return routing_stats_from_engine(
                    EngineStats(64, 60, 16, 0, 0, 0, 0, 0), _time.time()
                )

            def record_autoscaling_stats(self) -> dict:
                from pagefleet.cluster.autoscaling import autoscaling_stats_from_engine
                from pagefleet.engine.stats import EngineStats

                return autoscaling_stats_from_engine(EngineStats(64, 60, 16, 0, 0, 0, 0, 0), 64)

            async def generate(self, request: ReplicaRequest) -> int:
                return len(request.prompt_token_ids) + request.params.max_tokens

        before = routed()
        handle = serve.run(Engine.bind(), name="pagefleet-router-test", route_prefix=None)
        time.sleep(1.0)  # let a routing-stats report reach the router
        results = [
            handle.generate.remote(
                ReplicaRequest(f"r{n}", list(range(n)), SamplingParams(max_tokens=4))
            ).result(timeout_s=60)
            for n in (3, 20, 40)
        ]
        assert results == [7, 24, 44]
        # The driver's handle routed them with our router, which counted them.
        assert routed() == before + 3
    finally:
        serve.shutdown()
        ray.shutdown()
