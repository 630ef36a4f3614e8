"""The one config schema: strict, documented, relative paths, the engine's own field names."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pagefleet.cluster.config import (
    ConfigError,
    EngineSettings,
    ServeConfig,
    engine_field_names,
    load_config,
    parse_config,
)

REPO = Path(__file__).resolve().parents[2]


def test_engine_settings_are_engine_config_fields() -> None:
    assert set(EngineSettings.model_fields) == engine_field_names()
    for name, field in EngineSettings.model_fields.items():
        assert field.description, f"engine.{name} is undocumented"
    for name, field in ServeConfig.model_fields.items():
        assert field.description or name in {"replica_resources", "engine", "limits"}, name


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
    assert (ec.model, ec.num_kv_blocks, ec.block_size, ec.dtype) == (llama_dir, 10, 8, "float32")
