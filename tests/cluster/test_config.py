"""The one config schema: strict, documented, relative paths, the engine's own field names."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from pagefleet.cluster.autoscaling import AutoscalingPolicyConfig
from pagefleet.cluster.config import (
    AutoscalingSettings,
    ConfigError,
    EngineSettings,
    RouterSettings,
    ServeConfig,
    engine_field_names,
    load_config,
    parse_config,
)
from pagefleet.cluster.routing.config import ROUTING_POLICIES, RoutingConfig
from pagefleet.engine.config import EngineConfig
from pagefleet.settings import POWER_OF_TWO, Setting, declared

REPO = Path(__file__).resolve().parents[2]


def test_engine_settings_are_engine_config_fields() -> None:
    assert set(EngineSettings.model_fields) == engine_field_names()
    for name, field in EngineSettings.model_fields.items():
        assert field.description, f"engine.{name} is undocumented"
    for name, field in ServeConfig.model_fields.items():
        assert field.description or name in {"replica_resources", "engine", "limits"}, name


def test_engine_and_autoscaling_settings_are_declared_once_in_their_dataclasses() -> None:
    """`engine:` and `autoscaling:` are built from EngineConfig's and AutoscalingPolicyConfig's
    fields: the same defaults, descriptions and ranges (the serving schema copies none)."""
    for source, model in (
        (EngineConfig, EngineSettings),
        (AutoscalingPolicyConfig, AutoscalingSettings),
    ):
        for f in dataclasses.fields(source):
            if f.name not in model.model_fields:
                continue
            field, decl = model.model_fields[f.name], declared(f)
            assert decl is not None and field.default == f.default, f.name
            if f.name != "device":  # under Ray: only 'cuda', each rank on its own GPU
                assert field.description == decl.description, f.name
    assert AutoscalingSettings().policy_config() == AutoscalingPolicyConfig()
    # `routing:` is the router's `policy`.
    routing, policy = (
        ServeConfig.model_fields["routing"],
        RoutingConfig.__dataclass_fields__["policy"],
    )
    assert (routing.default, routing.description) == (policy.default, declared(policy).description)
    assert declared(policy).choices == ROUTING_POLICIES
    # `router:` is every other RoutingConfig field, declared there.
    assert set(RouterSettings.model_fields) == {
        f.name for f in dataclasses.fields(RoutingConfig) if f.name != "policy"
    }
    assert RoutingConfig(**RouterSettings().model_dump()) == RoutingConfig()


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"engine": {"block_size": 3}}, "engine.block_size: Input should be a power of two"),
        (
            {"engine": {"block_size": 256}},
            "engine.block_size: Input should be less than or equal to 128",
        ),
        (
            {"engine": {"max_num_seqs": 0}},
            "engine.max_num_seqs: Input should be greater than or equal to 1",
        ),
        (
            {"engine": {"gpu_memory_utilization": 0}},
            "engine.gpu_memory_utilization: Input should be greater than 0",
        ),
        ({"engine": {"device": "tpu"}}, "engine.device: Input should be 'cpu' or 'cuda[:N]'"),
        (
            {"engine": {"dtype": "int8"}},
            "engine.dtype: Input should be 'auto', 'float32', 'bfloat16' or 'float16'",
        ),
        (
            {"autoscaling": {"max_replicas": 0}},
            "autoscaling.max_replicas: Input should be greater than or equal to 1",
        ),
        (
            {"autoscaling": {"target_kv_utilization": 1.5}},
            "autoscaling.target_kv_utilization: Input should be less than or equal to 1",
        ),
        # What spans fields is the dataclass's own check, reported under its key.
        (
            {"autoscaling": {"min_replicas": 3, "max_replicas": 2}},
            "autoscaling: max_replicas (2) must be >= 1 and >= min_replicas (3)",
        ),
        (
            {"router": {"affinity_max_load_gap": 2}},
            "router.affinity_max_load_gap: Input should be less than or equal to 1",
        ),
        (
            {"routing": "fastest"},
            "routing: Input should be 'most_free_blocks', 'power_of_two', 'round_robin' or "
            "'prefix_cache_affinity'",
        ),
    ],
)
def test_declared_ranges_are_checked_by_key(config: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config({"model": "m", **config})
    assert message in str(err.value)


def test_a_dataclass_names_the_field_and_its_range(llama_dir: str) -> None:
    assert (
        Setting("d", ge=1, le=128, rule=POWER_OF_TWO).range_text() == "a power of two in [1, 128]"
    )
    with pytest.raises(
        ValueError, match=r"^block_size must be a power of two in \[1, 128\], got 3$"
    ):
        EngineConfig(model=llama_dir, block_size=3)
    with pytest.raises(ValueError, match=r"^gpu_memory_utilization must be in \(0, 1\], got 1.5$"):
        EngineConfig(model=llama_dir, gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match=r"^look_back_period_s must be > 0, got 0$"):
        AutoscalingPolicyConfig(look_back_period_s=0)
    with pytest.raises(ValueError, match=r"^affinity_max_load_gap must be in \[0, 1\], got 1.5$"):
        RoutingConfig(affinity_max_load_gap=1.5)


def test_router_settings_reach_the_engine_deployments_router(llama_dir: str) -> None:
    """`router:` becomes Serve's `request_router_kwargs` for most_free_blocks, which
    builds its RoutingConfig from them; the other policies get none."""
    from pagefleet.cluster.app import build_app

    config = {"model": llama_dir, "router": {"affinity_owner_weight": 8}, "ingress_replicas": 2}
    kwargs = parse_config(config).router_kwargs()
    assert RoutingConfig(**kwargs) == RoutingConfig(affinity_owner_weight=8.0)
    app = build_app(config)
    (engine,) = [
        a._bound_deployment
        for a in app._bound_deployment.init_args
        if getattr(getattr(a, "_bound_deployment", None), "name", None) == "EngineReplica"
    ]
    assert engine._deployment_config.request_router_config.request_router_kwargs == kwargs
    assert parse_config({**config, "routing": "power_of_two"}).router_kwargs() == {}


def test_one_ingress_shares_no_routing_view(llama_dir: str) -> None:
    def period(**config: object) -> float:
        return parse_config({"model": llama_dir, **config}).router_kwargs()["shared_view_period_s"]

    assert period() == 0.0  # no peer to exchange with
    assert period(router={"shared_view_period_s": 0.5}) == 0.0
    assert period(ingress_replicas=3) == RoutingConfig().shared_view_period_s
    assert period(ingress_replicas=3, router={"shared_view_period_s": 0.5}) == 0.5


def test_unknown_keys_are_named() -> None:
    with pytest.raises(ConfigError, match=r"^invalid config: replicaz: unknown key$"):
        parse_config({"model": "m", "replicaz": 2})
    with pytest.raises(ConfigError, match=r"engine\.block_sise: unknown key"):
        parse_config({"model": "m", "engine": {"block_sise": 8}})
    with pytest.raises(ConfigError, match=r"replicas: Input should be greater than or equal to 1"):
        parse_config({"model": "m", "replicas": 0})
    with pytest.raises(ConfigError, match="model: Field required"):
        parse_config({})


def test_relative_model_path_is_relative_to_the_config_file(tmp_path: Path) -> None:
    (tmp_path / "cfg").mkdir()
    path = tmp_path / "cfg" / "c.yaml"
    path.write_text(yaml.safe_dump({"model": "../models/m", "engine": {"block_size": 8}}))
    config = load_config(path)
    assert config.model == str((tmp_path / "models" / "m").resolve())
    assert config.model_name == "m"
    assert config.engine.block_size == 8
    with pytest.raises(Exception, match="frozen"):
        config.port = 1  # type: ignore[misc]


def test_shipped_configs_load() -> None:
    for name in ("local.yaml", "smollm-135m.yaml"):
        config = load_config(REPO / "configs" / name)
        assert config.make_model is not None and Path(config.model).is_absolute()
    local = load_config(REPO / "configs" / "local.yaml")
    assert (local.model_name, local.host, local.port) == ("tiny", "127.0.0.1", 8000)
    # The embedded default shows the fleet: two replicas, routed, autoscaled 1..2.
    assert local.routing == "most_free_blocks" and local.autoscaling is not None
    scaling = local.autoscaling
    assert (scaling.min_replicas, scaling.max_replicas, scaling.initial_replicas) == (1, 2, 2)


def test_engine_config_is_built_from_settings(llama_dir: str) -> None:
    config = parse_config({"model": llama_dir, "engine": {"num_kv_blocks": 10, "block_size": 8}})
    ec = config.engine_config()
    assert (ec.model, ec.num_kv_blocks, ec.block_size, ec.dtype) == (llama_dir, 10, 8, "auto")
    assert ec.runtime_dtype == ("float32", None)  # the checkpoint's own


def test_queue_bounds_follow_the_engine_unless_set(llama_dir: str) -> None:
    config = parse_config({"model": llama_dir, "engine": {"max_num_seqs": 8}})
    assert (config.max_waiting_requests, config.request_timeout_s) == (192, 600.0)
    # Serve sends a replica what it runs plus what may wait; each ingress queues as much.
    assert config.replica_max_ongoing_requests == 8 + 192
    assert config.ingress_max_queued_requests == 192
    assert config.engine_config().max_waiting_requests == 192
    config = parse_config(
        {
            "model": llama_dir,
            "max_waiting_requests": 0,
            "max_ongoing_requests": 5,
            "request_timeout_s": None,
        }
    )
    assert (config.replica_max_ongoing_requests, config.ingress_max_queued_requests) == (5, 1)
    assert config.engine_config().max_waiting_requests == 0
    with pytest.raises(ConfigError, match=r"max_waiting_requests: Input should be greater"):
        parse_config({"model": llama_dir, "max_waiting_requests": -1})
    with pytest.raises(ConfigError, match=r"limits\.max_body_bytes: Input should be greater"):
        parse_config({"model": llama_dir, "limits": {"max_body_bytes": 10}})


def test_api_key_from_config_or_environment_and_never_shown(
    llama_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PAGEFLEET_API_KEY", raising=False)
    assert parse_config({"model": llama_dir}).resolved_api_key() is None
    monkeypatch.setenv("PAGEFLEET_API_KEY", "sk-from-env")
    assert parse_config({"model": llama_dir}).resolved_api_key() == "sk-from-env"
    config = parse_config({"model": llama_dir, "api_key": "sk-from-config"})
    assert config.resolved_api_key() == "sk-from-config"  # the config's wins
    for shown in (repr(config), str(config), config.model_dump_json(), str(config.model_dump())):
        assert "sk-from-config" not in shown
    assert config.model_dump(mode="json")["api_key"] == "**********"
    with pytest.raises(ConfigError, match="api_key must not be empty"):
        parse_config({"model": llama_dir, "api_key": "  "})
