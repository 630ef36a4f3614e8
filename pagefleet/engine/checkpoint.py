"""A checkpoint as `vllm serve` reads it: where it lives, its weight files, the dtype
it runs in, and the sampling defaults it ships.

- Where: `model` is a local folder, or else a Hugging Face Hub id (`org/name`),
  resolved with huggingface_hub's `snapshot_download` at `revision`, with the
  token in $HF_TOKEN. The Hub cache ($HF_HUB_CACHE, else $HF_HOME/hub, else
  huggingface_hub's default) is read at each call, not at import; with
  HF_HUB_OFFLINE=1 only that cache is read, and a snapshot already there needs no
  network. Only configs, tokenizer files and safetensors are fetched.
- Weights: safetensors only, one file or the shards a
  `model.safetensors.index.json` names (each must exist); a folder with only
  PyTorch pickles (`pytorch_model*.bin`) is refused with the file named.
- dtype `auto`: the checkpoint's `dtype` (`torch_dtype` in older configs; float32
  if absent). On the CPU a bfloat16 checkpoint runs in float32 where the CPU has
  no native bfloat16 (x86's avx512_bf16 or amx_bf16, Arm's bf16), and a float16
  one in bfloat16, or float32 without native bfloat16 (vLLM's CPU backend casts
  float16 the same way); `auto_dtype` says which and why (a bfloat16 checkpoint on
  the CPU always gets a reason, kept or not). An explicit dtype runs as asked.
- Sampling defaults (vLLM's `generation_config`): `auto` reads the checkpoint's
  `generation_config.json`, a path reads that folder's (or that file), `vllm`
  reads none. Of temperature, top_p, top_k, min_p, repetition_penalty and
  max_new_tokens (as `max_tokens`), those that differ from transformers' own
  defaults become the defaults of requests that leave the field out; the
  `max_tokens` default also caps every request's, as in vLLM.

Torch-free: the ingress reads sampling defaults and the tokenizer's folder here.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

# "org/name" or "name"; a path that exists locally is never a Hub id.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
_HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "tokenizer*"]
_TRUE = ("1", "ON", "YES", "TRUE")
_hub_dirs: dict[tuple[str, str | None], str] = {}

GENERATION_CONFIG_MODES = ("auto", "vllm")
# transformers' GenerationConfig defaults: a value equal to one is not a default of the
# checkpoint's own (vLLM reads the config's diff against them).
_HF_GENERATION_DEFAULTS: dict[str, float | int | None] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 50,
    "min_p": None,
    "repetition_penalty": 1.0,
    "max_new_tokens": None,
}
_DTYPE_NAMES = {
    "float32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "half": "float16",
}


def is_hub_id(model: str) -> bool:
    """Whether `model` names a Hub repository rather than a local path."""
    return not os.path.exists(model) and _HUB_ID.match(model) is not None


def checkpoint_dir(model: str, revision: str | None = None) -> str:
    """The local folder holding `model`'s checkpoint (a Hub id: its snapshot)."""
    if os.path.isdir(model) or not is_hub_id(model):
        return model
    key = (model, revision)
    if key not in _hub_dirs:
        _hub_dirs[key] = _snapshot(model, revision)
    return _hub_dirs[key]


def _hub_cache() -> str | None:
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME")
    return os.path.join(home, "hub") if home else None


def _snapshot(repo_id: str, revision: str | None) -> str:
    from huggingface_hub import snapshot_download

    offline = os.environ.get("HF_HUB_OFFLINE", "0").upper() in _TRUE
    try:
        return snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=_hub_cache(),
            token=os.environ.get("HF_TOKEN") or None,
            allow_patterns=_HUB_FILES,
            local_files_only=offline,
        )
    except Exception as e:
        where = (
            "in the local Hub cache (HF_HUB_OFFLINE=1)" if offline else "on the Hugging Face Hub"
        )
        raise ValueError(
            f"model {repo_id!r} (revision {revision or 'main'}) is not a local folder and "
            f"was not found {where}: {type(e).__name__}: {e}"
        ) from None


def weight_files(folder: str | os.PathLike[str]) -> list[Path]:
    """The checkpoint's safetensors files, in load order (the shards of its index)."""
    path = Path(folder)
    index = path / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise ValueError(f"{index} names shards that are not there: {', '.join(missing)}")
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p.name for p in path.glob("pytorch_model*.bin"))
    if pickles:
        raise ValueError(
            f"{path / pickles[0]}: PyTorch pickle weights (.bin) are not loaded, only "
            "safetensors; convert the checkpoint once (transformers' "
            "`from_pretrained(DIR).save_pretrained(OUT)` writes safetensors)"
        )
    raise ValueError(f"no .safetensors weights in {path}")


def checkpoint_dtype(hf_config: dict) -> str:
    """The dtype the checkpoint was saved in (float32 if its config does not say)."""
    text = hf_config.get("text_config") or {}
    name = hf_config.get("dtype") or hf_config.get("torch_dtype") or text.get("dtype")
    name = name or text.get("torch_dtype") or "float32"
    if str(name).removeprefix("torch.") not in _DTYPE_NAMES:
        raise ValueError(f"the checkpoint's dtype {name!r} is not one the engine runs")
    return _DTYPE_NAMES[str(name).removeprefix("torch.")]


def cpu_bf16_features() -> tuple[str, ...]:
    """This CPU's native bfloat16 features in its /proc/cpuinfo flags (amx_bf16,
    avx512_bf16, Arm's bf16), sorted; empty where it has none."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ()
    flags = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return tuple(sorted(flags & {"avx512_bf16", "amx_bf16", "bf16"}))


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes in bfloat16 natively (its /proc/cpuinfo flags)."""
    return bool(cpu_bf16_features())


def auto_dtype(saved: str, device: str, native_bf16: bool) -> tuple[str, str | None]:
    """(the dtype `auto` runs a checkpoint saved in `saved` in, why it differs or None)."""
    if not device.startswith("cpu"):
        return saved, None
    if saved == "bfloat16" and not native_bf16:
        return "float32", (
            "dtype auto: the checkpoint's bfloat16 runs as float32, because this CPU has no "
            "native bfloat16 (neither avx512_bf16 nor amx_bf16)"
        )
    if saved == "bfloat16":
        return "bfloat16", (
            "dtype auto: the checkpoint's bfloat16 runs as bfloat16, because this CPU has "
            "native bfloat16 (avx512_bf16 or amx_bf16)"
        )
    if saved == "float16":
        runs = "bfloat16" if native_bf16 else "float32"
        why = "" if native_bf16 else ", and this CPU has no native bfloat16"
        return runs, (
            f"dtype auto: the checkpoint's float16 runs as {runs}, because float16 is not "
            f"a CPU compute dtype (as in vLLM's CPU backend){why}"
        )
    return saved, None


def check_generation_config(setting: str) -> None:
    """Refuse a `generation_config` that is neither a mode nor an existing path."""
    if setting not in GENERATION_CONFIG_MODES and not _generation_file(setting).is_file():
        raise ValueError(
            f"generation_config must be 'auto', 'vllm' or a folder holding a "
            f"generation_config.json (or that file), got {setting!r}"
        )


def _generation_file(where: str) -> Path:
    path = Path(where)
    return path if path.suffix == ".json" else path / "generation_config.json"


def generation_defaults(model_dir: str, setting: str = "auto") -> dict[str, float | int]:
    """The request defaults `setting` gives (SamplingParams' names: max_tokens)."""
    if setting == "vllm":
        return {}
    path = _generation_file(model_dir if setting == "auto" else setting)
    if not path.is_file():
        return {}
    raw = json.loads(path.read_text())
    found = {
        k: raw[k]
        for k, hf_default in _HF_GENERATION_DEFAULTS.items()
        if raw.get(k) is not None and raw[k] != hf_default
    }
    if "max_new_tokens" in found:
        found["max_tokens"] = found.pop("max_new_tokens")
    return found
