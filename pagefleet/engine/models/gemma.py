"""Gemma 2 and Gemma 3 (text): one decoder, two configurations.

What sets them apart from the Llama family, as transformers computes it:

- RMSNorm scales by (1 + w), normalising and scaling in fp32 before the cast
  back to the model dtype; four norms per layer: before and after attention,
  before and after the MLP (the residual adds come after the "post" norms);
- the MLP is gated GeLU (tanh approximation);
- token embeddings are multiplied by sqrt(hidden_size), the factor cast to
  the model dtype first;
- queries are scaled by query_pre_attn_scalar ** -0.5, not head_dim ** -0.5;
- layers alternate between a sliding window and global attention
  (`layer_types`, or the family's pattern: `windows.py`);
- Gemma 2: attention scores soft-capped (attn_logit_softcapping) and the
  final logits too (final_logit_softcapping);
- Gemma 3: RMSNorm over each head's queries and keys before the rotation, and
  a rope base per layer type (sliding layers: rope_local_base_freq, global
  layers: rope_theta with its scaling).

The model works on a flat batch of tokens; the paged KV cache and the step's
layout come in a ForwardContext, as for Llama.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.attention import Attention, ForwardContext
from ..layers.embedding import ParallelLMHead, VocabParallelEmbedding
from ..layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    default_weight_loader,
    set_weight_loader,
)
from ..layers.rotary import RotaryEmbedding, apply_rotary, rope_parameters
from .llama import LlamaForCausalLM
from .windows import freeable_window, layer_sliding_windows

Rope = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class GemmaArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    sliding_window: int | None  # past it no layer reads a token (None: some layer reads all)
    layer_windows: tuple[int | None, ...]  # each layer's window
    query_pre_attn_scalar: float
    attn_logit_softcapping: float | None
    final_logit_softcapping: float | None
    qk_norm: bool  # Gemma 3
    rope_global: dict
    rope_local: dict

    @classmethod
    def from_hf(cls, cfg: dict) -> GemmaArgs:
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"hidden_activation {act!r} is not supported (gelu_pytorch_tanh is)")
        heads = cfg["num_attention_heads"]
        gemma3 = cfg.get("model_type") in ("gemma3_text", "gemma3")
        windows = layer_sliding_windows(cfg)
        rope_global, rope_local = _gemma3_ropes(cfg) if gemma3 else (rope_parameters(cfg),) * 2
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 8192),
            tie_word_embeddings=cfg.get("tie_word_embeddings", True),
            qkv_bias=bool(cfg.get("attention_bias", False)),
            sliding_window=freeable_window(windows),
            layer_windows=windows,
            query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
            attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
            qk_norm=gemma3,
            rope_global=rope_global,
            rope_local=rope_local,
        )


def _gemma3_ropes(cfg: dict) -> tuple[dict, dict]:
    """(global, sliding) rope settings: transformers >= 5 nests them by layer type."""
    nested = cfg.get("rope_parameters") or {}
    if "full_attention" in nested:
        full = dict(nested["full_attention"])
        local = dict(nested.get("sliding_attention") or {"rope_theta": 10000.0})
    else:
        full = {"rope_theta": cfg.get("rope_theta", 1_000_000.0), **(cfg.get("rope_scaling") or {})}
        local = {"rope_theta": cfg.get("rope_local_base_freq", 10000.0)}
    for params in (full, local):
        params["rope_type"] = params.get("rope_type", params.get("type", "default")) or "default"
    return full, local


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + w), all in fp32, cast back to x's dtype (transformers' Gemma)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(size), requires_grad=False)
        set_weight_loader(self.weight, default_weight_loader)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class GemmaAttention(nn.Module):
    def __init__(self, args: GemmaArgs, layer_idx: int) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            args.hidden_size, args.head_dim, args.num_heads, args.num_kv_heads, bias=args.qkv_bias
        )
        self.num_heads = self.qkv_proj.num_heads  # this rank's
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = args.head_dim
        self.o_proj = RowParallelLinear(
            args.num_heads * args.head_dim, args.hidden_size, bias=args.qkv_bias
        )
        self.q_norm = GemmaRMSNorm(args.head_dim, args.rms_norm_eps) if args.qk_norm else None
        self.k_norm = GemmaRMSNorm(args.head_dim, args.rms_norm_eps) if args.qk_norm else None
        self.attn = Attention(
            layer_idx,
            self.num_heads,
            self.num_kv_heads,
            args.head_dim,
            scale=args.query_pre_attn_scalar**-0.5,
            sliding_window=args.layer_windows[layer_idx],
            logits_soft_cap=args.attn_logit_softcapping,
        )

    def forward(self, x: torch.Tensor, rope: Rope, ctx: ForwardContext | None) -> torch.Tensor:
        n = x.shape[0]
        heads, kv_heads, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x).view(n, heads + 2 * kv_heads, d)
        q, k, v = qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        o = self.attn(apply_rotary(q, rope), apply_rotary(k, rope), v, ctx)
        return self.o_proj(o.reshape(n, heads * d))


class GemmaMLP(nn.Module):
    def __init__(self, args: GemmaArgs) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            args.hidden_size, [args.intermediate_size, args.intermediate_size]
        )
        self.down_proj = RowParallelLinear(args.intermediate_size, args.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, args: GemmaArgs, layer_idx: int) -> None:
        super().__init__()
        size, eps = args.hidden_size, args.rms_norm_eps
        self.sliding = args.layer_windows[layer_idx] is not None
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.self_attn = GemmaAttention(args, layer_idx)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.mlp = GemmaMLP(args)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def forward(self, x: torch.Tensor, rope: Rope, ctx: ForwardContext | None) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), rope, ctx)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(h)


class GemmaForCausalLM(nn.Module):
    packed_modules = LlamaForCausalLM.packed_modules  # the same fused projections

    def __init__(self, args: GemmaArgs, max_position: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.args = args
        self.embed_tokens = VocabParallelEmbedding(args.vocab_size, args.hidden_size)
        normalizer = torch.tensor(args.hidden_size**0.5, dtype=torch.float32).to(dtype)
        self.register_buffer("normalizer", normalizer, persistent=False)
        self.rotary_global = RotaryEmbedding(args.head_dim, max_position, args.rope_global, dtype)
        self.rotary_local = RotaryEmbedding(args.head_dim, max_position, args.rope_local, dtype)
        self.layers = nn.ModuleList(GemmaDecoderLayer(args, i) for i in range(args.num_layers))
        self.norm = GemmaRMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = ParallelLMHead(args.vocab_size, args.hidden_size)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @property
    def num_kv_heads(self) -> int:
        return self.layers[0].self_attn.num_kv_heads

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext | None = None
    ) -> torch.Tensor:
        # input_ids, positions: [num_tokens] -> hidden states [num_tokens, hidden]
        x = self.embed_tokens(input_ids) * self.normalizer
        rope_global = self.rotary_global(positions)
        rope_local = self.rotary_local(positions)
        for layer in self.layers:
            x = layer(x, rope_local if layer.sliding else rope_global, ctx)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.compute_logits(hidden)
        cap = self.args.final_logit_softcapping
        if cap is None:
            return logits
        return torch.tanh(logits / cap) * cap

    def checkpoint_targets(self, names: Iterable[str]) -> Iterable[tuple[str, str, object]]:
        """Map checkpoint tensor names to (checkpoint name, parameter name, shard id)."""
        for name in names:
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.args.tie_word_embeddings:
                continue
            param = name.removeprefix("model.")
            shard: object = None
            for part, (fused, shard_id) in self.packed_modules.items():
                if f".{part}." in param:
                    param = param.replace(f".{part}.", f".{fused}.")
                    shard = shard_id
                    break
            yield name, param, shard
