"""The tensor-parallel group: gloo on CPU, nccl on CUDA, nothing at size 1.

Layers call these functions unconditionally, so model code never branches on
parallelism: with no group (size 1) every collective is the identity. The
group is this module's explicit state, set up by `init_tp` and torn down by
`destroy_tp`, so an engine with tensor parallelism can be closed and a
single-process engine built afterwards in the same process.

Lifecycle of a group of N ranks (rank 0 is the engine, 1..N-1 mirror it):

1. Rendezvous. Whoever starts the ranks opens a `TCPStore` master bound to
   port 0 (`open_rendezvous`): the kernel picks a free port and the store
   holds it from then on, so no other process can take it between choosing
   and binding (a guessed "free" port could be). The `Rendezvous` (host,
   port) travels to every rank; the host is one every rank can reach (the
   node's address under Ray, 127.0.0.1 for local processes).
2. Join (`init_tp`). Each rank counts itself in on the store and waits there
   until all N have arrived, with the start-up time-out: ranks started long
   before rank 0 (Ray actors come up before the engine process) wait on the
   store, not inside `init_process_group`, whose time-out is the collectives'.
   Then all join the process group at once.
3. Ready. After building its model runner each rank 1..N-1 counts itself
   ready (`mark_ready`); rank 0 waits for them (`wait_ranks_ready`) before it
   serves, so a slow weight load never looks like a hung collective.
4. Steps. Rank 0 announces each step on the store, then broadcasts its inputs
   (`post_step`); the other ranks wait for the announcement on the store and
   then receive (`next_step`). An idle engine posts nothing for as long as it
   likes: its ranks wait on the store, which has no deadline, never in a
   collective, which has `COLLECTIVE_TIMEOUT`. Inside a step every rank works
   in lockstep, so the collective time-out only ends real hangs (a rank
   lost without its peers noticing); a dead rank is normally noticed sooner
   (gloo sees its sockets close; under Serve the replica watches its rank
   actors).
5. Stop: rank 0 posts None; every rank leaves the group (`destroy_tp`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# A collective that does not complete in this long is a hang (every rank runs the same
# step in lockstep): fail it rather than wait for torch's default of 10-30 minutes.
# PAGEFLEET_TP_TIMEOUT_S overrides it (read when a rank joins).
COLLECTIVE_TIMEOUT = timedelta(seconds=60)
# How long ranks wait for one another to join and to load their weights.
STARTUP_TIMEOUT = timedelta(minutes=10)
# One `wait` on the store while idle; the wait is repeated, so this only bounds one call
# (the socket poll under it takes milliseconds as a C int).
_IDLE_WAIT = timedelta(hours=1)
_POLL_S = 0.02

_GROUP_SIZE = 1
_RANK = 0
_STORE: dist.TCPStore | None = None
_STEP = 0


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks of one group meet: a TCPStore master's address."""

    host: str
    port: int


def open_rendezvous(host: str, world_size: int) -> tuple[dist.TCPStore, Rendezvous]:
    """A store master on a port the kernel picks (bound now, so nobody can take it).

    The caller keeps the returned store alive for the group's life: the ranks
    talk through it. It listens on every interface; `host` is the address the
    ranks are told to connect to.
    """
    store = dist.TCPStore(
        host, 0, world_size, is_master=True, wait_for_workers=False, timeout=STARTUP_TIMEOUT
    )
    return store, Rendezvous(host, store.port)


def rank_device(device: str, rank: int, visibility: str = "shared") -> torch.device:
    """The device of tensor-parallel rank `rank`.

    CPU: `device`. CUDA with "shared" visibility (every rank's process sees the
    same GPUs, as local worker processes do): GPU base + rank, base being the
    index in `device` ("cuda:2" -> 2; "cuda" -> 0). CUDA with "per_rank"
    visibility (each process sees only its own GPU, as Ray actors do through
    CUDA_VISIBLE_DEVICES): cuda:0 for every rank.
    """
    d = torch.device(device)
    if d.type != "cuda":
        return d
    if visibility == "per_rank":
        return torch.device("cuda", 0)
    return torch.device("cuda", (d.index or 0) + rank)


def select_device(device: str, rank: int, visibility: str = "shared") -> torch.device:
    """Make rank `rank`'s device this process's current CUDA device, and return it.

    NCCL runs a rank's collectives (and broadcast_object_list its pickles) on
    the current device, and Triton launches its kernels there: without this,
    every rank of a TP group would run them on GPU 0.
    """
    d = rank_device(device, rank, visibility)
    if d.type == "cuda":
        torch.cuda.set_device(d)
    return d


def _count_and_wait(
    store: dist.TCPStore,
    key: str,
    target: int,
    what: str,
    failed: Callable[[], str | None] | None = None,
    increment: int = 1,
) -> None:
    """Add `increment` to counter `key`, then poll until it reaches `target`.

    Polls `add(key, 0)` (an atomic read that never times out) rather than a
    blocking store call, so a `failed` check can end the wait early.
    """
    value = store.add(key, increment)
    deadline = time.monotonic() + STARTUP_TIMEOUT.total_seconds()
    while value < target:
        if failed is not None and (reason := failed()) is not None:
            raise RuntimeError(f"{what}: {reason}")
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{what}: {value} of {target} within {STARTUP_TIMEOUT.total_seconds():.0f} s"
            )
        time.sleep(_POLL_S)
        value = store.add(key, 0)


def collective_timeout() -> timedelta:
    value = os.environ.get("PAGEFLEET_TP_TIMEOUT_S")
    return COLLECTIVE_TIMEOUT if not value else timedelta(seconds=float(value))


def init_tp(
    rank: int,
    world_size: int,
    rendezvous: Rendezvous,
    device: str,
    visibility: str = "shared",
    failed: Callable[[], str | None] | None = None,
) -> None:
    """Join the tensor-parallel group at `rendezvous` (every rank calls this).

    `failed` (rank 0: its executor's check) ends the wait for the others early
    when one of them is already gone.
    """
    global _GROUP_SIZE, _RANK, _STORE, _STEP
    backend = "nccl" if device.startswith("cuda") else "gloo"
    # Before the group exists: NCCL binds to the current device.
    select_device(device, rank, visibility)
    store = dist.TCPStore(
        rendezvous.host, rendezvous.port, world_size, is_master=False, timeout=STARTUP_TIMEOUT
    )
    _count_and_wait(store, "pagefleet/joined", world_size, "tensor-parallel ranks joined", failed)
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=collective_timeout()
    )
    _GROUP_SIZE, _RANK, _STORE, _STEP = world_size, rank, store, 0


def mark_ready() -> None:
    """Ranks 1..N-1: this rank has built its model and waits for steps."""
    assert _STORE is not None
    _STORE.add("pagefleet/ready", 1)


def wait_ranks_ready(failed: Callable[[], str | None] | None = None) -> None:
    """Rank 0: return once every other rank has marked itself ready."""
    assert _STORE is not None
    _count_and_wait(
        _STORE, "pagefleet/ready", _GROUP_SIZE - 1, "tensor-parallel ranks ready", failed, 0
    )


def post_step(obj: object) -> None:
    """Rank 0: announce step n on the store, then broadcast its inputs (None: stop)."""
    global _STEP
    assert _STORE is not None
    _STEP += 1
    _STORE.set(f"pagefleet/step/{_STEP}", b"")
    if _STEP > 1:
        # Every rank has passed step n-1's announcement: rank 0 finished step n-1, whose
        # forward pass all-reduces with every rank. Deleting it keeps the store small.
        _STORE.delete_key(f"pagefleet/step/{_STEP - 1}")
    broadcast_object(obj)


def next_step() -> object:
    """Ranks 1..N-1: wait (without a deadline) for rank 0's next step; its inputs."""
    global _STEP
    assert _STORE is not None
    _STEP += 1
    key = f"pagefleet/step/{_STEP}"
    while True:
        try:
            _STORE.wait([key], _IDLE_WAIT)
            break
        except dist.DistStoreError:
            continue  # idle for an hour: keep waiting (a lost store raises DistNetworkError)
    return broadcast_object()


def destroy_tp() -> None:
    global _GROUP_SIZE, _RANK, _STORE, _STEP
    if dist.is_initialized():
        dist.destroy_process_group()
    _GROUP_SIZE, _RANK, _STORE, _STEP = 1, 0, None, 0


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
