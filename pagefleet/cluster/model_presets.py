"""The model shapes `pagefleet make-model` writes, by preset name (no torch: a config names
a preset, and it is validated where no model runs)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    initializer_range: float = 0.02
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError("hidden_size must divide by num_heads, num_heads by num_kv_heads")


PRESETS: dict[str, ModelShape] = {
    # Small enough that a test loads it in well under a second.
    "tiny": ModelShape(
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=160,
        vocab_size=1024,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        initializer_range=0.1,
    ),
    # SmolLM-135M's exact shape (134.5M parameters).
    "smollm-135m": ModelShape(
        hidden_size=576,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        intermediate_size=1536,
        vocab_size=49152,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    ),
    # Llama 3.2 1B's shape (1.24B parameters), for GPU benchmarks.
    "llama-1b": ModelShape(
        hidden_size=2048,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        intermediate_size=8192,
        vocab_size=128256,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        rope_theta=500000.0,
    ),
    # Llama 3.1 8B's shape (8.03B parameters): the fleet simulator's named GPU model
    # (`benchmarks/gpu_step_fit.py` writes it on a GPU; make-model on a CPU takes minutes).
    "llama-8b": ModelShape(
        hidden_size=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        intermediate_size=14336,
        vocab_size=128256,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        rope_theta=500000.0,
    ),
}
# The names `pagefleet make-model --preset` and the config's `make_model:` accept.
PRESET_NAMES: tuple[str, ...] = tuple(PRESETS)
DEFAULT_PRESET = "smollm-135m"
ARCHS = ("llama", "qwen2")
DEFAULT_ARCH = "llama"
