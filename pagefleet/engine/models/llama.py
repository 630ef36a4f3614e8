"""The Llama family: Llama 2/3, SmolLM, SmolLM3, Mistral, Mixtral, Qwen2, Qwen3,
Qwen3-MoE, Phi-3, OLMo 2, Granite and gpt-oss share this code.

They differ only in settings read from config.json:
- grouped-query attention (num_key_value_heads), an explicit head_dim (Qwen3),
  biases on the QKV projection (Qwen2), tied or untied LM head;
- rope scaling (Llama 3, YaRN, LongRoPE), partial rotary dimensions, and layers
  without rope (SmolLM3's `no_rope_layers`: 0 marks a NoPE layer);
- RMSNorm of queries and keys before rope: per head (Qwen3, Qwen3-MoE) or over
  the whole projection (OLMo 2);
- sliding-window layers (`windows.py`): Mistral's, Mixtral's and Phi-3's
  `sliding_window` on every layer; Qwen2's, Qwen3's, Qwen3-MoE's and SmolLM3's
  only with `use_sliding_window`, on the layers their config names;
- pre-norm blocks (x + f(norm(x))) or post-norm ones (OLMo 2: x + norm(f(x)));
- Granite's multipliers: embeddings scaled, attention scaled by
  `attention_multiplier` instead of 1/sqrt(head_dim), each block's output
  scaled before the residual add, logits divided by `logits_scaling`;
- a mixture of experts in place of the dense MLP (layers/moe.py): in every
  layer (Mixtral, top-k renormalised), or where Qwen3-MoE's
  `decoder_sparse_step` and `mlp_only_layers` say, with its `norm_topk_prob`;
- gpt-oss: biases on q/k/v/o, a learned attention sink per head, and experts
  with biases, a biased router softmaxed over its top k and the clamped
  SwiGLU (layers/moe.py `ClampedSwigluMoE`); MXFP4 experts dequantized at load;
- checkpoint layouts: separate q/k/v and gate/up projections, or fused ones
  (Phi-3's `qkv_proj` and `gate_up_proj`); experts per expert (Mixtral's
  `w1`/`w3`/`w2`, Qwen3-MoE's `gate_proj`/`up_proj`/`down_proj`) or fused.

The model works on a flat batch of tokens; the paged KV cache and the step's
layout come in a ForwardContext.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from ..layers.activation import SiluAndMul
from ..layers.attention import Attention, ForwardContext
from ..layers.embedding import ParallelLMHead, VocabParallelEmbedding
from ..distributed import tp_world_size
from ..layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    set_weight_loader,
)
from ..layers.moe import DOWN, FUSED_DOWN, FUSED_GATE_UP, GATE, UP, ClampedSwigluMoE, FusedMoE
from ..layers.norm import RMSNorm
from ..layers.rotary import RotaryEmbedding, apply_rotary, rope_parameters
from ..mxfp4 import SCALES_SUFFIX
from .windows import freeable_window, layer_sliding_windows


_HEAD_QK_NORM = ("qwen3", "qwen3_moe")
_PROJECTION_QK_NORM = ("olmo2",)


@dataclass(frozen=True)
class MoeArgs:
    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    float32_weights: bool  # Mixtral scales experts' outputs by fp32 routing weights
    swiglu_limit: float | None = None  # gpt-oss: biased experts, clamped SwiGLU, its router
    swiglu_alpha: float = 1.702

    @classmethod
    def from_hf(cls, cfg: dict) -> MoeArgs | None:
        experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
        if not experts:
            return None
        mixtral = cfg.get("model_type") == "mixtral"
        if cfg.get("model_type") == "gpt_oss":
            return cls(
                num_experts=experts,
                top_k=cfg["num_experts_per_tok"],
                intermediate_size=cfg["intermediate_size"],
                norm_topk_prob=True,
                float32_weights=False,
                swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
                swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
            )
        return cls(
            num_experts=experts,
            top_k=cfg["num_experts_per_tok"],
            intermediate_size=cfg["intermediate_size" if mixtral else "moe_intermediate_size"],
            norm_topk_prob=mixtral or bool(cfg.get("norm_topk_prob", False)),
            float32_weights=mixtral,
        )


def _sparse_layers(cfg: dict, moe: MoeArgs | None) -> tuple[bool, ...]:
    """Which layers route to experts: all (Mixtral), or Qwen3-MoE's step and exceptions."""
    layers = cfg["num_hidden_layers"]
    if moe is None:
        return (False,) * layers
    step = cfg.get("decoder_sparse_step") or 1
    dense = set(cfg.get("mlp_only_layers") or [])
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))


def _qk_norm(model_type: str) -> str:
    if model_type in _HEAD_QK_NORM:
        return "head"
    if model_type in _PROJECTION_QK_NORM:
        return "projection"
    return "none"


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
    qk_norm: str = "none"  # "none", "head" or "projection"
    post_norm: bool = False
    embedding_multiplier: float = 1.0
    attention_multiplier: float | None = None
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    rope_layers: tuple[bool, ...] = ()  # empty: every layer rotates
    moe: MoeArgs | None = None
    sparse_layers: tuple[bool, ...] = ()
    o_proj_bias: bool = False  # gpt-oss
    attention_sinks: bool = False  # gpt-oss: a learned logit per head in the softmax

    def uses_rope(self, layer_idx: int) -> bool:
        return not self.rope_layers or self.rope_layers[layer_idx]

    def is_sparse(self, layer_idx: int) -> bool:
        return bool(self.sparse_layers) and self.sparse_layers[layer_idx]

    def mlp_weights(self) -> int:
        """Parameters of every layer's MLP or experts (routers included), all layers."""
        dense = 3 * self.hidden_size * self.intermediate_size
        if self.moe is None:
            return self.num_layers * dense
        moe = self.moe
        sparse = moe.num_experts * (3 * self.hidden_size * moe.intermediate_size + self.hidden_size)
        return sum(sparse if self.is_sparse(i) else dense for i in range(self.num_layers))

    @classmethod
    def from_hf(cls, cfg: dict) -> LlamaArgs:
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg.get('hidden_act')!r} is not supported (silu is)")
        heads = cfg["num_attention_heads"]
        model_type = cfg.get("model_type", "llama")
        windows = layer_sliding_windows(cfg)
        moe = MoeArgs.from_hf(cfg)
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
            o_proj_bias=model_type == "gpt_oss" and bool(cfg.get("attention_bias", True)),
            attention_sinks=model_type == "gpt_oss",
            rope=rope_parameters(cfg),
            sliding_window=freeable_window(windows),
            layer_windows=windows,
            qk_norm=_qk_norm(model_type),
            post_norm=model_type == "olmo2",
            embedding_multiplier=cfg.get("embedding_multiplier", 1.0),
            attention_multiplier=cfg.get("attention_multiplier"),
            residual_multiplier=cfg.get("residual_multiplier", 1.0),
            logits_scaling=cfg.get("logits_scaling", 1.0),
            rope_layers=tuple(bool(x) for x in cfg.get("no_rope_layers") or ()),
            moe=moe,
            sparse_layers=_sparse_layers(cfg, moe),
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
        self.o_proj = RowParallelLinear(
            args.num_heads * args.head_dim, args.hidden_size, bias=args.o_proj_bias
        )
        self.sinks = self._make_sinks(args)
        self.use_rope = args.uses_rope(layer_idx)
        self.qk_norm = args.qk_norm
        self._make_qk_norms(args)
        self.attn = Attention(
            layer_idx,
            self.num_heads,
            self.num_kv_heads,
            args.head_dim,
            scale=args.attention_multiplier,
            sliding_window=args.layer_windows[layer_idx] if args.layer_windows else None,
        )

    def _make_qk_norms(self, args: LlamaArgs) -> None:
        if self.qk_norm == "head":
            self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps)
            self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps)
        elif self.qk_norm == "projection":
            if tp_world_size() > 1:
                raise ValueError(
                    "q/k RMSNorm over the whole projection (OLMo 2) is not split over "
                    "tensor-parallel ranks: use tensor_parallel_size 1"
                )
            self.q_norm = RMSNorm(args.num_heads * args.head_dim, args.rms_norm_eps, True)
            self.k_norm = RMSNorm(args.num_kv_heads * args.head_dim, args.rms_norm_eps, True)

    def _make_sinks(self, args: LlamaArgs) -> nn.Parameter | None:
        """This rank's heads' sink logits (kept in float32, as the kernels take them)."""
        if not args.attention_sinks:
            return None
        sinks = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32), requires_grad=False)
        rank_heads = self.num_heads
        start = self.qkv_proj.tp_rank * rank_heads

        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
            param.data.copy_(loaded.narrow(0, start, rank_heads))

        set_weight_loader(sinks, load)
        return sinks

    def _split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[n, (heads + 2 kv_heads) * d] -> queries and keys [n, heads + kv_heads, d], values."""
        n, heads, kv_heads, d = qkv.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        if self.qk_norm == "none":
            qkv = qkv.view(n, heads + 2 * kv_heads, d)
            return qkv[:, : heads + kv_heads], qkv[:, heads + kv_heads :]
        q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
        if self.qk_norm == "projection":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.reshape(n, heads, d), k.reshape(n, kv_heads, d)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        return torch.cat((q, k), dim=1), v.reshape(n, kv_heads, d)

    def forward(self, x: torch.Tensor, rope: Rope, ctx: ForwardContext | None) -> torch.Tensor:
        n, heads = x.shape[0], self.num_heads
        qk, v = self._split(self.qkv_proj(x))
        if self.use_rope:
            # Queries and keys are rotated together, in one pass.
            qk = apply_rotary(qk, rope)
        q, k = qk[:, :heads], qk[:, heads:]
        o = self.attn(q, k, v, ctx, self.sinks)  # [n, heads, head_dim]
        return self.o_proj(o.reshape(n, heads * self.head_dim))


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
        self.post_norm = args.post_norm
        self.residual_multiplier = args.residual_multiplier
        eps, post = args.rms_norm_eps, args.post_norm
        if post:
            self.post_feedforward_layernorm = RMSNorm(args.hidden_size, eps, True)
        else:
            self.input_layernorm = RMSNorm(args.hidden_size, eps)
        self.self_attn = LlamaAttention(args, layer_idx)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, eps, post)
        self.mlp: nn.Module
        moe = args.moe
        if moe is not None and args.is_sparse(layer_idx) and moe.swiglu_limit is not None:
            self.mlp = ClampedSwigluMoE(
                args.hidden_size,
                moe.intermediate_size,
                moe.num_experts,
                moe.top_k,
                moe.swiglu_limit,
                moe.swiglu_alpha,
            )
        elif moe is not None and args.is_sparse(layer_idx):
            self.mlp = FusedMoE(
                args.hidden_size,
                moe.intermediate_size,
                moe.num_experts,
                moe.top_k,
                moe.norm_topk_prob,
                moe.float32_weights,
            )
        else:
            self.mlp = LlamaMLP(args)

    def _scaled(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.residual_multiplier == 1.0 else x * self.residual_multiplier

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, rope: Rope, ctx: ForwardContext | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Pre-norm: returns (block output, residual stream); post-norm: (hidden, None)."""
        if self.post_norm:
            x = x + self.post_attention_layernorm(self.self_attn(x, rope, ctx))
            return x + self.post_feedforward_layernorm(self.mlp(x)), None
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self._scaled(self.self_attn(x, rope, ctx))
        x, residual = self.post_attention_layernorm(x, residual)
        return self._scaled(self.mlp(x)), residual


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
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, args.post_norm)
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
        if self.args.embedding_multiplier != 1.0:
            x = x * self.args.embedding_multiplier
        rope = self.rotary(positions)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, rope, ctx)
        if residual is None:
            return self.norm(x)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.compute_logits(hidden)
        if self.args.logits_scaling != 1.0:
            logits = logits / self.args.logits_scaling
        return logits

    def checkpoint_targets(self, names: Iterable[str]) -> Iterable[tuple[str, str, object]]:
        """Map checkpoint tensor names to (checkpoint name, parameter name, shard id)."""
        for name in names:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.args.tie_word_embeddings:
                continue
            if name.endswith(SCALES_SUFFIX):  # read with its MXFP4 blocks
                continue
            expert = _expert_target(name)
            if expert is not None:
                yield name, *expert
                continue
            param = name.removeprefix("model.").replace(".block_sparse_moe.", ".mlp.")
            param = param.replace(".mlp.router.", ".mlp.gate.")
            shard: object = None
            for part, (fused, shard_id) in self.packed_modules.items():
                if f".{part}." in param:
                    param = param.replace(f".{part}.", f".{fused}.")
                    shard = shard_id
                    break
            yield name, param, shard


# Per-expert checkpoint tensors: (mlp | block_sparse_moe).experts.{e}.{proj}.weight.
_PER_EXPERT = re.compile(
    r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$"
)
_FUSED_EXPERTS = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\w+)$")
_EXPERT_PROJ = {
    "gate_proj": GATE,
    "w1": GATE,
    "up_proj": UP,
    "w3": UP,
    "down_proj": DOWN,
    "w2": DOWN,
}
_FUSED_PROJ = {
    "gate_up_proj": ("w13", FUSED_GATE_UP),
    "down_proj": ("w2", FUSED_DOWN),
    # gpt-oss: expert biases, and MXFP4 blocks (the loader dequantizes them with their scales).
    "gate_up_proj_bias": ("b13", FUSED_GATE_UP),
    "down_proj_bias": ("b2", FUSED_DOWN),
    "gate_up_proj_blocks": ("w13", FUSED_GATE_UP),
    "down_proj_blocks": ("w2", FUSED_DOWN),
}


def _expert_target(name: str) -> tuple[str, object] | None:
    """(parameter, shard id) of an expert weight, per expert or fused; None for others."""
    match = _PER_EXPERT.match(name)
    if match and match[3] in _EXPERT_PROJ:
        proj = _EXPERT_PROJ[match[3]]
        return f"layers.{match[1]}.mlp.{'w2' if proj == DOWN else 'w13'}", (proj, int(match[2]))
    match = _FUSED_EXPERTS.match(name)
    if match and match[2] in _FUSED_PROJ:
        param, shard = _FUSED_PROJ[match[2]]
        return f"layers.{match[1]}.mlp.{param}", shard
    return None
