"""Which model class serves which Hugging Face architecture."""

from __future__ import annotations

from dataclasses import dataclass

from .gemma import GemmaArgs, GemmaForCausalLM
from .llama import LlamaArgs, LlamaForCausalLM

_ARCHITECTURES: dict[str, tuple[type, type]] = {
    "Gemma2ForCausalLM": (GemmaForCausalLM, GemmaArgs),
    "Gemma3ForCausalLM": (GemmaForCausalLM, GemmaArgs),
    **{
        name: (LlamaForCausalLM, LlamaArgs)
        for name in (
            "GptOssForCausalLM",
            "GraniteForCausalLM",
            "LlamaForCausalLM",
            "MistralForCausalLM",
            "MixtralForCausalLM",
            "Olmo2ForCausalLM",
            "Phi3ForCausalLM",
            "Qwen2ForCausalLM",
            "Qwen3ForCausalLM",
            "Qwen3MoeForCausalLM",
            "SmolLM3ForCausalLM",
        )
    },
}


@dataclass(frozen=True)
class ModelSpec:
    model_class: type[LlamaForCausalLM] | type[GemmaForCausalLM]
    args: LlamaArgs | GemmaArgs


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def resolve_model(hf_config: dict) -> ModelSpec:
    archs = hf_config.get("architectures") or []
    for arch in archs:
        if arch in _ARCHITECTURES:
            model_class, args_class = _ARCHITECTURES[arch]
            return ModelSpec(model_class, args_class.from_hf(hf_config))
    raise ValueError(
        f"architecture {archs or hf_config.get('model_type')!r} is not supported; "
        f"supported: {', '.join(supported_architectures())}"
    )
