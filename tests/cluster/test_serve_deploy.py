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
    from pagefleet.cluster.routing.serve_routers import request_router_config
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

                from pagefleet.cluster.routing.reports import routing_stats_from_engine
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


@pytest.mark.slow
def test_a_scale_in_notice_warms_a_prompt_through_real_serve(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The notice end to end on Serve, with replicas that only report: the real policy
    announces a scale-in, the driver's router hears it, plans a warm-up of the prompt
    the leaver owns, and the warm-up, sent through the handle as the ingress sends it,
    reaches the survivor the router pinned it to, which then owns the prompt."""
    ray = pytest.importorskip("ray")
    from ray import serve

    from pagefleet.cluster.autoscaling import (
        AutoscalingPolicyConfig,
        read_status,
        serve_autoscaling_config,
        status_key,
    )
    from pagefleet.cluster.replica_messages import ReplicaRequest
    from pagefleet.cluster.routing.scale_in import _SOURCES, take_warm_ups
    from pagefleet.cluster.routing.serve_routers import request_router_config
    from pagefleet.engine import SamplingParams
    from pagefleet.engine.prefix_hash import block_hashes, prefix_hash_salt

    salt = prefix_hash_salt("fake", 16)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(proxy_location="Disabled")
        policy = AutoscalingPolicyConfig(
            min_replicas=1,
            max_replicas=2,
            initial_replicas=2,
            scale_in_after_s=30.0,  # low from the start: the notice from 15 s on
            scale_in_notice_s=15.0,
            look_back_period_s=1.0,
            metrics_interval_s=0.5,
        )

        @serve.deployment(
            ray_actor_options={"num_cpus": 0},
            request_router_config=request_router_config("most_free_blocks", stats_period_s=0.5),
            autoscaling_config=serve_autoscaling_config(policy),
        )
        class Engine:
            def _stats(self) -> object:
                from pagefleet.engine.prefix_hash import prefix_hash_salt as _salt
                from pagefleet.engine.stats import EngineStats

                return EngineStats(64, 60, 16, 0, 0, 0, 0, 0, prefix_hash_salt=_salt("fake", 16))

            def record_routing_stats(self) -> dict:
                import time as _time

                from pagefleet.cluster.routing.reports import routing_stats_from_engine

                return routing_stats_from_engine(self._stats(), _time.time())

            def record_autoscaling_stats(self) -> dict:
                from pagefleet.cluster.autoscaling import autoscaling_stats_from_engine

                return autoscaling_stats_from_engine(self._stats(), 64)

            async def generate(self, request: ReplicaRequest) -> str:
                return serve.get_replica_context().replica_id.unique_id

        app = "pagefleet-notice-test"
        handle = serve.run(Engine.bind(), name=app, route_prefix=None)
        time.sleep(1.0)  # a routing-stats report from each replica
        system = list(range(100, 132))  # two full blocks, sent twice: a reused chain

        def send(rid: str, ids: list[int], max_tokens: int = 4) -> str:
            request = ReplicaRequest(rid, ids, SamplingParams(max_tokens=max_tokens))
            return handle.generate.remote(request).result(timeout_s=60)

        owners = {send(f"q{i}", system + [500 + 10 * i] * 20) for i in range(2)}
        assert len(owners) == 1  # the second follows the first (sent prompt, ownership)
        (leaver,) = owners
        # This deployment's router (another test's may still be alive in this process).
        (router,) = [r for r in list(_SOURCES) if r._deployment_id.app_name == app]
        # Serve decides which replica started last; make it the one holding the prompt.
        router._order.pop(leaver)
        router._order[leaver] = None
        key = status_key(app, "Engine")
        start = time.monotonic()
        while (status := read_status(key)) is None or status.leaving != 1:
            assert time.monotonic() - start < 40, f"no scale-in notice: {status}"
            time.sleep(0.5)
        # The router reads the status on its next choices (at most once a second).
        warm: list[ReplicaRequest] = []
        for n in range(20):
            send(f"tick{n}", [7, 8, 9], 1)
            if warm := take_warm_ups():
                break
            time.sleep(0.5)
        assert [(w.prompt_token_ids, w.params.max_tokens) for w in warm] == [(system, 1)]
        survivor = warm[0].replica
        assert survivor not in (None, leaver)
        # Sent as the ingress sends it: it reaches the survivor, which then owns the chain.
        assert handle.generate.remote(warm[0]).result(timeout_s=60) == survivor
        root = block_hashes(system, 16, salt)[0]
        start = time.monotonic()
        while router.routing_state.owners.get(root) != survivor:
            assert time.monotonic() - start < 10, router.routing_state.owners.get(root)
            time.sleep(0.1)
    finally:
        serve.shutdown()
        ray.shutdown()
