"""The Ray Serve application: `build_app(args)` for `serve run` / `serve deploy`.

Three deployments, as Ray Serve LLM lays them out:

- `Ingress` (`ingress.py`; stateless, `@serve.ingress`): the FastAPI app of `http/`. It
  validates, applies the chat template, tokenizes once, and calls the engine
  replicas through a streaming `DeploymentHandle`.
- `EngineReplica` (`engine_replica.py`): one `LLMReplica` each (its engine core
  in a child process). num_replicas, resources and max_ongoing_requests come from the config. With
  `engine.tensor_parallel_size` N > 1 each replica is a placement group of N
  bundles (`ServeConfig.placement`): the replica actor in bundle 0 (its engine
  core is rank 0), and ranks 1..N-1 as Ray actors it owns in the others
  (`tp_ranks.py`). A lost rank kills the engine core: open requests fail with
  the cause, the health check fails, and Serve replaces the replica whole.

Overload is bounded at every hop, and each bound answers 429 (OpenAI's body,
Retry-After) rather than letting a request wait without end: an engine holds
at most `max_waiting_requests` requests not yet scheduled (beyond it its core
rejects new ones); Serve sends a replica at most max_num_seqs +
max_waiting_requests (`max_ongoing_requests`), so it routes around a full
replica; when every replica is full, each ingress holds at most
`max_queued_requests` (Serve's BackPressureError beyond it). The ingress's own
limits sit above all of that, so the proxy's plain 429 is a last resort.
- `MetricsHub` (`hub.py`): the replicas push their metric families to it; the ingress's
  `/metrics` exposes them all (one scrape target for the fleet).
- `ResponseStoreDeployment` (`response_store.py`): the stored `/v1/responses`, one copy
  for every ingress replica (`previous_response_id` continues on any of them).

    applications:
      - name: pagefleet
        import_path: pagefleet.cluster.app:build_app
        args: {model: /models/tiny, replicas: 2, engine: {dtype: float32}}

Serve hashes `args` into the application's code version: a change to them restarts
every replica. What may change in place is also a deployment option: the Ingress's
`user_config` (the limits, request_timeout_s, api_key, protect_metrics; and the fleet's
bounds, which the ingress reads) and the EngineReplica's `num_replicas` /
`autoscaling_config` (`engine_scaling_options`), e.g.

        deployments:
          - name: Ingress
            user_config: {limits: {max_n: 1}, replicas: 3}
          - name: EngineReplica
            num_replicas: 3
"""

from __future__ import annotations

import os
from typing import Any

from pydantic import SecretStr
from ray.serve.config import BackpressureConfig

from pagefleet.cluster.routing.serve_routers import request_router_config

from .autoscaling import serve_autoscaling_config
from .config import parse_config
from .engine_replica import EngineReplica
from .http import RETRY_AFTER_S
from .hub import MetricsHubDeployment
from .ingress import Ingress
from .live_settings import INGRESS_HEADROOM, ingress_max_ongoing_requests, ingress_user_config
from .response_store import ResponseStoreDeployment


def build_app(args: dict[str, Any]) -> Any:
    """The application for `serve run` / `serve deploy` (args: pagefleet's config)."""
    config = parse_config(dict(args))
    if config.api_key is None and (key := config.resolved_api_key()):
        # Read here, where `pagefleet serve` or `serve deploy` runs, and carried as a
        # SecretStr: the replicas' environment need not have it, and no repr shows it.
        config = config.model_copy(update={"api_key": SecretStr(key)})
    if config.make_model and not os.path.isdir(config.model):
        from .make_model import make_model

        make_model(config.model, preset=config.make_model)
    as_dict = config.model_dump()
    hub = MetricsHubDeployment.bind()
    responses = ResponseStoreDeployment.bind(config.responses.max_entries, config.responses.ttl_s)
    scaling: dict[str, Any] = {"num_replicas": config.replicas}
    if config.autoscaling is not None:
        scaling = {
            "num_replicas": "auto",
            "autoscaling_config": serve_autoscaling_config(config.autoscaling.policy_config()),
        }
    engine = EngineReplica.options(
        **scaling,
        request_router_config=request_router_config(
            config.routing,
            stats_period_s=config.routing_stats_period_s,
            router_kwargs=config.router_kwargs(),
        ),
        max_ongoing_requests=config.replica_max_ongoing_requests,
        max_queued_requests=config.ingress_max_queued_requests,
        backpressure_config=BackpressureConfig(status_code=429, retry_after_s=RETRY_AFTER_S),
        # Under tensor parallelism each rank is one placement-group bundle; the replica
        # actor (whose engine core is rank 0) takes bundle 0, so it asks for one bundle.
        ray_actor_options={
            "num_cpus": config.replica_resources.num_cpus,
            "num_gpus": config.replica_resources.num_gpus,
        },
        **config.placement(),
        health_check_period_s=2,
        health_check_timeout_s=30,
        # Scale-in drains: Serve stops routing to the replica and waits for its requests.
        # With migration the ingresses hand what is left after migration_drain_s to
        # other replicas (`migration.py`); without, the drain lasts as long as an
        # accepted request may take (request_timeout_s), then `__del__` shuts the engine
        # down, which ends what is left with an error delta (never a silently cut
        # stream). A replica with nothing left stops at once.
        graceful_shutdown_timeout_s=config.engine_drain_s,
        graceful_shutdown_wait_loop_s=0.5,
    ).bind(as_dict, hub)
    # Serve's default max_ongoing_requests (5) would cap the whole fleet at 5 requests in
    # flight per ingress replica: it streams for every engine replica behind it. Its room is
    # the fleet's, plus the queue in front of it, plus headroom
    # (`ingress_max_ongoing_requests`): so the engines' and the queue's 429s (OpenAI's body)
    # come before the proxy's own. A Serve config that moves the fleet's bounds to the
    # EngineReplica's options sets this one beside them (the Helm chart does).
    return Ingress.options(
        num_replicas=config.ingress_replicas,
        # The live keys (`live_settings.LIVE_KEYS`) and the fleet's bounds, applied by
        # `Ingress.reconfigure`: a Serve config's `deployments: [{name: Ingress,
        # user_config: ...}]` replaces it, and Serve applies that in place.
        user_config=ingress_user_config(config),
        max_ongoing_requests=ingress_max_ongoing_requests(config),
        # Serve counts a request as queued while it is being routed, so simultaneous
        # arrivals at the proxy see each other "queued": a small bound here would refuse
        # them with the ingress idle. This queue only fills once the ingress is full.
        max_queued_requests=max(INGRESS_HEADROOM, config.ingress_max_queued_requests),
        backpressure_config=BackpressureConfig(status_code=429, retry_after_s=RETRY_AFTER_S),
        # Every stream passes through an ingress replica: one being replaced (a redeploy,
        # a scale change of the ingress) drains as the engine replicas do.
        graceful_shutdown_timeout_s=config.drain_s,
        graceful_shutdown_wait_loop_s=0.5,
    ).bind(as_dict, engine, hub, responses)
