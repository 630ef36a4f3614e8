"""Rotary tables equal transformers' for YaRN and LongRoPE (short and long factors)."""

from __future__ import annotations

import pytest
import torch

from pagefleet.engine.layers.rotary import RotaryEmbedding, rope_parameters

HEAD_DIM = 32


def _hf_config(model_type: str, rope: dict, **fields: object):
    from transformers import AutoConfig

    return AutoConfig.for_model(
        model_type,
        hidden_size=128,
        num_attention_heads=4,
        head_dim=HEAD_DIM,
        max_position_embeddings=1024,
        rope_parameters=rope,
        **fields,
    )


def _hf_tables(
    config, positions: torch.Tensor, seq_len: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kind = config.rope_parameters["rope_type"]
    inv_freq, scale = ROPE_INIT_FUNCTIONS[kind](config, torch.device("cpu"), seq_len=seq_len)
    freqs = positions.float()[:, None] * inv_freq[None, :]
    return freqs.cos() * scale, freqs.sin() * scale


def _ours(config) -> RotaryEmbedding:
    return RotaryEmbedding(HEAD_DIM, 1024, rope_parameters(config.to_dict()), torch.float32)


@pytest.mark.parametrize(
    "rope",
    [
        {
            "rope_type": "yarn",
            "rope_theta": 1e6,
            "factor": 4.0,
            "original_max_position_embeddings": 256,
        },
        {
            "rope_type": "yarn",
            "rope_theta": 1e4,
            "factor": 8.0,
            "original_max_position_embeddings": 128,
            "beta_fast": 16,
            "beta_slow": 2,
            "mscale": 1.0,
            "mscale_all_dim": 0.5,
        },
    ],
)
def test_yarn_equals_transformers(rope: dict) -> None:
    config = _hf_config("qwen3", rope)
    positions = torch.arange(1024)
    cos, sin = _hf_tables(config, positions, None)
    ours = _ours(config)
    torch.testing.assert_close(ours.cos, cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(ours.sin, sin, rtol=0, atol=1e-6)


def test_longrope_short_then_long_factors_by_position() -> None:
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0 + 0.05 * i for i in range(HEAD_DIM // 2)],
        "long_factor": [1.5 + 0.25 * i for i in range(HEAD_DIM // 2)],
        "original_max_position_embeddings": 256,
    }
    config = _hf_config("phi3", rope, original_max_position_embeddings=256, pad_token_id=0)
    ours = _ours(config)
    short, long = torch.arange(256), torch.arange(256, 1024)
    for positions, seq_len in ((short, None), (long, 1024)):
        cos, sin = _hf_tables(config, positions, seq_len)
        torch.testing.assert_close(ours.cos[positions], cos, rtol=0, atol=1e-6)
        torch.testing.assert_close(ours.sin[positions], sin, rtol=0, atol=1e-6)
    # max_position_embeddings / original = 4: cos and sin carry LongRoPE's attention factor.
    assert ours.cos[0, 0].item() == pytest.approx(
        (1 + torch.tensor(4.0).log() / torch.tensor(256.0).log()).sqrt().item()
    )
