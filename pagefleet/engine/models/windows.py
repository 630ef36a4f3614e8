"""Which layers attend through a sliding window, read from a Hugging Face config.

transformers names each layer's kind in `layer_types` ("sliding_attention" or
"full_attention"); configs written before that field say it by family:
Mistral, Mixtral, Phi-3 and Qwen3-MoE window every layer, Qwen2 and Qwen3 the
layers from `max_window_layers` on, SmolLM3 its NoPE layers, Gemma 2 and gpt-oss
every other layer from the first, Gemma 3 all but every `sliding_window_pattern`-th.
Qwen2, Qwen3, Qwen3-MoE and SmolLM3 slide only with `use_sliding_window`. A
sliding layer's query at position p sees keys p - W < j <= p (transformers'
`sliding_window_overlay`).
"""

from __future__ import annotations

# Model types whose `sliding_window` applies only with `use_sliding_window`.
_OPTIONAL_WINDOW = ("qwen2", "qwen3", "qwen3_moe", "smollm3")
_FROM_MAX_WINDOW_LAYERS = ("qwen2", "qwen3")


def layer_sliding_windows(cfg: dict) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: the layer attends over the whole context)."""
    window = cfg.get("sliding_window")
    model_type = cfg.get("model_type", "llama")
    if model_type in _OPTIONAL_WINDOW and not cfg.get("use_sliding_window", False):
        window = None
    types = _layer_types(cfg, model_type)
    return tuple(window if t == "sliding_attention" else None for t in types)


def _layer_types(cfg: dict, model_type: str) -> list[str]:
    n = cfg["num_hidden_layers"]
    if cfg.get("layer_types"):
        return list(cfg["layer_types"])
    if model_type in _FROM_MAX_WINDOW_LAYERS:
        first = cfg.get("max_window_layers", 28)
        return ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    if model_type == "smollm3":
        rope = cfg.get("no_rope_layers") or [1] * n
        return ["full_attention" if rope[i] else "sliding_attention" for i in range(n)]
    if model_type in ("gemma2", "gpt_oss"):
        return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    if model_type in ("gemma3_text", "gemma3"):
        pattern = cfg.get("sliding_window_pattern", 6)
        return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    return ["sliding_attention"] * n


def freeable_window(windows: tuple[int | None, ...]) -> int | None:
    """The window past which a token is read by no layer: the widest, if every layer slides."""
    if not windows or any(w is None for w in windows):
        return None
    return max(w for w in windows if w is not None)
