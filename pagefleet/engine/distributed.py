"""The tensor-parallel group: gloo on CPU, nccl on CUDA, nothing at size 1.

Layers call these functions unconditionally, so model code never branches on
parallelism: with no group (size 1) every collective is the identity. The
group is this module's explicit state, set up by `init_tp` and torn down by
`destroy_tp`, so an engine with tensor parallelism can be closed and a
single-process engine built afterwards in the same process.

Lifecycle of a group of N ranks (rank 0 is the engine, 1..N-1 mirror it):

1. Rendezvous. Whoever starts the ranks opens a `TCPStore` master
   (`open_rendezvous`) on a socket it binds itself to `host` (the address the
   ranks are told: the node's address under Ray, 127.0.0.1 for local
   processes) and port 0, and hands to the store: it listens on that one
   address only, on a port the kernel picked and nobody else can take. It
   also draws a random 32-byte secret. The `Rendezvous` (host, port, secret;
   its repr leaves the secret out) reaches every rank only through its spawn
   or actor arguments, never through the store or any socket of ours.
2. Join (`init_tp`). Each rank talks to the store through a `SealedStore`:
   every key name is an HMAC (under the secret) of the real name, and every
   value carries an HMAC tag checked on read. TCPStore has no authentication
   and lets any client list its keys (so a secret key prefix would not stay
   secret): a client without the secret sees only opaque names it can
   neither predict before they are written nor invert, and a value it writes
   over one is refused as tampered. The process group's own keys (gloo's and
   NCCL's addresses) go through the same view. Values are signed, not
   encrypted: nothing secret is stored. Each rank marks itself joined (its
   own key, not a shared counter anyone could bump) and waits until all N
   have, with the start-up time-out: ranks started long
   before rank 0 (Ray actors come up before the engine process) wait on the
   store, not inside `init_process_group`, whose time-out is the collectives'.
   Then all join the process group at once.
3. Ready. After building its model runner each rank 1..N-1 marks itself
   ready (`mark_ready`); rank 0 waits for them (`wait_ranks_ready`) before it
   serves, so a slow weight load never looks like a hung collective.
4. Steps. Rank 0 announces step n on the store, then broadcasts its message
   (`post_step`), bytes in a uint8 tensor (the step codec's encoding, never a
   pickle), as a fixed-size header then the payload. The header carries the
   payload's length and HMAC and is itself authenticated, both tags binding
   the step number n, so a forged, tampered or replayed message is refused
   (`StepAuthenticationError`) before anything of it is decoded or a buffer
   of a forged size allocated. The other ranks wait for the announcement on
   the store, then receive and check (`next_step`). An idle engine posts
   nothing for as long as it likes: its ranks wait on the store, which has no
   deadline, never in a collective, which has `COLLECTIVE_TIMEOUT`. Inside a
   step every rank works in lockstep, so the collective time-out only ends
   real hangs (a rank lost without its peers noticing); a dead rank is
   normally noticed sooner (gloo sees its sockets close; under Serve the
   replica watches its rank actors).
5. Stop: rank 0 posts the codec's stop message; every rank leaves the group
   (`destroy_tp`).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
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
SECRET_BYTES = 32

_GROUP_SIZE = 1
_RANK = 0
_STORE: SealedStore | None = None
_SECRET = b""
_STEP = 0
_COMM_DEVICE = torch.device("cpu")  # where broadcast tensors live: the backend's device


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks of one group meet (a TCPStore master's address), and its secret."""

    host: str
    port: int
    # Only the group's own processes may learn it: never logged, so not in the repr.
    secret: bytes = field(repr=False)


class StoreTamperedError(RuntimeError):
    """A value in the rendezvous store was not written by a holder of the group's secret."""


class StepAuthenticationError(RuntimeError):
    """A step message failed its HMAC check: forged, tampered with, or replayed."""


def _mac(secret: bytes, domain: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 of `parts` under `secret`; `domain` keeps each use's tags apart."""
    h = hmac.new(secret, domain, hashlib.sha256)
    for part in parts:
        h.update(part)
    return h.digest()


class SealedStore(dist.Store):
    """A view of the rendezvous store that only holders of the group's secret can use.

    Key names are HMACs of the real names, so a client without the secret
    (which can list the store's keys) can neither predict a key before it is
    written nor tell what it is. Values carry an HMAC tag of (name, value),
    checked on every read: one overwritten by such a client raises
    `StoreTamperedError`. Counters (`add`) cannot carry a tag; nothing of the
    group's start-up or steps relies on one.
    """

    def __init__(self, store: dist.Store, secret: bytes) -> None:
        super().__init__()
        self._store = store
        self._secret = secret

    def _name(self, key: str) -> str:
        return "pf/" + _mac(self._secret, b"store-name\0", key.encode()).hex()

    def _seal(self, name: str, value: bytes | str) -> bytes:
        data = value.encode() if isinstance(value, str) else bytes(value)
        return _mac(self._secret, b"store-value\0", name.encode(), b"\0", data) + data

    def _open(self, name: str, raw: bytes) -> bytes:
        tag, data = raw[:32], raw[32:]
        if len(raw) < 32 or not hmac.compare_digest(
            tag, _mac(self._secret, b"store-value\0", name.encode(), b"\0", data)
        ):
            raise StoreTamperedError(
                "a tensor-parallel rendezvous value failed its HMAC check: "
                "written by a client without the group's secret"
            )
        return data

    def set(self, key: str, value: bytes | str) -> None:
        name = self._name(key)
        self._store.set(name, self._seal(name, value))

    def get(self, key: str) -> bytes:
        name = self._name(key)
        return self._open(name, self._store.get(name))

    def add(self, key: str, amount: int) -> int:
        return self._store.add(self._name(key), amount)

    def check(self, keys: Sequence[str]) -> bool:
        return self._store.check([self._name(k) for k in keys])

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        names = [self._name(k) for k in keys]
        if timeout is None:
            self._store.wait(names)
        else:
            self._store.wait(names, timeout)

    def delete_key(self, key: str) -> bool:
        return self._store.delete_key(self._name(key))

    def num_keys(self) -> int:
        return self._store.num_keys()

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        name = self._name(key)
        # An empty `expected` means "absent" to the store: it must stay empty, not sealed.
        sealed_expected = self._seal(name, expected) if expected else b""
        current = self._store.compare_set(name, sealed_expected, self._seal(name, desired))
        return self._open(name, current) if current else b""

    def set_timeout(self, timeout: timedelta) -> None:
        self._store.set_timeout(timeout)


def open_rendezvous(host: str, world_size: int) -> tuple[dist.TCPStore, Rendezvous]:
    """A store master listening on `host` only, on a port the kernel picks; a fresh secret.

    The caller keeps the returned store alive for the group's life: the ranks
    talk through it. TCPStore itself always listens on every interface, so the
    socket is bound here and handed over (`master_listen_fd`).
    """
    family, _, _, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
        # libuv explicitly: its server leaves the descriptor open when it fails to take
        # it (so closing it below is right) and owns it from then on (so detach it).
        store = dist.TCPStore(
            host,
            sock.getsockname()[1],
            world_size,
            is_master=True,
            wait_for_workers=False,
            timeout=STARTUP_TIMEOUT,
            master_listen_fd=sock.fileno(),
            use_libuv=True,
        )
    except BaseException:
        sock.close()
        raise
    sock.detach()
    return store, Rendezvous(host, store.port, secrets.token_bytes(SECRET_BYTES))


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

    NCCL runs a rank's collectives (the step broadcasts among them) on the
    current device, and Triton launches its kernels there: without this,
    every rank of a TP group would run them on GPU 0.
    """
    d = rank_device(device, rank, visibility)
    if d.type == "cuda":
        torch.cuda.set_device(d)
    return d


def _stage_key(stage: str, rank: int) -> str:
    return f"pagefleet/{stage}/{rank}"


def _arrive_and_wait(
    store: SealedStore,
    stage: str,
    rank: int | None,
    ranks: range,
    what: str,
    failed: Callable[[], str | None] | None = None,
) -> None:
    """Mark `rank` arrived at `stage` (None: only wait), then poll until all `ranks` have.

    One key per rank rather than a shared counter: its name needs the secret,
    so no client without it can end the wait early. Polls `check` (it never
    blocks) rather than a blocking store call, so a `failed` check can end
    the wait early.
    """
    if rank is not None:
        store.set(_stage_key(stage, rank), b"")
    keys = [_stage_key(stage, r) for r in ranks]
    deadline = time.monotonic() + STARTUP_TIMEOUT.total_seconds()
    while not store.check(keys):
        if failed is not None and (reason := failed()) is not None:
            raise RuntimeError(f"{what}: {reason}")
        if time.monotonic() > deadline:
            arrived = sum(store.check([k]) for k in keys)
            raise TimeoutError(
                f"{what}: {arrived} of {len(keys)} within {STARTUP_TIMEOUT.total_seconds():.0f} s"
            )
        time.sleep(_POLL_S)


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
    global _GROUP_SIZE, _RANK, _STORE, _SECRET, _STEP, _COMM_DEVICE
    backend = "nccl" if device.startswith("cuda") else "gloo"
    # Before the group exists: NCCL binds to the current device.
    d = select_device(device, rank, visibility)
    client = dist.TCPStore(
        rendezvous.host, rendezvous.port, world_size, is_master=False, timeout=STARTUP_TIMEOUT
    )
    store = SealedStore(client, rendezvous.secret)
    _arrive_and_wait(
        store, "joined", rank, range(world_size), "tensor-parallel ranks joined", failed
    )
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=collective_timeout()
    )
    # `store` stays referenced for the group's life: the process group calls back into it.
    _GROUP_SIZE, _RANK, _STORE, _SECRET, _STEP = world_size, rank, store, rendezvous.secret, 0
    _COMM_DEVICE = d if backend == "nccl" else torch.device("cpu")


def mark_ready() -> None:
    """Ranks 1..N-1: this rank has built its model and waits for steps."""
    assert _STORE is not None
    _STORE.set(_stage_key("ready", _RANK), b"")


def wait_ranks_ready(failed: Callable[[], str | None] | None = None) -> None:
    """Rank 0: return once every other rank has marked itself ready."""
    assert _STORE is not None
    _arrive_and_wait(
        _STORE, "ready", None, range(1, _GROUP_SIZE), "tensor-parallel ranks ready", failed
    )


# A step message: this header (magic, version, payload length, payload tag, header tag),
# then the payload. Both tags are HMACs under the secret that bind the step number, so a
# message can be neither forged nor replayed at another step.
_MAGIC = b"PFTP"
_VERSION = 1
_HEADER = struct.Struct(">4sHQ32s32s")
HEADER_SIZE = _HEADER.size


def _payload_tag(secret: bytes, step: int, payload: bytes) -> bytes:
    return _mac(secret, b"step-payload\0", struct.pack(">Q", step), payload)


def _header_tag(secret: bytes, step: int, length: int, payload_tag: bytes) -> bytes:
    fields = struct.pack(">4sHQQ", _MAGIC, _VERSION, step, length)
    return _mac(secret, b"step-header\0", fields, payload_tag)


def _refused(step: int, what: str) -> StepAuthenticationError:
    return StepAuthenticationError(
        f"tensor-parallel step {step}: {what} failed its HMAC check (forged, tampered with "
        "or replayed); refused, nothing of it decoded or run"
    )


def seal_step(payload: bytes, secret: bytes, step: int) -> bytes:
    """Step `step`'s message: its authenticated header, then `payload`."""
    payload_tag = _payload_tag(secret, step, payload)
    header_tag = _header_tag(secret, step, len(payload), payload_tag)
    return _HEADER.pack(_MAGIC, _VERSION, len(payload), payload_tag, header_tag) + payload


def check_header(header: bytes, secret: bytes, step: int) -> tuple[int, bytes]:
    """The payload length and tag of step `step`'s message, once its header is authentic.

    Checked before the payload is received, so a forged length allocates nothing.
    """
    if len(header) != HEADER_SIZE:
        raise _refused(step, "the message header")
    magic, version, length, payload_tag, header_tag = _HEADER.unpack(header)
    expected = _header_tag(secret, step, length, payload_tag)
    if not hmac.compare_digest(header_tag, expected) or (magic, version) != (_MAGIC, _VERSION):
        raise _refused(step, "the message header")
    return length, payload_tag


def check_payload(payload: bytes, payload_tag: bytes, secret: bytes, step: int) -> bytes:
    """`payload`, once it matches the tag its authenticated header announced."""
    if not hmac.compare_digest(payload_tag, _payload_tag(secret, step, payload)):
        raise _refused(step, "the message payload")
    return payload


def open_step(message: bytes, secret: bytes, step: int) -> bytes:
    """The payload of step `step`'s whole message (header and payload), once authentic."""
    length, payload_tag = check_header(message[:HEADER_SIZE], secret, step)
    payload = message[HEADER_SIZE:]
    if len(payload) != length:
        raise _refused(step, "the message length")
    return check_payload(payload, payload_tag, secret, step)


def _broadcast_bytes(data: bytes | None, size: int) -> bytes:
    """Rank 0's `data` (`size` bytes), on every rank, as a uint8 tensor broadcast."""
    if size == 0:
        return b""
    if _RANK == 0:
        assert data is not None and len(data) == size
        box = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    else:
        box = torch.empty(size, dtype=torch.uint8)
    box = box.to(_COMM_DEVICE)
    dist.broadcast(box, src=0)
    return data if data is not None else box.cpu().numpy().tobytes()


def post_step(payload: bytes) -> None:
    """Rank 0: announce step n on the store, then broadcast its message (the codec's bytes)."""
    global _STEP
    assert _STORE is not None
    _STEP += 1
    _STORE.set(f"pagefleet/step/{_STEP}", b"")
    if _STEP > 1:
        # Every rank has passed step n-1's announcement: rank 0 finished step n-1, whose
        # forward pass all-reduces with every rank. Deleting it keeps the store small.
        _STORE.delete_key(f"pagefleet/step/{_STEP - 1}")
    message = seal_step(payload, _SECRET, _STEP)
    _broadcast_bytes(message[:HEADER_SIZE], HEADER_SIZE)
    _broadcast_bytes(message[HEADER_SIZE:], len(payload))


def next_step() -> bytes:
    """Ranks 1..N-1: wait (without a deadline) for rank 0's next step; its authentic payload.

    Raises `StepAuthenticationError` for a message that fails its HMAC checks.
    """
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
    length, payload_tag = check_header(_broadcast_bytes(None, HEADER_SIZE), _SECRET, _STEP)
    return check_payload(_broadcast_bytes(None, length), payload_tag, _SECRET, _STEP)


def destroy_tp() -> None:
    global _GROUP_SIZE, _RANK, _STORE, _SECRET, _STEP, _COMM_DEVICE
    if dist.is_initialized():
        dist.destroy_process_group()
    _GROUP_SIZE, _RANK, _STORE, _SECRET, _STEP = 1, 0, None, b"", 0
    _COMM_DEVICE = torch.device("cpu")


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
