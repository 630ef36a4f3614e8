"""Linear layers that know how they are sharded across the tensor-parallel group.

Each parameter carries a `weight_loader(param, full_tensor, shard_id=None)` that
copies its own slice out of the full checkpoint tensor, so the loader never
needs to know about parallelism. Column-parallel layers split the output
dimension (no communication); row-parallel layers split the input dimension
and all-reduce their partial sums.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed import all_reduce, tp_rank, tp_world_size
from .cpu_gemm import PackedWeight


def _divide(n: int, parts: int, what: str) -> int:
    if n % parts:
        raise ValueError(f"{what} ({n}) is not divisible by tensor_parallel_size ({parts})")
    return n // parts


def set_weight_loader(param: nn.Parameter, loader: Callable[..., None]) -> None:
    param.weight_loader = loader  # type: ignore[attr-defined]


def default_weight_loader(
    param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None
) -> None:
    if param.shape != loaded.shape:
        raise ValueError(
            f"checkpoint tensor of shape {tuple(loaded.shape)} for a parameter of {tuple(param.shape)}"
        )
    param.data.copy_(loaded)


class LinearBase(nn.Module):
    """y = x W^T + b over this rank's slice of W ([out, in]) and b."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        set_weight_loader(self.weight, self.weight_loader)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            set_weight_loader(self.bias, self.weight_loader)
        else:
            self.register_parameter("bias", None)

        self.packed: PackedWeight | None = None

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None
    ) -> None:
        default_weight_loader(param, loaded)

    def pack(self, batch_hint: int) -> bool:
        """Switch to a pre-packed GEMM weight where the CPU supports one (see cpu_gemm)."""
        self.packed = PackedWeight.try_pack(self.weight, batch_hint)
        if self.packed is not None:
            # The packed copy replaces the dense weight; loading is over.
            self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)
        return self.packed is not None

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.packed is not None:
            return self.packed.linear(x, bias)
        return F.linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class ColumnParallelLinear(LinearBase):
    """Output features split over ranks; each rank returns its own slice."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        self.tp_size = tp_world_size()
        self.tp_rank = tp_rank()
        super().__init__(in_features, _divide(out_features, self.tp_size, "output size"), bias)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None
    ) -> None:
        size = param.shape[0]
        default_weight_loader(param, loaded.narrow(0, self.tp_rank * size, size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input in one matmul (e.g. gate and up).

    Checkpoint tensors arrive separately, named by their index in `output_sizes`,
    or already fused (shard id None: Phi-3's `gate_up_proj`).
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None
    ) -> None:
        if shard_id is None:
            for index, part in enumerate(loaded.split(self.output_sizes, dim=0)):
                self.weight_loader(param, part, index)
            return
        assert isinstance(shard_id, int)
        local = [s // self.tp_size for s in self.output_sizes]
        offset = sum(local[:shard_id])
        size = local[shard_id]
        target = param.data.narrow(0, offset, size)
        source = loaded.narrow(0, self.tp_rank * size, size)
        if target.shape != source.shape:
            raise ValueError(
                f"shard {shard_id}: checkpoint {tuple(loaded.shape)} does not fit {tuple(param.shape)}"
            )
        target.copy_(source)


class QKVParallelLinear(ColumnParallelLinear):
    """The fused query/key/value projection; heads are split over ranks.

    When there are fewer KV heads than ranks, each KV head is replicated on the
    ranks whose query heads use it. Checkpoint tensors arrive as "q", "k" and "v",
    or already fused (shard id None: Phi-3's `qkv_proj`).
    """

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool
    ) -> None:
        tp = tp_world_size()
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, tp, "number of attention heads")
        if num_kv_heads >= tp:
            self.num_kv_heads = _divide(num_kv_heads, tp, "number of KV heads")
            self.kv_replicas = 1
        else:
            self.num_kv_heads = 1
            self.kv_replicas = _divide(tp, num_kv_heads, "tensor_parallel_size over KV heads")
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp
        super().__init__(hidden_size, out, bias)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None
    ) -> None:
        if shard_id is None:
            self._load_fused(param, loaded)
            return
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        if shard_id == "q":
            offset, size, rank_slot = 0, q_size, self.tp_rank
        elif shard_id == "k":
            offset, size, rank_slot = q_size, kv_size, self.tp_rank // self.kv_replicas
        elif shard_id == "v":
            offset, size, rank_slot = q_size + kv_size, kv_size, self.tp_rank // self.kv_replicas
        else:
            raise ValueError(f"unknown qkv shard {shard_id!r}")
        target = param.data.narrow(0, offset, size)
        source = loaded.narrow(0, rank_slot * size, size)
        if target.shape != source.shape:
            raise ValueError(
                f"{shard_id}: checkpoint {tuple(loaded.shape)} does not fit {tuple(param.shape)}"
            )
        target.copy_(source)

    def _load_fused(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        q_full = self.num_heads * self.head_dim * self.tp_size
        kv_full = (loaded.shape[0] - q_full) // 2
        parts = loaded.split([q_full, kv_full, kv_full], dim=0)
        for name, part in zip("qkv", parts, strict=True):
            self.weight_loader(param, part, name)


class RowParallelLinear(LinearBase):
    """Input features split over ranks; partial outputs are summed with an all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        self.tp_size = tp_world_size()
        self.tp_rank = tp_rank()
        super().__init__(_divide(in_features, self.tp_size, "input size"), out_features, bias)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None
    ) -> None:
        if param.dim() == 1:  # the bias is added once, after the reduction
            default_weight_loader(param, loaded)
            return
        size = param.shape[1]
        default_weight_loader(param, loaded.narrow(1, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = all_reduce(self.matmul(x, None))
        if self.bias is not None:
            y = y + self.bias
        return y
