"""Write a deterministic Hugging Face checkpoint with seeded random weights.

There is no model hub here, so tests, the default config and the benchmarks
use checkpoints this module writes: config.json, model.safetensors,
generation_config.json and a byte-level BPE tokenizer (trained with
`tokenizers` on the Python standard library's own sources) with a ChatML
chat template. The model is built through transformers' own classes, so
transformers loads it as the correctness oracle exactly as it would a
downloaded model.
"""

from __future__ import annotations

import json
import sysconfig
from dataclasses import asdict, replace
from pathlib import Path

from .model_presets import DEFAULT_PRESET, MOE_ARCHS, PRESETS, ModelShape, preset_arch

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML; with `tools`, the Hermes convention (as Qwen2.5's template): the tools' JSON
# schemas in the system turn, each call the model makes a <tool_call> block holding
# {"name": ..., "arguments": {...}}, each result a <tool_response> block in a user turn.
# A conversation without tools renders exactly as plain ChatML.
CHAT_TEMPLATE = (
    "{%- if tools -%}"
    "{{ '<|im_start|>system\n' }}"
    "{%- if messages[0]['role'] == 'system' -%}{{ messages[0]['content'] + '\n\n' }}{%- endif -%}"
    "{{ '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}"
    "{%- for tool in tools -%}{{ '\n' + (tool | tojson) }}{%- endfor -%}"
    "{{ '\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call><|im_end|>\n' }}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' and loop.first and tools -%}"
    "{%- elif message['role'] == 'tool' -%}"
    "{{ '<|im_start|>user\n<tool_response>\n' + (message['content'] or '') "
    "+ '\n</tool_response><|im_end|>\n' }}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] -%}"
    "{{ '<|im_start|>assistant\n' + (message['content'] + '\n' if message['content'] else '') }}"
    "{%- for call in message['tool_calls'] -%}"
    "{%- set args = call['function']['arguments'] -%}"
    "{{ ('' if loop.first else '\n') + '<tool_call>\n{\"name\": \"' + call['function']['name'] }}"
    '{{ \'", "arguments": \' }}'
    "{{ args if args is string else (args | tojson) }}{{ '}\n</tool_call>' }}"
    "{%- endfor -%}"
    "{{ '<|im_end|>\n' }}"
    "{%- else -%}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)
_CORPUS_BYTES = {1024: 2_000_000, 49152: 12_000_000}
# make-model's arch -> transformers' model_type, where they differ.
_MODEL_TYPES = {"gemma3": "gemma3_text"}


def train_tokenizer(vocab_size: int):
    """A byte-level BPE trained on the standard library's sources (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    budget = _CORPUS_BYTES.get(vocab_size, max(2_000_000, vocab_size * 250))
    texts: list[str] = []
    used = 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if "test" in path.parts or used >= budget:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        used += len(text)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=1 << 30,
    )


def hf_config_fields(shape: ModelShape, eos_id: int) -> dict[str, object]:
    """The Hugging Face config fields of `shape` (Llama's and Qwen2's names)."""
    return dict(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        max_position_embeddings=shape.max_position_embeddings,
        initializer_range=shape.initializer_range,
        rms_norm_eps=shape.rms_norm_eps,
        rope_theta=shape.rope_theta,
        tie_word_embeddings=shape.tie_word_embeddings,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )


def family_config_fields(arch: str, shape: ModelShape) -> dict[str, object]:
    """The fields one family adds to the common ones (experts, windows, Granite's
    multipliers, Gemma's soft-caps...)."""
    if arch in MOE_ARCHS and not shape.num_experts:
        raise ValueError(f"arch {arch!r} needs a preset with experts (num_experts > 0)")
    fields: dict[str, object] = {}
    if shape.head_dim is not None:
        fields["head_dim"] = shape.head_dim
    fields.update(_window_fields(arch, shape))
    if arch == "qwen3_moe":
        fields.update(
            num_experts=shape.num_experts,
            num_experts_per_tok=shape.num_experts_per_tok,
            moe_intermediate_size=shape.moe_intermediate_size,
            norm_topk_prob=True,
        )
    if arch == "mixtral":
        fields.update(
            num_local_experts=shape.num_experts,
            num_experts_per_tok=shape.num_experts_per_tok,
            intermediate_size=shape.moe_intermediate_size,
        )
    if arch == "granite":
        # Granite 3's multipliers at this width.
        fields.update(
            embedding_multiplier=12.0,
            attention_multiplier=1.0 / (shape.head_dim or shape.hidden_size // shape.num_heads),
            residual_multiplier=0.22,
            logits_scaling=8.0,
        )
    if arch.startswith("gemma"):
        fields.update(_gemma_fields(arch, shape))
    if arch == "gpt_oss":
        fields.update(_gpt_oss_fields(shape))
    return fields


def _window_fields(arch: str, shape: ModelShape) -> dict[str, object]:
    """The preset's sliding window in the family's own fields (None: no layer slides)."""
    window = shape.sliding_window
    if arch in ("qwen2", "qwen3", "qwen3_moe", "smollm3"):
        fields: dict[str, object] = dict(
            use_sliding_window=window is not None, sliding_window=window
        )
        if arch in ("qwen2", "qwen3"):
            fields["max_window_layers"] = 1  # the first layer global, the others sliding
        return fields
    if arch in ("mistral", "mixtral", "phi3"):
        return {"sliding_window": window}  # every layer
    return {}


def _gemma_fields(arch: str, shape: ModelShape) -> dict[str, object]:
    """Gemma 2/3: sliding layers (`layer_types`, or the family's pattern), Gemma 2's
    soft-caps, Gemma 3's local rope base on its sliding layers."""
    head_dim = shape.head_dim or shape.hidden_size // shape.num_heads
    fields: dict[str, object] = dict(
        head_dim=head_dim,
        query_pre_attn_scalar=head_dim,
        sliding_window=shape.sliding_window,
        hidden_activation="gelu_pytorch_tanh",
    )
    if shape.layer_types is not None:
        fields["layer_types"] = list(shape.layer_types)
    full = {"rope_type": "default", "rope_theta": shape.rope_theta}
    if arch == "gemma2":
        attn_cap, final_cap = shape.logit_soft_caps
        fields.update(
            rope_parameters=full,
            attn_logit_softcapping=attn_cap,
            final_logit_softcapping=final_cap,
        )
    else:
        local = {"rope_type": "default", "rope_theta": shape.rope_local_base_freq}
        fields["rope_parameters"] = {"full_attention": full, "sliding_attention": local}
    return fields


def _gpt_oss_fields(shape: ModelShape) -> dict[str, object]:
    """gpt-oss: experts of `moe_intermediate_size`, sliding layers alternating with global
    ones (transformers' default `layer_types`), gpt-oss's YaRN (factor 32 over a 32nd of the
    context, as gpt-oss 131072 over 4096)."""
    fields: dict[str, object] = dict(
        num_local_experts=shape.num_experts,
        num_experts_per_tok=shape.num_experts_per_tok,
        intermediate_size=shape.moe_intermediate_size,
        attention_bias=True,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": shape.rope_theta,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": shape.max_position_embeddings // 32,
        },
    )
    if shape.sliding_window is not None:
        fields["sliding_window"] = shape.sliding_window
    return fields


def build_hf_model(arch: str, fields: dict[str, object]):
    """transformers' own config and model classes for `arch` (its model_type)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(_MODEL_TYPES.get(arch, arch), **fields)
    model = AutoModelForCausalLM.from_config(config)
    if arch.startswith("gemma"):
        _perturb(model, "norm")
    if arch == "gpt_oss":
        _perturb(model, "bias")
        _perturb(model, "sinks", std=1.0)
    return model


def _perturb(model, part: str, std: float = 0.3) -> None:
    """Random weights for the parameters named with `part` that transformers starts at zero
    or near it (Gemma's norms: a scale of 1 + w = 1; gpt-oss's biases and sinks), so a
    checkpoint tells them apart."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if part in name:
                param.normal_(0.0, std)


def make_model(
    out_dir: str | Path,
    preset: str = DEFAULT_PRESET,
    arch: str | None = None,
    seed: int = 0,
    config_overrides: dict[str, object] | None = None,
    dtype: str = "float32",
    **overrides: object,
) -> Path:
    """Write the checkpoint into `out_dir` and return its path.

    `arch`: one of the preset's architectures (None: its default, `preset_arch`).
    `overrides` replace fields of the preset's ModelShape (e.g. num_kv_heads=4);
    `config_overrides` are passed on to the transformers config class (e.g.
    rope_parameters, mlp_only_layers).
    """
    import torch
    from transformers import GenerationConfig

    arch = preset_arch(preset, arch)
    shape = replace(PRESETS[preset], **overrides)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = train_tokenizer(shape.vocab_size)
    eos_ids = [tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>")]
    fields = {**hf_config_fields(shape, eos_ids[0]), **family_config_fields(arch, shape)}
    torch.manual_seed(seed)
    model = build_hf_model(arch, {**fields, **(config_overrides or {})})
    model = model.to(getattr(torch, dtype)).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=eos_ids[0], eos_token_id=eos_ids, pad_token_id=eos_ids[0]
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "pagefleet_model.json").write_text(
        json.dumps({"preset": preset, "arch": arch, "seed": seed, "shape": asdict(shape)}, indent=2)
    )
    return out


def ensure_model(out_dir: str | Path, preset: str, arch: str | None = None, seed: int = 0) -> Path:
    """make_model unless `out_dir` already holds that exact checkpoint."""
    arch = preset_arch(preset, arch)
    out = Path(out_dir)
    marker = out / "pagefleet_model.json"
    if marker.exists() and (out / "model.safetensors").exists():
        info = json.loads(marker.read_text())
        if (info["preset"], info["arch"], info["seed"]) == (preset, arch, seed):
            return out
    return make_model(out, preset=preset, arch=arch, seed=seed)
