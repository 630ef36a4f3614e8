"""MXFP4 (OCP microscaling FP4), as gpt-oss checkpoints store their experts.

A quantized tensor W [..., rows, cols] comes as two checkpoint tensors:
`NAME_blocks` uint8 [..., rows, cols / 32, 16] and `NAME_scales` uint8
[..., rows, cols / 32]. Each byte of a block holds two FP4 (e2m1) codes, the
low nibble first: byte j of a 32-element block carries elements 2j (low) and
2j + 1 (high). A code's 4 bits are sign, 2 exponent bits and 1 mantissa bit:
values 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives (code 8 is -0). Each
32-element block shares one power-of-two scale, 2 ** (scale - 127). The
dequantized value is exactly code_value * 2 ** (scale - 127).

gpt-oss's quantized tensors are the transposes of its unquantized ones
(`gate_up_proj` [experts, 2 * intermediate, hidden] quantized along hidden,
stored unquantized as [experts, hidden, 2 * intermediate]):
`dequantize_checkpoint_tensor` returns the unquantized layout.
"""

from __future__ import annotations

import torch

BLOCKS_SUFFIX = "_blocks"
SCALES_SUFFIX = "_scales"
BLOCK_SIZE = 32
SCALE_BIAS = 127
FP4_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks [..., G, 16] uint8, scales [..., G] uint8 -> float32 [..., G * 32]."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK_SIZE // 2:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}"
        )
    table = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).long()
    values = table[codes].flatten(-2)  # [..., G, 32]
    exponents = scales.to(torch.int32) - SCALE_BIAS
    return torch.ldexp(values, exponents.unsqueeze(-1)).flatten(-2)


def dequantize_checkpoint_tensor(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """A gpt-oss `*_blocks`/`*_scales` pair -> the tensor in its unquantized checkpoint layout."""
    return dequantize_mxfp4(blocks, scales).transpose(-2, -1).contiguous()


def quantize_mxfp4(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Pack FP4 codes [..., G * 32] (integers 0..15) into blocks [..., G, 16] (for tests)."""
    pairs = codes.to(torch.uint8).unflatten(-1, (scales.shape[-1], BLOCK_SIZE // 2, 2))
    return pairs[..., 0] | (pairs[..., 1] << 4)
