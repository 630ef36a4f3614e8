"""`pagefleet serve`'s command line, as `vllm serve`'s, read into one `ServeConfig`.

    pagefleet serve MODEL [flags]            a checkpoint folder or a Hugging Face Hub id
    pagefleet serve CONFIG.yaml [flags]      a config file (a .yaml or .yml file)
    pagefleet serve [MODEL] --config FILE [flags]

The positional argument is a config file when it ends in .yaml or .yml, else the
model. Engine flags carry vLLM's names (`--max-model-len`, `--tensor-parallel-size`,
...) and the fleet's own (`--replicas`, `--min-replicas`, `--max-replicas`); each
sets one config key (`FLAGS`). Precedence: a flag given wins over the file's key,
a key the file gives wins over the default; a flag left out changes nothing. The
merged mapping is validated as a config file is (`parse_config`), so a bad value
is reported by its key. A model named on the command line is a path relative to
the working directory (made absolute, as Ray's workers run elsewhere) unless it is
a Hub id; a config file's own `model` stays relative to the file.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagefleet.engine.checkpoint import GENERATION_CONFIG_MODES, is_hub_id
from pagefleet.settings import DTYPES

from .config import ConfigError, ServeConfig, parse_config, read_config_data

CONFIG_SUFFIXES = (".yaml", ".yml")


@dataclass(frozen=True)
class Flag:
    """One flag: its names, the config key it sets (dotted), and argparse's options."""

    names: tuple[str, ...]
    key: str
    help: str
    options: tuple[tuple[str, Any], ...] = ()


def _flag(*names: str, key: str, help: str, **options: Any) -> Flag:
    return Flag(names, key, help, tuple(options.items()))


_ON_OFF = {"action": argparse.BooleanOptionalAction}
FLAGS: tuple[Flag, ...] = (
    _flag("--host", key="host", help="HTTP address to listen on"),
    _flag("--port", key="port", help="HTTP port", type=int),
    _flag("--served-model-name", key="served_model_name", help="the name clients pass"),
    _flag("--api-key", key="api_key", help="require `Authorization: Bearer KEY` on /v1/*"),
    _flag("--replicas", key="replicas", help="engine replicas", type=int),
    _flag("--min-replicas", key="autoscaling.min_replicas", help="autoscale from", type=int),
    _flag("--max-replicas", key="autoscaling.max_replicas", help="autoscale up to", type=int),
    _flag("--revision", key="engine.revision", help="Hub revision of a Hub id model"),
    _flag("--dtype", key="engine.dtype", help="weights/KV dtype", choices=("auto", *DTYPES)),
    _flag("--max-model-len", key="engine.max_model_len", help="context length", type=int),
    _flag("--max-num-seqs", key="engine.max_num_seqs", help="batch size at most", type=int),
    _flag(
        "--max-num-batched-tokens",
        key="engine.max_num_batched_tokens",
        help="token budget of one step",
        type=int,
    ),
    _flag(
        "--tensor-parallel-size",
        "-tp",
        key="engine.tensor_parallel_size",
        help="ranks per replica",
        type=int,
    ),
    _flag("--block-size", key="engine.block_size", help="tokens per KV block", type=int),
    _flag(
        "--gpu-memory-utilization",
        key="engine.gpu_memory_utilization",
        help="share of GPU memory a replica may use",
        type=float,
    ),
    _flag(
        "--enable-prefix-caching",
        key="engine.enable_prefix_caching",
        help="reuse cached prefix blocks",
        **_ON_OFF,
    ),
    _flag(
        "--enable-chunked-prefill",
        key="engine.enable_chunked_prefill",
        help="split long prompts over steps",
        **_ON_OFF,
    ),
    _flag("--enforce-eager", key="engine.enforce_eager", help="no compile", action="store_true"),
    _flag("--seed", key="engine.seed", help="engine-wide random seed", type=int),
    _flag(
        "--scheduling-policy",
        key="engine.scheduling_policy",
        help="fcfs, or priority (admit by the request's priority field)",
        choices=("fcfs", "priority"),
    ),
    _flag(
        "--pooling",
        key="engine.pooling",
        help="how /v1/embeddings pools the final hidden states: last or mean",
        choices=("last", "mean"),
    ),
    _flag(
        "--generation-config",
        key="engine.generation_config",
        help="sampling defaults: auto (the checkpoint's), vllm (none), or a folder",
    ),
    _flag("--tool-call-parser", key="tool_call_parser", help="hermes, llama3_json, mistral, ..."),
    _flag("--reasoning-parser", key="reasoning_parser", help="deepseek_r1, qwen3, openai_gptoss"),
)


def _dest(flag: Flag) -> str:
    return flag.names[0].removeprefix("--").replace("-", "_")


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """`pagefleet serve`'s arguments (the module docstring says how they combine)."""
    parser.add_argument(
        "target",
        nargs="?",
        metavar="MODEL_OR_CONFIG",
        help="a checkpoint folder or Hugging Face Hub id, or a config file (.yaml/.yml)",
    )
    parser.add_argument("--config", default=None, help="a config file; flags override it")
    parser.add_argument(
        "--address",
        default=None,
        help="join this Ray cluster (default: $RAY_ADDRESS, else start an embedded local Ray)",
    )
    group = parser.add_argument_group("settings (each overrides the config file's key)")
    for flag in FLAGS:
        group.add_argument(
            *flag.names, dest=_dest(flag), default=None, help=flag.help, **dict(flag.options)
        )


def _split_target(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """(the config file, the model) the positional argument and --config name."""
    target, config = args.target, args.config
    if target is not None and target.endswith(CONFIG_SUFFIXES):
        if config is not None:
            raise ConfigError(f"two config files: {target} and --config {config}")
        return target, None
    return config, target


def _cli_model(model: str) -> str:
    return model if is_hub_id(model) else os.path.abspath(model)


def _set(data: dict[str, Any], key: str, value: Any) -> None:
    *parents, last = key.split(".")
    for p in parents:
        if data.get(p) is None:
            data[p] = {}
        if not isinstance(data[p], dict):
            raise ConfigError(f"{p}: a mapping is needed to set {key}")
        data = data[p]
    data[last] = value


def _flag_value(flag: Flag, value: Any) -> Any:
    """A path given to --generation-config, made absolute (replicas run elsewhere)."""
    if flag.key == "engine.generation_config" and value not in GENERATION_CONFIG_MODES:
        return os.path.abspath(value)
    return value


def serve_config_from_args(args: argparse.Namespace) -> ServeConfig:
    """The deployment the command line asks for: the file's keys, then each flag given."""
    config_file, model = _split_target(args)
    data = read_config_data(config_file) if config_file else {}
    if model is not None:
        data["model"] = _cli_model(model)
    for flag in FLAGS:
        value = getattr(args, _dest(flag))
        if value is not None:
            _set(data, flag.key, _flag_value(flag, value))
    if "model" not in data:
        raise ConfigError("no model: name one (`pagefleet serve MODEL`) or a config file")
    return parse_config(data, base_dir=Path(config_file).parent if config_file else None)
