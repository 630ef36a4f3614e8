"""Rotary position embedding (Hugging Face's "rotate half" layout) with Llama 3 scaling."""

from __future__ import annotations

import math

import torch
from torch import nn


def rope_parameters(hf_config: dict) -> dict:
    """Rope settings from a config.json of either layout.

    transformers >= 5 writes `rope_parameters` (theta and scaling together);
    older checkpoints have `rope_theta` and an optional `rope_scaling`.
    """
    params = dict(hf_config.get("rope_parameters") or {})
    if "rope_theta" not in params:
        params["rope_theta"] = hf_config.get("rope_theta", 10000.0)
    scaling = hf_config.get("rope_scaling") or {}
    params.update(scaling)
    params["rope_type"] = params.get("rope_type", params.get("type", "default")) or "default"
    return params


def _inv_freq(head_dim: int, params: dict) -> torch.Tensor:
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = params["rope_type"]
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(params["factor"])
    if kind == "llama3":
        factor = float(params["factor"])
        low = float(params["low_freq_factor"])
        high = float(params["high_freq_factor"])
        old_len = float(params["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope type {kind!r} is not supported (default, linear, llama3 are)")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, params: dict, dtype: torch.dtype) -> None:
        super().__init__()
        inv_freq = _inv_freq(head_dim, params)
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # [max_position, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        # Cast like Hugging Face: tables computed in fp32, applied in the model dtype.
        self.register_buffer("cos", emb.cos().to(dtype), persistent=False)
        self.register_buffer("sin", emb.sin().to(dtype), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [num_tokens, heads, head_dim], k: [num_tokens, kv_heads, head_dim]
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
