"""What a running fleet applies in place, and how a Serve config says it.

Serve hashes an application's `args` into its code version, and a new code version
restarts every replica (reloading the model); a deployment's options (`user_config`,
`num_replicas`, `autoscaling_config`, ...) change in place. So the live keys may also be
given as the Ingress deployment's `user_config` (`Ingress.reconfigure`), and the fleet's
bounds as the EngineReplica deployment's `num_replicas` / `autoscaling_config`. Every
other key is the application's `args`: a change to it restarts every replica.
"""

from __future__ import annotations

from typing import Any

from .config import ConfigError, ServeConfig, parse_config

# What a running fleet applies in place, without restarting a replica. Serve hashes an
# application's `args` into its code version, and a new code version restarts every replica
# (reloading the model); a deployment's options (`user_config`, `num_replicas`,
# `autoscaling_config`, ...) change in place. So these keys may also be given as the Ingress
# deployment's `user_config` (`Ingress.reconfigure`), and the fleet's bounds as the
# EngineReplica deployment's `num_replicas` / `autoscaling_config` (`engine_scaling_options`).
# Every other key is the application's `args`: a change to it restarts every replica.
LIVE_KEYS = ("limits", "request_timeout_s", "api_key", "protect_metrics")
# The engine fleet's size. The ingress reads them too (its fleet metrics; whether a request
# waits for a scale from zero), so its `user_config` may carry them alongside.
REPLICA_BOUND_KEYS = ("replicas", "autoscaling")
INGRESS_USER_CONFIG_KEYS = (*LIVE_KEYS, *REPLICA_BOUND_KEYS)


def ingress_user_config(config: ServeConfig) -> dict[str, Any]:
    """The Ingress deployment's `user_config` for `config` (JSON, as Serve needs it): its
    live keys and the fleet's bounds. The API key is left out: it stays in the ingress's
    constructor arguments as a SecretStr, never shown by Serve's status or dashboard."""
    keys = set(INGRESS_USER_CONFIG_KEYS) - {"api_key"}
    return config.model_dump(mode="json", include=keys)


AUTOSCALING_POLICY = "pagefleet.cluster.autoscaling:KVCacheAutoscalingPolicy"
INGRESS_HEADROOM = 64


def engine_scaling_options(config: ServeConfig) -> dict[str, Any]:
    """The EngineReplica deployment's scaling options as a Serve config file writes them
    (`deployments: [{name: EngineReplica, ...}]`): `num_replicas`, or `"auto"` with an
    `autoscaling_config` running pagefleet's policy (what `serve_autoscaling_config` builds)."""
    if config.autoscaling is None:
        return {"num_replicas": config.replicas}
    policy = config.autoscaling.policy_config()
    serve_knobs = (
        "min_replicas",
        "max_replicas",
        "initial_replicas",
        "upscale_delay_s",
        "downscale_delay_s",
        "look_back_period_s",
        "metrics_interval_s",
    )
    scaling: dict[str, Any] = {k: getattr(policy, k) for k in serve_knobs}
    if scaling["initial_replicas"] is None:
        scaling["initial_replicas"] = policy.min_replicas
    scaling["policy"] = {
        "policy_function": AUTOSCALING_POLICY,
        "policy_kwargs": policy.policy_kwargs(),
    }
    return {"num_replicas": "auto", "autoscaling_config": scaling}


def ingress_max_ongoing_requests(config: ServeConfig) -> int:
    """The ingress's max_ongoing_requests: it streams for every engine replica behind it, so
    its room is the fleet's at its largest, plus the queue in front of the engines, plus
    headroom for what never reaches an engine (requests being refused, scrapes, tokenize)."""
    fleet = max(config.replicas, config.autoscaling.max_replicas if config.autoscaling else 0)
    return (
        config.replica_max_ongoing_requests * fleet
        + config.ingress_max_queued_requests
        + INGRESS_HEADROOM
    )


def with_user_config(config: ServeConfig, user_config: Any) -> ServeConfig:
    """`config` with the Ingress's `user_config` applied: each top-level key it holds
    replaces the config's (what it leaves out stays as the application's args say),
    validated as the config is, so an error names the key."""
    if user_config is None:
        return config
    if not isinstance(user_config, dict):
        raise ConfigError("user_config: a mapping of config keys to values")
    restart = sorted(set(user_config) - set(INGRESS_USER_CONFIG_KEYS))
    if restart:
        raise ConfigError(
            f"invalid user_config: {', '.join(restart)}: not applied in place (a change "
            "restarts every replica): set it in the application's args; user_config takes "
            f"{', '.join(INGRESS_USER_CONFIG_KEYS)}"
        )
    data = config.model_dump()
    data.update(user_config)
    return parse_config(data)
