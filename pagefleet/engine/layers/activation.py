from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up over the fused [.., 2 * d] gate/up projection."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    """`silu_and_mul` as a module."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)
