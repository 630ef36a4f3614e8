"""Load a Hugging Face checkpoint directory: config.json, safetensors, tokenizer.

Each checkpoint tensor is handed to the weight loader of the parameter it
belongs to, which takes this rank's shard; the loader itself knows nothing of
tensor parallelism.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from .checkpoint import weight_files
from .models import resolve_model
from .models.llama import LlamaForCausalLM
from .mxfp4 import BLOCKS_SUFFIX, SCALES_SUFFIX, dequantize_checkpoint_tensor


def load_model(
    model_dir: str, dtype: torch.dtype, device: torch.device, max_position: int
) -> LlamaForCausalLM:
    path = Path(model_dir)
    hf_config = json.loads((path / "config.json").read_text())
    spec = resolve_model(hf_config)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = spec.model_class(spec.args, max_position, dtype)
    finally:
        torch.set_default_dtype(previous)
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    files = weight_files(path)
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for ckpt_name, param_name, shard in model.checkpoint_targets(list(f.keys())):
                if param_name not in params:
                    raise ValueError(f"checkpoint tensor {ckpt_name!r} has no place in the model")
                param = params[param_name]
                tensor = _read_tensor(f, ckpt_name, files).to(dtype)
                param.weight_loader(param, tensor, shard)  # type: ignore[attr-defined]
                loaded.add(param_name)
    missing = {n for n in params if n not in loaded}
    if spec.args.tie_word_embeddings:
        missing.discard("lm_head.weight")
    if missing:
        raise ValueError(f"checkpoint lacks weights for: {', '.join(sorted(missing)[:8])}")
    model.eval()
    _freeze(model)
    return model


def _read_tensor(f, name: str, files: list[Path]) -> torch.Tensor:
    """A checkpoint tensor; an MXFP4 `*_blocks` one dequantized with its `*_scales`."""
    if not name.endswith(BLOCKS_SUFFIX):
        return f.get_tensor(name)
    scales_name = name.removesuffix(BLOCKS_SUFFIX) + SCALES_SUFFIX
    return dequantize_checkpoint_tensor(f.get_tensor(name), _find_tensor(scales_name, files))


def _find_tensor(name: str, files: list[Path]) -> torch.Tensor:
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            names: list[str] = f.keys()
            if name in names:
                return f.get_tensor(name)
    raise ValueError(f"checkpoint has MXFP4 blocks without their scales: {name!r} is missing")


def _freeze(model: nn.Module) -> None:
    for p in model.parameters():
        p.requires_grad_(False)


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(path)


def eos_token_ids(model_dir: str, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """EOS ids from generation_config.json (may be a list) and the tokenizer."""
    ids: set[int] = set()
    gen = Path(model_dir) / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids.update(eos)
    if not ids and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
