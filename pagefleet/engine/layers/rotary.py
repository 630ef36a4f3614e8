"""Rotary position embedding (Hugging Face's "rotate half" layout) and its scalings.

Scalings, as transformers computes them: linear, Llama 3, YaRN (frequencies
blended between interpolation and extrapolation over a ramp of dimensions,
cos/sin scaled by an attention factor) and LongRoPE (Phi-3: per-dimension
short and long factors, cos/sin scaled by an attention factor). transformers
switches LongRoPE's factors for a whole forward once the sequence passes
`original_max_position_embeddings`; with a paged cache whose keys were rotated
when they were written, the factors are chosen per position instead: short
below that length, long from it on (vLLM's choice). With
`partial_rotary_factor` < 1 only the first dimensions of each head rotate.
"""

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
    params["max_position_embeddings"] = hf_config.get("max_position_embeddings", 2048)
    for key in ("original_max_position_embeddings", "partial_rotary_factor"):
        if params.get(key) is None and hf_config.get(key) is not None:
            params[key] = hf_config[key]
    return params


def rotary_dim(head_dim: int, params: dict) -> int:
    return int(head_dim * float(params.get("partial_rotary_factor") or 1.0))


def _exponents(dim: int) -> torch.Tensor:
    return torch.arange(0, dim, 2, dtype=torch.int64).float() / dim


def _inv_freq(dim: int, params: dict) -> torch.Tensor:
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** _exponents(dim))
    kind = params["rope_type"]
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(params["factor"])
    if kind == "yarn":
        return _yarn_inv_freq(dim, base, params)
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
    raise ValueError(
        f"rope type {kind!r} is not supported (default, linear, llama3, yarn, longrope are)"
    )


def _yarn_factor(params: dict) -> float:
    factor = params.get("factor")
    if factor is None:
        return params["max_position_embeddings"] / params["original_max_position_embeddings"]
    return float(factor)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_correction(rotations: float, dim: int, base: float, length: int) -> float:
    return (dim * math.log(length / (rotations * 2 * math.pi))) / (2 * math.log(base))


def _yarn_inv_freq(dim: int, base: float, params: dict) -> torch.Tensor:
    factor = _yarn_factor(params)
    length = params.get("original_max_position_embeddings") or params["max_position_embeddings"]
    low = _yarn_correction(params.get("beta_fast") or 32, dim, base, length)
    high = _yarn_correction(params.get("beta_slow") or 1, dim, base, length)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def attention_factor(params: dict) -> float:
    """The factor cos and sin are scaled by (YaRN's and LongRoPE's; 1 otherwise)."""
    kind = params["rope_type"]
    if params.get("attention_factor") is not None and kind in ("yarn", "longrope"):
        return float(params["attention_factor"])
    if kind == "yarn":
        factor = _yarn_factor(params)
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        return _yarn_mscale(factor)
    if kind == "longrope":
        original = params["original_max_position_embeddings"]
        factor = float(params.get("factor") or params["max_position_embeddings"] / original)
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return 1.0


def _position_freqs(dim: int, max_position: int, params: dict) -> torch.Tensor:
    """[max_position, dim / 2] angles; LongRoPE's factors chosen by position."""
    positions = torch.arange(max_position, dtype=torch.float32)
    if params["rope_type"] != "longrope":
        return positions[:, None] * _inv_freq(dim, params)[None, :]
    base = float(params["rope_theta"])
    short = 1.0 / (
        torch.tensor(params["short_factor"], dtype=torch.float32) * base ** _exponents(dim)
    )
    long = 1.0 / (
        torch.tensor(params["long_factor"], dtype=torch.float32) * base ** _exponents(dim)
    )
    is_long = (positions >= params["original_max_position_embeddings"])[:, None]
    return positions[:, None] * torch.where(is_long, long[None, :], short[None, :])


class RotaryEmbedding(nn.Module):
    """Rotary tables for one model; looked up once per step, applied in every layer.

    Hugging Face applies x * cos + rotate_half(x) * sin with cos/sin repeated
    over both halves; splitting into halves computes the same products and
    sums (exactly, in any dtype) with fewer operations.
    """

    def __init__(self, head_dim: int, max_position: int, params: dict, dtype: torch.dtype) -> None:
        super().__init__()
        freqs = _position_freqs(rotary_dim(head_dim, params), max_position, params)
        scale = attention_factor(params)
        # Computed in fp32, applied in the model dtype, as Hugging Face does.
        self.register_buffer("cos", (freqs.cos() * scale).to(dtype), persistent=False)
        self.register_buffer("sin", (freqs.sin() * scale).to(dtype), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # [num_tokens] -> cos, sin: [num_tokens, 1, rotary_dim / 2]
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate x: [num_tokens, heads, head_dim] by this step's (cos, sin).

    With a partial rotary dimension, only x's first 2 * cos.shape[-1] dimensions rotate.
    """
    cos, sin = rope
    half = cos.shape[-1]
    x1, x2 = x[..., :half], x[..., half : 2 * half]
    rotated = (x1 * cos - x2 * sin, x2 * cos + x1 * sin)
    if 2 * half == x.shape[-1]:
        return torch.cat(rotated, dim=-1)
    return torch.cat((*rotated, x[..., 2 * half :]), dim=-1)
