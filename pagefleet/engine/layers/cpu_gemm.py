"""Pre-packed GEMM weights for the CPU (oneDNN).

At the small batch sizes of decoding, torch's default CPU matmul reaches a
fraction of what the cores can do, and the LM head's tall [vocab, hidden]
weight is worst of all. oneDNN can reorder a weight once into the blocked
layout its GEMM kernels read directly; measured on 2 AVX2 cores (fp32,
SmolLM-135M shapes, 20 rows) that is 1.6x on the layer projections and 2.5x
on the LM head.

bf16 / fp16 weights pack natively where the CPU has bf16/fp16 arithmetic
(AVX512-BF16, AMX, AVX-NE-CONVERT). Elsewhere torch's own bf16 GEMM is
emulated and slow, so the layer computes from an fp32 copy of the weight:
bf16 -> fp32 is exact and a native bf16 GEMM accumulates in fp32 too, so the
result is a bf16 GEMM's up to summation order. One or two rows, though, are
bound by memory, not arithmetic, and there the half-size bf16 weight wins
(measured: 22.7 vs 12.6 tok/s for one SmolLM-135M sequence), so the layer
keeps both and picks by the number of rows.

fp32 weights on an AVX-512 or AVX2 CPU, and bf16 weights on a CPU with
AVX512-BF16, are also kept in the panels of our own decode GEMM
(`kernels/cpu_panel_gemm.py`), which serves inputs of up to its `MAX_ROWS`
rows: there a step streams every weight from memory for a few rows and the
panel kernel's prefetched stream reads them faster than oneDNN (BENCHMARKS.md,
"the decode GEMM"); prefill's hundreds of rows keep oneDNN's blocking. The cost
is a second copy of the weights in memory.

Under `torch.compile` the layer calls the `pagefleet::packed_linear` custom
op with its `slot` (its index among the model's packed weights, set by the
model runner) instead: the packed tensor is opaque to the tracer, and the op
runs this same `linear` at run time (`pagefleet/engine/custom_ops.py`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...kernels import cpu_panel_gemm


def _reorder(weight: torch.Tensor, batch_hint: int) -> torch.Tensor | None:
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), batch_hint)
        probe = torch.zeros(1, weight.shape[1], dtype=weight.dtype)
        torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
    except RuntimeError:
        return None
    return packed


# At most this many rows, an emulated-bf16 layer uses its dense bf16 weight.
_MEMORY_BOUND_ROWS = 2


class PackedWeight:
    def __init__(
        self,
        packed: torch.Tensor,
        out_features: int,
        compute_dtype: torch.dtype,
        out_dtype: torch.dtype,
        dense: torch.Tensor | None = None,
        panels: torch.Tensor | None = None,
    ) -> None:
        self._packed = packed
        self._panels = panels  # the decode GEMM's copy, for few rows
        self._compute_dtype = compute_dtype
        self._out_dtype = out_dtype
        self._dense = dense  # the original weight, kept where it is faster for few rows
        self.out_features = out_features
        # Index in the model's list of packed weights (ForwardContext.packed_weights).
        self.slot: int | None = None

    @classmethod
    def try_pack(cls, weight: torch.Tensor, batch_hint: int) -> PackedWeight | None:
        """Pack `weight` ([out, in]) for inputs of about `batch_hint` rows, if supported."""
        if (
            weight.device.type != "cpu"
            or weight.dim() != 2
            or not torch.backends.mkldnn.is_available()
        ):
            return None
        packed = _reorder(weight, batch_hint)
        if packed is not None:
            panels = None
            if cpu_panel_gemm.available(weight.dtype):
                panels = cpu_panel_gemm.pack(weight)
            return cls(packed, weight.shape[0], weight.dtype, weight.dtype, panels=panels)
        if weight.dtype in (torch.bfloat16, torch.float16):
            packed = _reorder(weight.float(), batch_hint)
            if packed is not None:
                return cls(
                    packed,
                    weight.shape[0],
                    torch.float32,
                    weight.dtype,
                    dense=weight.detach().clone(),
                )
        return None

    @property
    def has_panels(self) -> bool:
        """Whether few rows go to the panel kernel (`cpu_panel_gemm`)."""
        return self._panels is not None

    @property
    def emulated(self) -> bool:
        return self._compute_dtype != self._out_dtype

    @property
    def out_dtype(self) -> torch.dtype:
        return self._out_dtype

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # x: [rows, in] -> [rows, out]
        if torch.compiler.is_dynamo_compiling():
            assert self.slot is not None, "a compiled forward needs the weight's slot"
            return torch.ops.pagefleet.packed_linear(x, bias, self.slot)
        if (
            self._panels is not None
            and x.dim() == 2
            and x.shape[0] <= cpu_panel_gemm.MAX_ROWS
            and x.dtype == self._panels.dtype
        ):
            return cpu_panel_gemm.linear(x, self._panels, self.out_features, bias)
        if self._dense is not None and x.shape[0] <= _MEMORY_BOUND_ROWS:
            return F.linear(x, self._dense, bias)
        if self.emulated:
            b = None if bias is None else bias.float()
            y = torch.ops.mkldnn._linear_pointwise(x.float(), self._packed, b, "none", [], "")
            return y.to(self._out_dtype)
        return torch.ops.mkldnn._linear_pointwise(
            x.contiguous(), self._packed, bias, "none", [], ""
        )
