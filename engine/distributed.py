"""The tensor-parallel group: gloo on CPU, nccl on CUDA, nothing at size 1.

Layers call these functions unconditionally, so model code never branches on
parallelism: with no group (size 1) every collective is the identity. The
group is this module's explicit state, set up by `init_tp` and torn down by
`destroy_tp`, so an engine with tensor parallelism can be closed and a
single-process engine built afterwards in the same process.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist

_GROUP_SIZE = 1
_RANK = 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_device(device: str, rank: int) -> torch.device:
    """The device of tensor-parallel rank `rank`: GPU base + rank on CUDA, else `device`.

    The base is the index in `device` ("cuda:2" -> 2; "cuda" -> 0).
    """
    d = torch.device(device)
    if d.type != "cuda":
        return d
    return torch.device("cuda", (d.index or 0) + rank)


def select_device(device: str, rank: int) -> torch.device:
    """Make rank `rank`'s device this process's current CUDA device, and return it.

    NCCL runs a rank's collectives (and broadcast_object_list its pickles) on
    the current device, and Triton launches its kernels there: without this,
    every rank of a TP group would run them on GPU 0.
    """
    d = rank_device(device, rank)
    if d.type == "cuda":
        torch.cuda.set_device(d)
    return d


def init_tp(rank: int, world_size: int, init_method: str, device: str) -> None:
    """Join the tensor-parallel group (every rank calls this with the same address)."""
    global _GROUP_SIZE, _RANK
    backend = "nccl" if device.startswith("cuda") else "gloo"
    select_device(device, rank)  # before the group exists: NCCL binds to the current device
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(minutes=5),
    )
    _GROUP_SIZE, _RANK = world_size, rank


def destroy_tp() -> None:
    global _GROUP_SIZE, _RANK
    if dist.is_initialized():
        dist.destroy_process_group()
    _GROUP_SIZE, _RANK = 1, 0


def tp_world_size() -> int:
    return _GROUP_SIZE


def tp_rank() -> int:
    return _RANK


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the group, in place."""
    if _GROUP_SIZE > 1:
        dist.all_reduce(x)
    return x


def min_over_group(value: int, device: torch.device) -> int:
    """The smallest of every rank's `value` (on `device`, the group's backend device)."""
    if _GROUP_SIZE == 1:
        return value
    box = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(box, op=dist.ReduceOp.MIN)
    return int(box.item())


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's `x` along the last dimension, in rank order."""
    if _GROUP_SIZE == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_GROUP_SIZE)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def broadcast_object(obj: object = None) -> object:
    """Rank 0's `obj`, on every rank."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
