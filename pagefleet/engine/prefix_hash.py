"""Prefix-cache block hashes shared by the block manager and the fleet router.

One pure function, `block_hashes`, names every full block of a token
sequence by a chained hash: block i's hash covers block i's token ids and
block i-1's hash, and the chain starts from a salt derived from the model's
identity and the block size. So

- equal hashes mean equal whole prefixes (up to a 64-bit collision, which the
  block manager still guards against by checking what it stores), and a
  router holding only token ids can name the blocks a replica caches;
- the results are plain ints computed with blake2b over an explicit byte
  layout, identical in every process and on every machine (Python's own
  `hash()` of str is randomized per process, so it cannot cross the
  router/replica boundary);
- two models, or one model at two block sizes, never share a block hash,
  since their chains start from different salts;
- a request's `cache_salt` (vLLM's request field) roots its chain at
  `salted(salt, cache_salt)`: salted prompts share blocks only with prompts of
  the same salt, and never with unsalted ones, so one tenant's prompts cannot
  be probed through another's prefix hits.

`PrefixDigest` is a compact, bounded summary of a set of block hashes (a
Bloom filter with counters, so blocks can also be removed) that a replica
reports to the router instead of the full set; `DigestView` reads it back.
A false positive only makes the router expect a prefix hit that is not
there; there are no false negatives.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import numpy as np

# Bumping this changes every hash, so replicas and routers of different
# layouts never believe they share blocks.
_LAYOUT = b"pagefleet-prefix-v1"
_MASK64 = (1 << 64) - 1


def prefix_hash_salt(model: str, block_size: int) -> int:
    """The root of every hash chain for `model` at `block_size` (a 64-bit int).

    `model` is the model's identity as the whole fleet spells it (the
    deployment's configured model, e.g. `EngineConfig.model`): replicas and
    routers that pass the same string agree; different models never match.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    h = hashlib.blake2b(digest_size=8, person=b"pf-salt")
    h.update(_LAYOUT + b"\0" + model.encode("utf-8") + b"\0" + str(block_size).encode())
    return int.from_bytes(h.digest(), "little")


def salted(salt: int, cache_salt: str | None) -> int:
    """The root of a request's chains: `salt`, mixed with its `cache_salt` if it has one."""
    if cache_salt is None:
        return salt
    h = hashlib.blake2b(digest_size=8, person=b"pf-cache-salt")
    h.update((salt & _MASK64).to_bytes(8, "little") + cache_salt.encode("utf-8", "surrogatepass"))
    return int.from_bytes(h.digest(), "little")


def chain_hash(parent: int, tokens: Sequence[int]) -> int:
    """Hash of one block: its parent's hash (or the salt) and its token ids."""
    return _chain(parent, _pack_tokens(tokens))


def _pack_tokens(tokens: Sequence[int]) -> bytes:
    # u32 little-endian per token: an explicit layout, the same on every machine
    # (token ids are vocabulary indices, < 2**32).
    return struct.pack(f"<{len(tokens)}I", *tokens)


# Every block hash starts from a copy of this (a copy costs less than a new hasher: no
# parameters to parse).
_EMPTY_BLAKE2B = hashlib.blake2b(digest_size=8)


def _chain(parent: int, packed_block: bytes | memoryview) -> int:
    """The hash of a block given as `_pack_tokens` bytes, after its parent's (a u64)."""
    h = _EMPTY_BLAKE2B.copy()
    h.update((parent & _MASK64).to_bytes(8, "little"))
    h.update(packed_block)
    return int.from_bytes(h.digest(), "little")


def block_hashes(
    token_ids: Sequence[int], block_size: int, salt: int, start: Sequence[int] = ()
) -> list[int]:
    """Chained hashes of every full block of `token_ids` (a trailing partial block has none).

    `start` is an already computed prefix of the result (e.g. a sequence's
    hashes so far); only the blocks after it are hashed, so a growing
    sequence costs one hash per new block.
    """
    out = list(start)
    extend_block_hashes(out, token_ids, block_size, salt)
    return out


def extend_block_hashes(
    hashes: list[int], token_ids: Sequence[int], block_size: int, salt: int
) -> None:
    """`hashes[:] = block_hashes(token_ids, block_size, salt, hashes)`, in place: appends
    the hashes of the full blocks after those `hashes` already has. A decoding sequence
    gains a block every `block_size` tokens; a copy of its hundreds of hashes each time
    cost more than the new one's hash."""
    first, full = len(hashes), len(token_ids) // block_size
    if first >= full:
        return
    # The tokens packed once for every block, not once a block: `chain_hash`'s bytes.
    packed = memoryview(_pack_tokens(token_ids[first * block_size : full * block_size]))
    width = 4 * block_size
    parent = hashes[-1] if hashes else salt
    append = hashes.append
    for j in range(0, (full - first) * width, width):
        parent = _chain(parent, packed[j : j + width])
        append(parent)


# -- digest ----------------------------------------------------------------------

_DIGEST_VERSION = 1
# `DigestView.leading_run` tests fewer blocks than this one at a time (array calls cost more).
_BATCH_MIN = 16
# `PrefixDigest` applies its log once it holds this many hashes, unread (bounds its memory).
_LOG_MAX = 1 << 14
# A prompt's probes as (byte index, bit mask) arrays (`_probe_positions`).
_Probes = tuple[np.ndarray, np.ndarray]
_HEADER = struct.Struct("<BB")  # version, number of probes per hash


# A digest's add / remove calls, in order: runs of adds (True) or removes (False), each
# run's hashes in one list owned by the log.
DigestLog = list[tuple[bool, list[int]]]


class DigestCalls:
    """A digest's add / remove calls, logged in order (`DigestLog`), and how many hashes
    they leave held. `PrefixDigest` applies its log when read; another holder may ship
    it to a digest kept elsewhere (`replay` there)."""

    def __init__(self) -> None:
        self._log: DigestLog = []
        self._len = 0  # hashes held, the log's included

    def __len__(self) -> int:
        return self._len

    def add(self, h: int) -> None:
        self._record(True, (h,))

    def remove(self, h: int) -> None:
        """Remove a hash previously added (removing one never added corrupts the filter)."""
        self._record(False, (h,))

    def add_many(self, hashes: Sequence[int]) -> None:
        """`add` each of `hashes`."""
        self._record(True, hashes)

    def remove_many(self, hashes: Sequence[int]) -> None:
        """`remove` each of `hashes`."""
        self._record(False, hashes)

    def replay(self, log: DigestLog) -> None:
        """Make the calls `log` holds, in order."""
        for adding, hashes in log:
            self._record(adding, hashes)

    def _record(self, adding: bool, hashes: Sequence[int]) -> None:
        if not hashes:
            return
        log = self._log
        if log and log[-1][0] is adding:
            log[-1][1].extend(hashes)
        else:
            log.append((adding, list(hashes)))
        self._len += len(hashes) if adding else -len(hashes)


class PrefixDigest(DigestCalls):
    """A counting Bloom filter over block hashes, updated lazily.

    Why lazily: a replica registers and evicts hundreds of blocks per admitted prompt,
    and a router reads the filter only with a replica's report (every few seconds).
    So `add` / `remove` (and their batch forms) only log the hashes, and the log is
    applied when the filter is read (`to_bytes`, `in`), or when it grows past
    `_LOG_MAX` hashes, in a few array operations over the whole log. The counts and
    bits are then exactly those of applying each call one at a time, in order (when no
    counter can saturate, as it never does at ~16 bits per block, the net change per
    counter is that; otherwise the log is replayed in order). `to_bytes` copies the
    bitset (num_bits / 8 bytes), independent of how many blocks are cached. Counters
    saturate at 255 and then stay (the bit can no longer clear), which only adds false
    positives. Removing a hash that was never added corrupts the filter; it is caught
    (ValueError) when the log is applied, unless an add of the same hash in that log
    hides it.
    """

    def __init__(self, num_bits: int = 1 << 16, num_probes: int = 4) -> None:
        if num_bits < 8 or num_bits & (num_bits - 1):
            raise ValueError(f"num_bits must be a power of two >= 8, got {num_bits}")
        if not 1 <= num_probes <= 16:
            raise ValueError(f"num_probes must be in [1, 16], got {num_probes}")
        self.num_bits = num_bits
        self.num_probes = num_probes
        self._counts = bytearray(num_bits)
        self._bits = bytearray(num_bits // 8)
        # The same bytes as arrays, for the batch updates.
        self._counts_np = np.frombuffer(self._counts, dtype=np.uint8)
        self._bits_np = np.frombuffer(self._bits, dtype=np.uint8)
        super().__init__()  # the calls not applied yet
        self._logged = 0  # how many hashes they hold

    @staticmethod
    def bits_for(num_blocks: int) -> int:
        """A size for a pool of `num_blocks`: ~16 bits per block (about 0.2% false
        positives with 4 probes when every block is cached), from 1 KiB to 256 KiB."""
        want = max(8 * 1024, 16 * num_blocks)
        return min(1 << 21, 1 << (want - 1).bit_length())

    def _record(self, adding: bool, hashes: Sequence[int]) -> None:
        super()._record(adding, hashes)
        self._logged += len(hashes)
        if self._logged > _LOG_MAX:
            self._apply_log()

    def _apply_log(self) -> None:
        """Apply the logged calls (class docstring). Where no counter can reach 255
        through the adds, counts stay plain integers whatever the order, so all the adds
        and then all the removes, two batches, give what the calls in order give; else
        each run is applied in order."""
        log = self._log
        if not log:
            return
        self._log, self._logged = [], 0
        if len(log) == 1:
            self._apply_run(log[0][0], self._positions(log[0][1]))
            return
        up = self._positions([h for adding, run in log if adding for h in run])
        top = self._counts_np[up[0]].astype(np.int32) + up[1]
        if top.size and int(top.max()) >= 255:  # a counter may saturate: order matters
            for adding, run in log:
                self._apply_run(adding, self._positions(run))
            return
        self._apply_run(True, up)
        self._apply_run(
            False, self._positions([h for adding, run in log if not adding for h in run])
        )

    def _apply_run(self, adding: bool, probed: tuple[np.ndarray, np.ndarray | int]) -> None:
        """Apply `add` (or `remove`) of each of a run's hashes, one at a time in effect,
        from their probes (`_positions`)."""
        pos, k = probed
        counts = self._counts_np
        c = counts[pos].astype(np.int32)
        if adding:
            counts[pos] = np.minimum(c + k, 255)
            self._flip(pos[c == 0], True)
            return
        saturated = c == 255  # has lost count: stays set
        if np.any(~saturated & (c < k)):
            raise ValueError("a hash removed is not in the digest")
        left = np.where(saturated, 255, c - k)
        counts[pos] = left
        self._flip(pos[left == 0], False)

    def _flip(self, pos: np.ndarray, on: bool) -> None:
        """Set (or clear) the bits at `pos` (sorted, distinct): one OR of each byte's bits
        (`reduceat` over the runs of one byte), not a `ufunc.at` a bit."""
        if not pos.size:
            return
        byte = pos >> 3
        starts = np.flatnonzero(np.concatenate(([True], byte[1:] != byte[:-1])))
        masks = np.bitwise_or.reduceat(np.left_shift(1, pos & 7).astype(np.uint8), starts)
        bits, at = self._bits_np, byte[starts]
        bits[at] = (bits[at] | masks) if on else (bits[at] & ~masks)

    def _positions(self, hashes: Sequence[int]) -> tuple[np.ndarray, np.ndarray | int]:
        """The distinct counter positions `hashes` probe, sorted, and how many probes hit
        each (1 for all when no two probes share a position)."""
        pos = np.sort(_positions_of(hashes, self.num_bits, self.num_probes).ravel())
        fresh = pos[1:] != pos[:-1]
        if fresh.all():
            return pos, 1
        starts = np.flatnonzero(np.concatenate(([True], fresh)))  # of each distinct run
        return pos[starts], np.diff(starts, append=len(pos))

    def __contains__(self, h: object) -> bool:
        self._apply_log()
        return isinstance(h, int) and _contains(self._bits, self.num_bits, self.num_probes, h)

    def counts(self) -> bytes:
        """Every counter, one byte each (the log applied first)."""
        self._apply_log()
        return bytes(self._counts)

    def to_bytes(self) -> bytes:
        """The bitset with a small header: what a replica reports (see `DigestView`)."""
        self._apply_log()
        return _HEADER.pack(_DIGEST_VERSION, self.num_probes) + bytes(self._bits)


def _positions_of(hashes: Sequence[int], num_bits: int, num_probes: int) -> np.ndarray:
    """Every probe position of every hash: [num_probes, len(hashes)] int64, probe-major
    (each probe one contiguous row: a [n, 4] array's short rows cost numpy more).

    Double hashing over a hash's two 32-bit halves, probe i at (lo + i * hi) & mask.
    The block hashes are already uniform (blake2b), so no rehash is needed; `num_bits`
    is a power of two, so masking is an exact modulo, and it keeps only bits that the
    halves' low bits decide: the halves are masked first, then summed in int64 (no
    overflow: < 2**33 * num_probes). `_contains` computes the same positions one hash
    at a time.
    """
    h = np.fromiter(hashes, dtype=np.uint64, count=len(hashes)).view(np.int64)  # [n]
    mask = num_bits - 1
    half = min(mask, 0xFFFFFFFF)  # a half's bits that the mask keeps
    # An arithmetic shift of the int64 view: its low 32 bits are the high half's.
    hi = ((h >> 32) | 1) & half
    pos = np.empty((num_probes, len(h)), dtype=np.int64)
    np.bitwise_and(h, half, out=pos[0])  # the low half
    for i in range(1, num_probes):
        np.add(pos[i - 1], hi, out=pos[i])
    pos &= mask
    return pos


def _probe_positions(hashes: Sequence[int], num_bits: int, num_probes: int) -> _Probes:
    """`_positions_of` as (byte index, bit mask) arrays, each [num_probes, len(hashes)]."""
    pos = _positions_of(hashes, num_bits, num_probes)
    return pos >> 3, np.left_shift(1, pos & 7).astype(np.uint8)


def _contains(bits: bytes | bytearray, num_bits: int, num_probes: int, h: int) -> bool:
    # `_positions_of` for one hash, stopping at the first clear bit: the router tests every
    # replica's digest along a prompt.
    lo, hi, mask = h & 0xFFFFFFFF, (h >> 32) | 1, num_bits - 1
    for i in range(num_probes):
        p = (lo + i * hi) & mask
        if not bits[p >> 3] >> (p & 7) & 1:
            return False
    return True


class DigestView:
    """Read-only membership over `PrefixDigest.to_bytes()` (what the router holds)."""

    __slots__ = ("_bits", "_bits_np", "num_bits", "num_probes")

    def __init__(self, data: bytes) -> None:
        if len(data) < _HEADER.size + 1:
            raise ValueError("prefix digest too short")
        version, num_probes = _HEADER.unpack_from(data)
        if version != _DIGEST_VERSION:
            raise ValueError(f"unknown prefix digest version {version}")
        self._bits = bytes(data[_HEADER.size :])
        self.num_bits = len(self._bits) * 8
        self.num_probes = num_probes
        if self.num_bits & (self.num_bits - 1) or not 1 <= num_probes <= 16:
            raise ValueError("malformed prefix digest")
        self._bits_np: np.ndarray | None = None  # the same bytes as an array, made on first use

    def __contains__(self, h: object) -> bool:
        return isinstance(h, int) and _contains(self._bits, self.num_bits, self.num_probes, h)

    def leading_run(self, hashes: Sequence[int], limit: int) -> int:
        """How many of `hashes[:limit]`, from the first, are in the digest: exactly what
        testing them one by one until the first miss gives.

        A router asks this of every replica for every prompt. Most replicas miss the
        first block (one test); the few that hold the prompt hold hundreds of its
        blocks, and those are tested at once, every probe of every block as one
        array gather over the bitset (`_probe_positions`).
        """
        limit = min(limit, len(hashes))
        bits, num_bits, num_probes = self._bits, self.num_bits, self.num_probes
        if limit <= 0 or not _contains(bits, num_bits, num_probes, hashes[0]):
            return 0
        if limit < _BATCH_MIN:
            n = 1
            while n < limit and _contains(bits, num_bits, num_probes, hashes[n]):
                n += 1
            return n
        byte, bit = _probe_positions(hashes, num_bits, num_probes)  # [probes, len(hashes)]
        if self._bits_np is None:
            self._bits_np = np.frombuffer(bits, dtype=np.uint8)
        held = (self._bits_np[byte[:, :limit]] & bit[:, :limit]).all(axis=0)  # [limit]
        misses = np.flatnonzero(~held)
        return int(misses[0]) if misses.size else limit
