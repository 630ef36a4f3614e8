"""The Llama family: Llama 2/3, SmolLM, Mistral and Qwen2 share this code.

They differ only in settings read from config.json: grouped-query attention
(num_key_value_heads), biases on the QKV projection (Qwen2), tied or untied
LM head, rope scaling (Llama 3), and sliding-window layers (Mistral's
`sliding_window`, Qwen2's with `use_sliding_window`; see `windows.py`). The model works on a flat batch of
tokens; the paged KV cache and the step's layout come in a ForwardContext.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from ..layers.activation import SiluAndMul
from ..layers.attention import Attention, ForwardContext
from ..layers.embedding import ParallelLMHead, VocabParallelEmbedding
from ..layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from ..layers.norm import RMSNorm
from ..layers.rotary import RotaryEmbedding, apply_rotary, rope_parameters
from .windows import freeable_window, layer_sliding_windows


@dataclass(frozen=True)
class LlamaArgs:
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
    rope: dict
    sliding_window: int | None  # past it no layer reads a token (None: some layer reads all)
    layer_windows: tuple[int | None, ...] = ()  # each layer's window (empty: none slides)

    @classmethod
    def from_hf(cls, cfg: dict) -> LlamaArgs:
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg.get('hidden_act')!r} is not supported (silu is)")
        heads = cfg["num_attention_heads"]
        model_type = cfg.get("model_type", "llama")
        windows = layer_sliding_windows(cfg)
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=model_type == "qwen2" or cfg.get("attention_bias", False),
            rope=rope_parameters(cfg),
            sliding_window=freeable_window(windows),
            layer_windows=windows,
        )


Rope = tuple[torch.Tensor, torch.Tensor]


class LlamaAttention(nn.Module):
    def __init__(self, args: LlamaArgs, layer_idx: int) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            args.hidden_size, args.head_dim, args.num_heads, args.num_kv_heads, bias=args.qkv_bias
        )
        self.num_heads = self.qkv_proj.num_heads  # this rank's
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = args.head_dim
        self.o_proj = RowParallelLinear(args.num_heads * args.head_dim, args.hidden_size)
        self.attn = Attention(
            layer_idx,
            self.num_heads,
            self.num_kv_heads,
            args.head_dim,
            sliding_window=args.layer_windows[layer_idx] if args.layer_windows else None,
        )

    def forward(self, x: torch.Tensor, rope: Rope, ctx: ForwardContext | None) -> torch.Tensor:
        n = x.shape[0]
        heads, kv_heads, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x).view(n, heads + 2 * kv_heads, d)
        # Queries and keys are rotated together, in one pass.
        qk = apply_rotary(qkv[:, : heads + kv_heads], rope)
        q, k, v = qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads :]
        o = self.attn(q, k, v, ctx)  # [n, heads, head_dim]
        return self.o_proj(o.view(n, heads * d))


class LlamaMLP(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            args.hidden_size, [args.intermediate_size, args.intermediate_size]
        )
        self.act = SiluAndMul()
        self.down_proj = RowParallelLinear(args.intermediate_size, args.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, args: LlamaArgs, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = LlamaAttention(args, layer_idx)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = LlamaMLP(args)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, rope: Rope, ctx: ForwardContext | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, rope, ctx)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    # Checkpoint projections that land in one fused parameter: name -> (fused, shard).
    packed_modules = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, args: LlamaArgs, max_position: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.args = args
        self.embed_tokens = VocabParallelEmbedding(args.vocab_size, args.hidden_size)
        self.rotary = RotaryEmbedding(args.head_dim, max_position, args.rope, dtype)
        self.layers = nn.ModuleList(LlamaDecoderLayer(args, i) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
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
        # ctx None: compiled, the step's context is forward_context()'s (pagefleet/engine/custom_ops.py).
        x = self.embed_tokens(input_ids)
        rope = self.rotary(positions)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, rope, ctx)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def checkpoint_targets(self, names: Iterable[str]) -> Iterable[tuple[str, str, object]]:
        """Map checkpoint tensor names to (checkpoint name, parameter name, shard id)."""
        for name in names:
            if "rotary_emb.inv_freq" in name:
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
