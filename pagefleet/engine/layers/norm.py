from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .linear import default_weight_loader, set_weight_loader


class RMSNorm(nn.Module):
    """RMS normalisation in float32, optionally fused with the residual add.

    Matches Hugging Face's Llama: normalise in fp32, cast back to the model
    dtype, then scale by the weight; with a residual, returns
    (norm(x + residual), x + residual), the sum kept in the model dtype.
    With `scale_in_float32` (OLMo 2's norms) the weight scales the fp32 values
    before the cast instead.
    """

    def __init__(self, hidden_size: int, eps: float, scale_in_float32: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.scale_in_float32 = scale_in_float32
        self.shape = (hidden_size,)
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        set_weight_loader(self.weight, default_weight_loader)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            # One fused op; equal to the step-by-step fp32 computation.
            return F.rms_norm(x, self.shape, self.weight, self.eps)
        if self.scale_in_float32:
            return F.rms_norm(x.float(), self.shape, self.weight.float(), self.eps).to(x.dtype)
        return self.weight * F.rms_norm(x.float(), self.shape, None, self.eps).to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
