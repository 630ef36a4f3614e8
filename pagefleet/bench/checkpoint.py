"""The checkpoint a benchmark runs on: the one at --model, written from a preset if none is.

Unlike `make_model.ensure_model` (the tests' exact seeded checkpoint, rewritten when its
marker differs), a benchmark never overwrites what it is pointed at."""

from __future__ import annotations

import json
from pathlib import Path

WEIGHTS = ("*.safetensors", "*.bin")


def ensure_model(model: str, preset: str) -> tuple[str, int]:
    """(absolute checkpoint path, vocabulary size). A checkpoint already at `model`
    (config.json and weights: one of ours or any other) is used as it is, never
    overwritten; with none there, `pagefleet make-model --preset PRESET` writes one."""
    path = Path(model)
    has_weights = any(next(path.glob(w), None) for w in WEIGHTS)
    if not ((path / "config.json").is_file() and has_weights):
        from pagefleet.cluster.make_model import make_model

        print(f"writing the {preset} checkpoint to {path} ...", flush=True)
        make_model(path, preset=preset)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    return str(path.resolve()), vocab
