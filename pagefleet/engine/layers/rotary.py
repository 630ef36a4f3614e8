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


class RotaryEmbedding(nn.Module):
    """Rotary tables for one model; looked up once per step, applied in every layer.

    Hugging Face applies x * cos + rotate_half(x) * sin with cos/sin repeated
    over both halves; splitting into halves computes the same products and
    sums (exactly, in any dtype) with fewer operations.
    """

    def __init__(self, head_dim: int, max_position: int, params: dict, dtype: torch.dtype) -> None:
        super().__init__()
        inv_freq = _inv_freq(head_dim, params)
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # [max_position, head_dim / 2]
        # Computed in fp32, applied in the model dtype, as Hugging Face does.
        self.register_buffer("cos", freqs.cos().to(dtype), persistent=False)
        self.register_buffer("sin", freqs.sin().to(dtype), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # [num_tokens] -> cos, sin: [num_tokens, 1, head_dim / 2]
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate x: [num_tokens, heads, head_dim] by this step's (cos, sin)."""
    cos, sin = rope
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
