"""Pre-packed GEMM weights for the CPU (oneDNN).

At the small batch sizes of decoding, torch's default CPU matmul reaches a
fraction of what the cores can do, and the LM head's tall [vocab, hidden]
weight is worst of all. oneDNN can reorder a weight once into the blocked
layout its GEMM kernels read directly; measured here (2 AVX2 cores, fp32,
SmolLM-135M shapes, 20 rows) that is 1.6x on the layer projections and 2.5x
on the LM head. Where the CPU or dtype has no such path (bf16/fp16 without
native support), `try_pack` returns None and the layer keeps F.linear.
"""

from __future__ import annotations

import torch


class PackedWeight:
    def __init__(self, packed: torch.Tensor, out_features: int) -> None:
        self._packed = packed
        self.out_features = out_features

    @classmethod
    def try_pack(cls, weight: torch.Tensor, batch_hint: int) -> PackedWeight | None:
        """Pack `weight` ([out, in]) for inputs of about `batch_hint` rows, if supported."""
        if (
            weight.device.type != "cpu"
            or weight.dim() != 2
            or not torch.backends.mkldnn.is_available()
        ):
            return None
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), batch_hint)
            probe = torch.zeros(1, weight.shape[1], dtype=weight.dtype)
            torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
        except RuntimeError:
            return None
        return cls(packed, weight.shape[0])

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # x: [rows, in] -> [rows, out]
        return torch.ops.mkldnn._linear_pointwise(
            x.contiguous(), self._packed, bias, "none", [], ""
        )
