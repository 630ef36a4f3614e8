"""`pagefleet serve MODEL|CONFIG [flags]` read into a ServeConfig, as `vllm serve` reads its
command line: a model or a config file, vLLM's flag names, flags over the file."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest
import yaml

from pagefleet.cluster.config import ConfigError, ServeConfig, parse_config
from pagefleet.cluster.serve_args import add_serve_arguments, serve_config_from_args


def parse(argv: list[str]) -> ServeConfig:
    parser = argparse.ArgumentParser(prog="pagefleet serve")
    add_serve_arguments(parser)
    return serve_config_from_args(parser.parse_args(argv))


def test_a_model_and_vllms_flags_need_no_config_file(llama_dir: str) -> None:
    config = parse(
        [
            llama_dir,
            "--host", "0.0.0.0",
            "--port", "8123",
            "--served-model-name", "tiny-chat",
            "--api-key", "sekret",
            "--max-model-len", "256",
            "--max-num-seqs", "8",
            "--max-num-batched-tokens", "512",
            "-tp", "1",
            "--dtype", "float32",
            "--block-size", "32",
            "--gpu-memory-utilization", "0.5",
            "--no-enable-prefix-caching",
            "--no-enable-chunked-prefill",
            "--enforce-eager",
            "--seed", "7",
            "--scheduling-policy", "priority",
            "--pooling", "mean",
            "--generation-config", "vllm",
            "--revision", "v1",
            "--replicas", "3",
        ]
    )  # fmt: skip
    assert config == ServeConfig.model_validate(
        {
            "model": llama_dir,
            "host": "0.0.0.0",
            "port": 8123,
            "served_model_name": "tiny-chat",
            "api_key": "sekret",
            "replicas": 3,
            "engine": {
                "max_model_len": 256,
                "max_num_seqs": 8,
                "max_num_batched_tokens": 512,
                "tensor_parallel_size": 1,
                "dtype": "float32",
                "block_size": 32,
                "gpu_memory_utilization": 0.5,
                "enable_prefix_caching": False,
                "enable_chunked_prefill": False,
                "enforce_eager": True,
                "seed": 7,
                "scheduling_policy": "priority",
                "pooling": "mean",
                "generation_config": "vllm",
                "revision": "v1",
            },
        }
    )
    assert config.resolved_api_key() == "sekret"


def test_a_bare_model_takes_every_default(llama_dir: str) -> None:
    assert parse([llama_dir]) == ServeConfig(model=llama_dir)
    assert parse(["--enable-prefix-caching", llama_dir]).engine.enable_prefix_caching is True


def test_a_relative_model_is_made_absolute_and_a_hub_id_is_kept(
    llama_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(Path(llama_dir).parent)
    assert parse([Path(llama_dir).name]).model == llama_dir
    hub = parse(["Qwen/Qwen2.5-0.5B-Instruct", "--revision", "main"])
    assert (hub.model, hub.model_name, hub.engine.revision) == (
        "Qwen/Qwen2.5-0.5B-Instruct",
        "Qwen/Qwen2.5-0.5B-Instruct",
        "main",
    )


def test_autoscaling_bounds_come_from_the_fleet_flags(llama_dir: str) -> None:
    config = parse([llama_dir, "--min-replicas", "1", "--max-replicas", "4"])
    assert config == ServeConfig.model_validate(
        {"model": llama_dir, "autoscaling": {"min_replicas": 1, "max_replicas": 4}}
    )
    with pytest.raises(ConfigError, match="autoscaling: "):
        parse([llama_dir, "--min-replicas", "5", "--max-replicas", "2"])


def test_flags_override_a_config_file_given_either_way(llama_dir: str, tmp_path: Path) -> None:
    data = {
        "model": llama_dir,
        "port": 9000,
        "replicas": 2,
        "engine": {"max_num_seqs": 4, "num_kv_blocks": 64, "max_model_len": 128},
    }
    cfg = tmp_path / "fleet.yml"
    cfg.write_text(yaml.safe_dump(data))
    expected = parse_config(
        {**data, "port": 9001, "engine": {**data["engine"], "max_num_seqs": 16}}, tmp_path
    )
    assert parse([str(cfg), "--port", "9001", "--max-num-seqs", "16"]) == expected
    assert parse(["--config", str(cfg), "--port", "9001", "--max-num-seqs", "16"]) == expected
    assert parse([str(cfg)]) == parse_config(data, tmp_path)
    # A model on the command line replaces the file's (relative to the working directory).
    other = tmp_path / "other"
    other.mkdir()
    assert parse([str(other), "--config", str(cfg)]).model == str(other)


def test_a_yaml_target_is_a_config_file_and_bad_combinations_are_errors(
    llama_dir: str, tmp_path: Path
) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"port": 9000}))
    with pytest.raises(ConfigError, match="no model: name one"):
        parse([str(cfg)])
    assert parse([llama_dir, "--config", str(cfg)]).port == 9000
    with pytest.raises(ConfigError, match="two config files"):
        parse([str(cfg), "--config", str(cfg)])
    with pytest.raises(ConfigError, match="does not exist"):
        parse([str(tmp_path / "missing.yaml")])
    with pytest.raises(ConfigError, match=r"engine\.max_num_seqs: Input should be greater"):
        parse([llama_dir, "--max-num-seqs", "0"])
    with pytest.raises(ConfigError, match="no model"):
        parse([])


def test_a_generation_config_path_is_made_absolute(llama_dir: str, tmp_path: Path) -> None:
    rel = os.path.relpath(llama_dir)
    assert parse([llama_dir, "--generation-config", rel]).engine.generation_config == llama_dir
    # In a config file, relative to the file.
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"model": llama_dir, "engine": {"generation_config": "gen"}}))
    assert parse([str(cfg)]).engine.generation_config == str(tmp_path / "gen")
    cfg.write_text(yaml.safe_dump({"model": llama_dir, "engine": {"generation_config": "vllm"}}))
    assert parse([str(cfg)]).engine.generation_config == "vllm"
