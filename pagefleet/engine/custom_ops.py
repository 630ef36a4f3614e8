"""The custom operators a compiled forward calls: attention and pre-packed CPU GEMMs.

`torch.compile` traces the model into one graph per shape class, and
inductor fuses the elementwise work between the matrix products (RMSNorm
with its residual add, SiLU-and-mul, the rotary embedding and its table
lookup) into generated C++ (CPU) or Triton (CUDA) kernels. Two things must
stay out of the graph:

- attention, whose work depends on the step's layout (how many decodes,
  which blocks, the padded masks of the torch path): traced, its Python
  branches and integer fields would become guards and every new layout a
  recompile. `pagefleet::attention(q, k, v, layer, scale, sliding_window,
  logits_soft_cap, sinks)` is one opaque
  call that reads the layout and the KV caches from the step's
  `ForwardContext` (set by `forward_context`), stores K/V and attends with
  the kernels of `pagefleet.kernels`, dispatched by device as in eager mode;
- the oneDNN pre-packed weights (`cpu_gemm.PackedWeight`), which are opaque
  tensors the tracer cannot fake: `pagefleet::packed_linear(x, bias, slot)`
  runs the packed GEMM of the context's weight `slot`, with the same
  dispatch (native or emulated bf16, dense weight for one or two rows) as
  the eager layer.

Both ops name what they use by small integers (layer index, weight slot),
so the graph of one model shape is the same for every engine instance and
every process: inductor's on-disk cache then serves a second start-up.
Their fake (meta) implementations only give the output's shape and dtype.
Registering them is importing this module.
"""

from __future__ import annotations

import torch

from .layers.attention import attend, current_forward_context


@torch.library.custom_op("pagefleet::attention", mutates_args=())
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_idx: int,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    # The KV cache it writes is not an argument: it lives in the step's context,
    # outside the graph, like vLLM's unified attention op.
    ctx = current_forward_context()
    out = attend(layer_idx, q, k, v, ctx, scale, sliding_window, logits_soft_cap, sinks)
    return out.contiguous()


@attention.register_fake
def _(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_idx: int,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@torch.library.custom_op("pagefleet::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, bias: torch.Tensor | None, slot: int) -> torch.Tensor:
    return current_forward_context().packed_weights[slot].linear(x, bias)


@packed_linear.register_fake
def _(x: torch.Tensor, bias: torch.Tensor | None, slot: int):
    weight = current_forward_context().packed_weights[slot]
    return x.new_empty(x.shape[0], weight.out_features, dtype=weight.out_dtype)
