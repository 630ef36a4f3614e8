"""The tensor-parallel group.

At size 1 (the only size until tensor parallelism lands) every collective is
the identity and no process group exists; layers call these functions
unconditionally, so model code never branches on parallelism.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def tp_world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def tp_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the group, in place."""
    if tp_world_size() > 1:
        dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's `x` along the last dimension, in rank order."""
    world = tp_world_size()
    if world == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)
