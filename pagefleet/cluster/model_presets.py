"""The model shapes `pagefleet make-model` writes, by preset name (no torch: a config names
a preset, and it is validated where no model runs).

Each preset names the architectures its shape is written as (`ModelShape.archs`), the
first its default: a preset with experts is an MoE model, a Gemma preset's sliding layers
and soft-caps are Gemma's, `tiny` is every family's. `preset_arch` picks a preset's
architecture, the one asked for only where the preset names it.
"""

from __future__ import annotations

from dataclasses import dataclass

# Hugging Face model types make-model writes (through transformers' config classes).
ARCHS = (
    "llama",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "mixtral",
    "phi3",
    "olmo2",
    "granite",
    "smollm3",
    "mistral",
    "gemma2",
    "gemma3",
    "gpt_oss",
)
MOE_ARCHS = ("qwen3_moe", "mixtral", "gpt_oss")
GEMMA_ARCHS = ("gemma3", "gemma2")
DENSE_ARCHS = tuple(a for a in ARCHS if a not in MOE_ARCHS + GEMMA_ARCHS)


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
    head_dim: int | None = None  # None: hidden_size // num_heads
    # Mixture of experts (the MoE architectures; the dense ones ignore these).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    sliding_window: int | None = None  # the sliding layers' window (None: no layer slides)
    # Gemma: which layers slide ("sliding_attention"/"full_attention"; None: the family's
    # pattern), the local rope base of Gemma 3, and Gemma 2's (attention, final) soft-caps.
    layer_types: tuple[str, ...] | None = None
    rope_local_base_freq: float = 10000.0
    logit_soft_caps: tuple[float, float] = (50.0, 30.0)
    # The architectures this shape is written as, the first by default.
    archs: tuple[str, ...] = DENSE_ARCHS

    def __post_init__(self) -> None:
        if not self.archs or not set(self.archs) <= set(ARCHS):
            raise ValueError(f"archs must be some of {', '.join(ARCHS)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must divide by num_kv_heads")
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError("hidden_size must divide by num_heads (or give head_dim)")


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
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        archs=ARCHS,
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
    # Qwen3-30B-A3B's layer shape (hidden 2048, 32 query and 4 KV heads of 128, 128 experts
    # of 768, top 8; 0.62B parameters a layer) at 4 of its 48 layers, for MoE benchmarks.
    "qwen3-30b-a3b-4l": ModelShape(
        hidden_size=2048,
        num_layers=4,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        intermediate_size=6144,
        vocab_size=151936,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        archs=MOE_ARCHS,
    ),
    # The same layer once, with a 32k vocabulary: MoE benchmarks on a small CPU host.
    "qwen3-30b-a3b-1l": ModelShape(
        hidden_size=2048,
        num_layers=1,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        intermediate_size=6144,
        vocab_size=32768,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        archs=MOE_ARCHS,
    ),
    # A small Qwen3-MoE (0.38B parameters, 48M active a token without the LM head) for
    # offline benchmarks beside vLLM's CPU build on a 2-core host: 4 layers, hidden 1024,
    # 16 query and 4 KV heads of 64, 64 experts of 384, top 8.
    "qwen3-moe-small": ModelShape(
        hidden_size=1024,
        num_layers=4,
        num_heads=16,
        num_kv_heads=4,
        head_dim=64,
        intermediate_size=3072,
        vocab_size=32768,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        num_experts=64,
        num_experts_per_tok=8,
        moe_intermediate_size=384,
        archs=MOE_ARCHS,
    ),
    # Mixtral 8x7B's layer shape (hidden 4096, 8 experts of 14336, top 2) at 2 of its
    # 32 layers.
    "mixtral-8x7b-2l": ModelShape(
        hidden_size=4096,
        num_layers=2,
        num_heads=32,
        num_kv_heads=8,
        intermediate_size=14336,
        vocab_size=32000,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
        rope_theta=1000000.0,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=14336,
        archs=("mixtral", "qwen3_moe", "gpt_oss"),
    ),
    # Gemma 2/3 tests (Gemma 3 by default, `--arch gemma2`): sliding layers around a global one, a
    # window (12) shorter than the test prompts and no multiple of a block size, soft-caps
    # small enough to bend the tiny model's scores and logits.
    "gemma-tiny": ModelShape(
        hidden_size=64,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=160,
        vocab_size=1024,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        initializer_range=0.1,
        rope_theta=1_000_000.0,  # Gemma 3's sliding layers keep rope_local_base_freq (10,000)
        rms_norm_eps=1e-6,
        head_dim=16,
        sliding_window=12,
        layer_types=(
            "sliding_attention",
            "full_attention",
            "sliding_attention",
            "sliding_attention",
        ),
        logit_soft_caps=(1.5, 3.0),
        archs=GEMMA_ARCHS,
    ),
    # Gemma 3 270M's shape (0.27B parameters, 0.17B of them the embedding):
    # 18 layers, 5 sliding (512) to 1 global.
    "gemma3-270m": ModelShape(
        hidden_size=640,
        num_layers=18,
        num_heads=4,
        num_kv_heads=1,
        intermediate_size=2048,
        vocab_size=262144,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        head_dim=256,
        sliding_window=512,
        archs=GEMMA_ARCHS,
    ),
    # Gemma 3 1B's shape (1.0B parameters): 26 layers, 5 sliding (512) to 1 global.
    "gemma3-1b": ModelShape(
        hidden_size=1152,
        num_layers=26,
        num_heads=4,
        num_kv_heads=1,
        intermediate_size=6912,
        vocab_size=262144,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        head_dim=256,
        sliding_window=512,
        archs=GEMMA_ARCHS,
    ),
}
# The names `pagefleet make-model --preset` and the config's `make_model:` accept.
PRESET_NAMES: tuple[str, ...] = tuple(PRESETS)
DEFAULT_PRESET = "smollm-135m"
# The names `pagefleet make-model --preset` and the config's `make_model:` accept.
PRESET_NAMES: tuple[str, ...] = tuple(PRESETS)
DEFAULT_PRESET = "smollm-135m"


def preset_arch(preset: str, arch: str | None = None) -> str:
    """The architecture `preset` is written as: `arch` (None: the preset's default), which
    must be one the preset names."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    archs = PRESETS[preset].archs
    if arch is None:
        return archs[0]
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose from {', '.join(ARCHS)}")
    if arch not in archs:
        raise ValueError(f"preset {preset!r} is written as one of {', '.join(archs)}, not {arch!r}")
    return arch
