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

from .model_presets import ARCHS, DEFAULT_ARCH, DEFAULT_PRESET, PRESETS, ModelShape

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


def hf_config(arch: str, shape: ModelShape, common: dict[str, object]):
    """The transformers config of `arch` at `shape` (its own config class)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    window = shape.sliding_window
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen2":
        # With a window: the first layer global, the others sliding (max_window_layers).
        return Qwen2Config(
            **common,
            use_sliding_window=window is not None,
            sliding_window=window,
            max_window_layers=1,
        )
    if arch == "mistral":
        return MistralConfig(**common, sliding_window=window, head_dim=shape.head_dim)
    return _gemma_config(arch, shape, common)


def _gemma_config(arch: str, shape: ModelShape, common: dict[str, object]):
    from transformers import Gemma2Config, Gemma3TextConfig

    head_dim = shape.head_dim or shape.hidden_size // shape.num_heads
    fields = {k: v for k, v in common.items() if k != "rope_theta"}
    fields.update(
        head_dim=head_dim,
        query_pre_attn_scalar=head_dim,
        sliding_window=shape.sliding_window,
        hidden_activation="gelu_pytorch_tanh",
    )
    if shape.layer_types is not None:
        fields["layer_types"] = list(shape.layer_types)
    if arch == "gemma2":
        attn_cap, final_cap = shape.logit_soft_caps
        rope = {"rope_type": "default", "rope_theta": shape.rope_theta}
        return Gemma2Config(
            **fields,
            rope_parameters=rope,
            attn_logit_softcapping=attn_cap,
            final_logit_softcapping=final_cap,
        )
    rope = {
        "full_attention": {"rope_type": "default", "rope_theta": shape.rope_theta},
        "sliding_attention": {"rope_type": "default", "rope_theta": shape.rope_local_base_freq},
    }
    return Gemma3TextConfig(**fields, rope_parameters=rope)


def _perturb_norms(model) -> None:
    """Gemma's norms start at w = 0 (a scale of 1 + w = 1): give them random weights, so a
    checkpoint tells (1 + w) from w."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.3)


def make_model(
    out_dir: str | Path,
    preset: str = DEFAULT_PRESET,
    arch: str = DEFAULT_ARCH,
    seed: int = 0,
    **overrides: object,
) -> Path:
    """Write the checkpoint into `out_dir` and return its path.

    `overrides` replace fields of the preset's ModelShape (e.g. num_kv_heads=4).
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose from {', '.join(ARCHS)}")
    shape = replace(PRESETS[preset], **overrides)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = train_tokenizer(shape.vocab_size)
    eos_ids = [tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>")]
    common = hf_config_fields(shape, eos_ids[0])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(arch, shape, common))
    model = model.to(torch.float32).eval()
    if arch.startswith("gemma"):
        _perturb_norms(model)
    model.generation_config = GenerationConfig(
        bos_token_id=eos_ids[0], eos_token_id=eos_ids, pad_token_id=eos_ids[0]
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "pagefleet_model.json").write_text(
        json.dumps({"preset": preset, "arch": arch, "seed": seed, "shape": asdict(shape)}, indent=2)
    )
    return out


def ensure_model(out_dir: str | Path, preset: str, arch: str = DEFAULT_ARCH, seed: int = 0) -> Path:
    """make_model unless `out_dir` already holds that exact checkpoint."""
    out = Path(out_dir)
    marker = out / "pagefleet_model.json"
    if marker.exists() and (out / "model.safetensors").exists():
        info = json.loads(marker.read_text())
        if (info["preset"], info["arch"], info["seed"]) == (preset, arch, seed):
            return out
    return make_model(out, preset=preset, arch=arch, seed=seed)
