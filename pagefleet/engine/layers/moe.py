"""Mixture of experts: a softmax top-k router and SwiGLU experts computed grouped by expert.

Routing (Qwen3-MoE's and Mixtral's): softmax over the router's logits in
float32, the top k experts of each token, their probabilities renormalised to
sum to one when `norm_topk_prob`; Qwen3-MoE casts them back to the model
dtype before scaling the experts' outputs, Mixtral scales in float32
(`float32_weights`) and casts the product.

Experts: the (token, expert) pairs are sorted by expert (a stable sort, so each
expert's rows keep token order); each expert with rows runs one GEMM pair over
its contiguous rows (gate/up, SiLU-and-mul, down), the rows are scaled by their
routing weight and summed back into their tokens with one `index_add_`. Each
token receives its experts' contributions in ascending expert order, the order
transformers adds them in. The work is a loop over the experts that have
tokens, never over tokens.

Weights: `w13` [experts, 2 * intermediate, hidden] (gate rows, then up rows)
and `w2` [experts, hidden, intermediate]. Under tensor parallelism each rank
holds a slice of every expert's intermediate dimension (column-parallel
gate/up, row-parallel down) and the partial outputs are all-reduced, as in the
dense MLP. Checkpoints come per expert (`experts.{e}.gate_proj` / `up_proj` /
`down_proj`, or Mixtral's `w1` / `w3` / `w2`) or fused (`experts.gate_up_proj`
[experts, 2 * intermediate, hidden], `experts.down_proj` [experts, hidden,
intermediate]); the weight loader takes either.

gpt-oss (`ClampedSwigluMoE`): the router adds a bias and takes the softmax of
the k selected logits only; experts carry biases on both projections and
their gated unit clamps gate (above) and up (both sides) at `swiglu_limit`:
(up + 1) * gate * sigmoid(alpha * gate). Same grouping, same summation order,
and the same `w13` layout (the loader splits the checkpoint's interleaved
gate/up columns into gate rows, then up rows).

On the CPU, `FusedMoE.pack` and `ClampedSwigluMoE.pack` replace the dense
expert weights with the grouped experts kernel's panels where it runs
(`kernels/cpu_moe.py`: fp32 on AVX-512F or AVX2+FMA, bf16 on AVX512-BF16), and
gpt-oss's biases with the kernel's: one C call per layer sorts the routing by
expert, runs every active expert's gate/up, gated unit (SiLU-and-mul, or the
clamped SwiGLU) and down over its block of rows and sums each token's rows in
ascending expert order, the grouping and the order above; the engine's threads
split the experts' weights. Elsewhere `FusedMoE` pre-packs each expert's
gate/up and down weights as the dense layers' are (`cpu_gemm.PackedWeight`,
oneDNN's blocked layout) and the loop over the experts with rows above runs on
them; `ClampedSwigluMoE` keeps its torch loop.

The expert computations are the `pagefleet::moe_experts`,
`pagefleet::cpu_moe_experts`, `pagefleet::packed_moe_experts` and
`pagefleet::clamped_swiglu_experts` custom ops: their work depends on how many
tokens each expert received, so a compiled forward keeps each as one opaque call.
The kernel's panels are ordinary tensors the op takes as arguments; the packed op
names its weights by slot in the step's `ForwardContext.packed_weights` (each
expert's gate/up, then each expert's down), as `pagefleet::packed_linear` does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ...kernels import cpu_moe
from ..distributed import all_reduce, tp_rank, tp_world_size
from .activation import silu_and_mul
from .attention import current_forward_context
from .cpu_gemm import PackedWeight
from .linear import LinearBase, set_weight_loader

# Shard ids of per-expert checkpoint tensors: (projection, expert).
GATE, UP, DOWN = "gate", "up", "down"
# Shard ids of fused checkpoint tensors (every expert at once).
FUSED_GATE_UP, FUSED_DOWN = "gate_up", "fused_down"


def _routed(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    num_experts: int,
    mlp: Callable[[int, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """sum_j topk_weights[t, j] * mlp(topk_ids[t, j], x[t]) for every token t, grouped by expert."""
    k = topk_ids.shape[1]
    flat = topk_ids.flatten()
    order = flat.argsort(stable=True)
    tokens = order // k
    rows = _grouped(x[tokens], flat[order], num_experts, mlp)
    rows = (rows * topk_weights.flatten()[order].unsqueeze(1)).to(x.dtype)
    return torch.zeros_like(x).index_add_(0, tokens, rows)


def _grouped(
    rows: torch.Tensor,
    experts: torch.Tensor,
    num_experts: int,
    mlp: Callable[[int, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """`mlp(e, block)` over each expert's contiguous block of `rows` (sorted by expert)."""
    counts = torch.bincount(experts, minlength=num_experts).tolist()
    out = torch.empty_like(rows)
    start = 0
    for e, count in enumerate(counts):
        if count:
            out[start : start + count] = mlp(e, rows[start : start + count])
            start += count
    return out


@torch.library.custom_op("pagefleet::moe_experts", mutates_args=())
def moe_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
) -> torch.Tensor:
    """sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]) for every token t."""

    def mlp(e: int, block: torch.Tensor) -> torch.Tensor:
        return F.linear(silu_and_mul(F.linear(block, w13[e])), w2[e])

    return _routed(x, topk_ids, topk_weights, w13.shape[0], mlp)


@moe_experts.register_fake
def _(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
):
    return torch.empty_like(x)


def packed_moe_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    packed: Sequence[PackedWeight],
) -> torch.Tensor:
    """`moe_experts` over pre-packed weights: every expert's gate/up, then every down."""
    n = len(packed) // 2

    def mlp(e: int, block: torch.Tensor) -> torch.Tensor:
        return packed[n + e].linear(silu_and_mul(packed[e].linear(block, None)), None)

    return _routed(x, topk_ids, topk_weights, n, mlp)


@torch.library.custom_op("pagefleet::packed_moe_experts", mutates_args=())
def packed_moe_experts_op(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    first_slot: int,
    num_experts: int,
) -> torch.Tensor:
    """`packed_moe_experts` over the step context's packed weights from `first_slot` on."""
    weights = current_forward_context().packed_weights
    packed = weights[first_slot : first_slot + 2 * num_experts]
    return packed_moe_experts(x, topk_ids, topk_weights, packed)


@packed_moe_experts_op.register_fake
def _(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    first_slot: int,
    num_experts: int,
):
    return torch.empty_like(x)


@torch.library.custom_op("pagefleet::cpu_moe_experts", mutates_args=())
def cpu_moe_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    intermediate_size: int,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    unit: str = "silu",
    limit: float = 0.0,
    alpha: float = 0.0,
) -> torch.Tensor:
    """`moe_experts` (unit "silu", no biases) or `clamped_swiglu_experts` (unit
    "clamped_swiglu") in the grouped experts kernel, over its panels (`cpu_moe.pack`,
    `cpu_moe.pack_biases`)."""
    return cpu_moe.experts(
        x, topk_ids, topk_weights, gate_up, down, intermediate_size,
        gate_up_bias, down_bias, unit, limit, alpha,
    )  # fmt: skip


@cpu_moe_experts.register_fake
def _(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    intermediate_size: int,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    unit: str = "silu",
    limit: float = 0.0,
    alpha: float = 0.0,
):
    return torch.empty_like(x)


def _kernel_runs(weights: torch.Tensor) -> bool:
    """Whether the grouped experts kernel runs for `weights` (on the CPU, its dtype built)."""
    return weights.device.type == "cpu" and cpu_moe.available(weights.dtype)


def _emptied(param: nn.Parameter) -> nn.Parameter:
    """An empty parameter of `param`'s dtype, for a dense weight its packed copy replaced."""
    return nn.Parameter(torch.empty(0, dtype=param.dtype), requires_grad=False)


class TopKRouter(LinearBase):
    """The router's logits ([experts, hidden] weight, replicated on every rank) and top-k choice."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        float32_weights: bool = False,
    ) -> None:
        super().__init__(hidden_size, num_experts, bias=False)
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.float32_weights = float32_weights

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [n, hidden] -> (weights [n, k], expert ids [n, k])."""
        probs = F.softmax(self(x), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights if self.float32_weights else weights.to(x.dtype)), ids


class FusedMoE(nn.Module):
    """Routed SwiGLU experts; each rank holds its slice of every expert's intermediate dimension."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        float32_weights: bool = False,
    ) -> None:
        super().__init__()
        self.tp_size = tp_world_size()
        self.tp_rank = tp_rank()
        if intermediate_size % self.tp_size:
            raise ValueError(
                f"expert intermediate size ({intermediate_size}) is not divisible by "
                f"tensor_parallel_size ({self.tp_size})"
            )
        self.local_size = intermediate_size // self.tp_size
        self.gate = TopKRouter(hidden_size, num_experts, top_k, norm_topk_prob, float32_weights)
        self.w13 = nn.Parameter(
            torch.empty(num_experts, 2 * self.local_size, hidden_size), requires_grad=False
        )
        self.w2 = nn.Parameter(
            torch.empty(num_experts, hidden_size, self.local_size), requires_grad=False
        )
        set_weight_loader(self.w13, self.weight_loader)
        set_weight_loader(self.w2, self.weight_loader)
        self.packed: list[PackedWeight] | None = None
        # The grouped experts kernel's panels (gate/up, down), once packed.
        self.panels: tuple[torch.Tensor, torch.Tensor] | None = None

    def pack(self, batch_hint: int) -> bool:
        """Pack the experts for the grouped experts kernel or, where it does not run, every
        expert's gate/up and down weights as the dense layers' (see cpu_gemm), if all pack."""
        if _kernel_runs(self.w13):
            self.panels = cpu_moe.pack(self.w13.data, self.w2.data)
            self._drop_dense()
            return True
        experts = [*self.w13, *self.w2]
        packed = [PackedWeight.try_pack(w, batch_hint) for w in experts]
        if any(p is None for p in packed):
            return False
        self.packed = packed  # type: ignore[assignment]
        self._drop_dense()
        return True

    def _drop_dense(self) -> None:
        # The packed copies replace the dense weights; loading is over.
        self.w13, self.w2 = _emptied(self.w13), _emptied(self.w2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate.route(x)
        return all_reduce(self._experts(x, ids, weights))

    def _experts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self.panels is not None:
            gate_up, down = self.panels
            return cpu_moe_experts(x, ids, weights, gate_up, down, self.local_size)
        if self.packed is None:
            return moe_experts(x, ids, weights, self.w13, self.w2)
        if torch.compiler.is_dynamo_compiling():
            first = self.packed[0].slot
            assert first is not None, "a compiled forward needs the experts' slots"
            return packed_moe_experts_op(x, ids, weights, first, len(self.packed) // 2)
        return packed_moe_experts(x, ids, weights, self.packed)

    def _local(self, loaded: torch.Tensor, dim: int) -> torch.Tensor:
        return loaded.narrow(dim, self.tp_rank * self.local_size, self.local_size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object) -> None:
        """Copy this rank's slice of a per-expert (`(proj, expert)`) or fused tensor."""
        n = self.local_size
        if shard_id == FUSED_GATE_UP:
            gate, up = loaded.chunk(2, dim=1)
            _copy(param.data[:, :n], self._local(gate, 1))
            _copy(param.data[:, n:], self._local(up, 1))
        elif shard_id == FUSED_DOWN:
            _copy(param.data, self._local(loaded, 2))
        else:
            proj, expert = shard_id  # type: ignore[misc]
            if proj == DOWN:
                _copy(param.data[expert], self._local(loaded, 1))
            else:
                offset = 0 if proj == GATE else n
                _copy(param.data[expert, offset : offset + n], self._local(loaded, 0))


def _copy(target: torch.Tensor, source: torch.Tensor) -> None:
    if target.shape != source.shape:
        raise ValueError(
            f"expert weight of shape {tuple(source.shape)} does not fit {tuple(target.shape)}"
        )
    target.copy_(source)


class SoftmaxAfterTopKRouter(LinearBase):
    """gpt-oss's router: logits with a bias, the top k, a softmax over those k only."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int) -> None:
        super().__init__(hidden_size, num_experts, bias=True)
        self.top_k = top_k

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [n, hidden] -> (weights [n, k], expert ids [n, k])."""
        top, ids = torch.topk(self(x), self.top_k, dim=-1)
        return F.softmax(top, dim=-1, dtype=top.dtype), ids


def clamped_swiglu(gate_up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """gpt-oss's gated unit over [gate | up] halves: (clamp(up) + 1) * g * sigmoid(alpha * g)."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


@torch.library.custom_op("pagefleet::clamped_swiglu_experts", mutates_args=())
def clamped_swiglu_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    b13: torch.Tensor,
    w2: torch.Tensor,
    b2: torch.Tensor,
    limit: float,
    alpha: float,
    down_bias: bool,
) -> torch.Tensor:
    """`moe_experts` for gpt-oss's biased experts (`down_bias`: add the down projection's)."""

    def mlp(e: int, block: torch.Tensor) -> torch.Tensor:
        glu = clamped_swiglu(F.linear(block, w13[e], b13[e]), limit, alpha)
        return F.linear(glu, w2[e], b2[e] if down_bias else None)

    return _routed(x, topk_ids, topk_weights, w13.shape[0], mlp)


@clamped_swiglu_experts.register_fake
def _(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    b13: torch.Tensor,
    w2: torch.Tensor,
    b2: torch.Tensor,
    limit: float,
    alpha: float,
    down_bias: bool,
):
    return torch.empty_like(x)


class ClampedSwigluMoE(nn.Module):
    """gpt-oss's experts: biased projections and the clamped SwiGLU, grouped by expert.

    Weights: `w13` [experts, 2 * intermediate, hidden] (gate rows, then up rows),
    `b13` [experts, 2 * intermediate], `w2` [experts, hidden, intermediate], `b2`
    [experts, hidden]; each rank holds a slice of every expert's intermediate
    dimension and rank 0 adds the down bias before the all-reduce. The checkpoint
    stores `gate_up_proj` [experts, hidden, 2 * intermediate] with gate and up
    interleaved along the last dimension (even columns gate, odd columns up), its
    bias likewise, and `down_proj` [experts, intermediate, hidden] (x @ W layouts);
    MXFP4 checkpoints come dequantized to those layouts (`engine/mxfp4.py`). On the
    CPU, `pack` swaps all four for the grouped experts kernel's panels and biases.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        swiglu_limit: float,
        swiglu_alpha: float,
    ) -> None:
        super().__init__()
        self.tp_size = tp_world_size()
        self.tp_rank = tp_rank()
        if intermediate_size % self.tp_size:
            raise ValueError(
                f"expert intermediate size ({intermediate_size}) is not divisible by "
                f"tensor_parallel_size ({self.tp_size})"
            )
        n = self.local_size = intermediate_size // self.tp_size
        self.limit = swiglu_limit
        self.alpha = swiglu_alpha
        self.gate = SoftmaxAfterTopKRouter(hidden_size, num_experts, top_k)
        self.w13 = self._param(num_experts, 2 * n, hidden_size)
        self.b13 = self._param(num_experts, 2 * n)
        self.w2 = self._param(num_experts, hidden_size, n)
        self.b2 = self._param(num_experts, hidden_size)
        # The grouped experts kernel's panels (gate/up, down) and biases, once packed.
        self.panels: tuple[torch.Tensor, torch.Tensor] | None = None
        self.biases: tuple[torch.Tensor, torch.Tensor] | None = None

    def _param(self, *shape: int) -> nn.Parameter:
        param = nn.Parameter(torch.empty(*shape), requires_grad=False)
        set_weight_loader(param, self.weight_loader)
        return param

    def pack(self, batch_hint: int) -> bool:
        """Pack the experts and their biases for the grouped experts kernel where it runs (the
        torch loop stays elsewhere)."""
        if not _kernel_runs(self.w13):
            return False
        self.panels = cpu_moe.pack(self.w13.data, self.w2.data)
        self.biases = cpu_moe.pack_biases(self.b13.data, self.b2.data, self.w13.dtype)
        for name in ("w13", "b13", "w2", "b2"):
            setattr(self, name, _emptied(getattr(self, name)))
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate.route(x)
        return all_reduce(self._experts(x, ids, weights))

    def _experts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        down_bias = self.tp_rank == 0
        if self.panels is None or self.biases is None:
            return clamped_swiglu_experts(
                x, ids, weights, self.w13, self.b13, self.w2, self.b2,
                self.limit, self.alpha, down_bias,
            )  # fmt: skip
        (gate_up, down), (b13, b2) = self.panels, self.biases
        return cpu_moe_experts(
            x, ids, weights, gate_up, down, self.local_size,
            b13, b2 if down_bias else None, "clamped_swiglu", self.limit, self.alpha,
        )  # fmt: skip

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object) -> None:
        """Copy this rank's slice of a fused gpt-oss tensor (x @ W layout, gate/up interleaved)."""
        n, start = self.local_size, self.tp_rank * self.local_size
        if param is self.b2:
            _copy(param.data, loaded)
        elif param is self.w2:
            _copy(param.data, loaded.transpose(1, 2).narrow(2, start, n))
        else:
            rows = loaded.transpose(1, 2) if param is self.w13 else loaded
            _copy(param.data[:, :n], rows[:, 0::2].narrow(1, start, n))
            _copy(param.data[:, n:], rows[:, 1::2].narrow(1, start, n))
