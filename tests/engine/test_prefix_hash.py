"""Prefix hashes: salted per model, stable across processes, whole-chain checks, the digest."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from pagefleet.engine.block_manager import BlockManager
from pagefleet.engine.prefix_hash import (
    DigestView,
    PrefixDigest,
    _positions_of,
    block_hashes,
    chain_hash,
    prefix_hash_salt,
)
from tests.engine.test_prefix_caching import admit, seq


def test_hashes_are_chained_over_full_blocks_only() -> None:
    salt = prefix_hash_salt("m", 4)
    hs = block_hashes(list(range(10)), 4, salt)
    assert len(hs) == 2  # 10 tokens: two full blocks, the partial one has no hash
    assert hs[0] == chain_hash(salt, [0, 1, 2, 3])
    assert hs[1] == chain_hash(hs[0], [4, 5, 6, 7])
    # Extending from a computed prefix gives the same result.
    assert block_hashes(list(range(12)), 4, salt, hs) == block_hashes(list(range(12)), 4, salt)
    # The same block after a different first block has a different hash.
    assert block_hashes([9, 1, 2, 3, 4, 5, 6, 7], 4, salt)[1] != hs[1]


def test_salt_depends_on_model_and_block_size() -> None:
    salts = {prefix_hash_salt(m, bs) for m in ("a", "b") for bs in (4, 8)}
    assert len(salts) == 4
    assert prefix_hash_salt("a", 4) == prefix_hash_salt("a", 4)
    with pytest.raises(ValueError):
        prefix_hash_salt("a", 0)


_CHILD = (
    "from pagefleet.engine.prefix_hash import block_hashes, prefix_hash_salt\n"
    "print(block_hashes(list(range(40)), 16, prefix_hash_salt('models/x', 16)))\n"
)


def test_same_salt_gives_equal_hashes_across_processes() -> None:
    # Python's str hash is randomized per process; ours must not be.
    outs = {
        subprocess.run(
            [sys.executable, "-c", _CHILD],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed},
        ).stdout
        for seed in ("1", "2")
    }
    here = str(block_hashes(list(range(40)), 16, prefix_hash_salt("models/x", 16)))
    assert outs == {here + "\n"}


def test_different_salt_never_hits_across_models() -> None:
    a = BlockManager(8, 4, hash_salt=prefix_hash_salt("model-a", 4))
    b = BlockManager(8, 4, hash_salt=prefix_hash_salt("model-b", 4))
    tokens = list(range(9))
    admit(a, seq("a", tokens))
    admit(b, seq("b", tokens))
    assert a.num_cached_blocks == b.num_cached_blocks == 2
    assert a.cached_block_hashes().isdisjoint(b.cached_block_hashes())
    # The router's view: model-b's prompt hashes are not in model-a's digest.
    view_a = DigestView(a.prefix_digest())
    assert [h in view_a for h in block_hashes(tokens, 4, a.hash_salt)] == [True, True]
    assert [h in view_a for h in block_hashes(tokens, 4, b.hash_salt)] == [False, False]


def test_block_manager_hashes_are_the_shared_function() -> None:
    bm = BlockManager(8, 4, hash_salt=123)
    s = seq("s", list(range(10)))
    assert bm.block_hashes(s) == block_hashes(list(range(10)), 4, 123)
    assert BlockManager(8, 4).hash_salt == prefix_hash_salt("", 4)  # the default salt


def test_hit_requires_the_whole_chain_not_only_the_blocks_tokens() -> None:
    """A block found by hash whose tokens match is still refused unless its cached
    parent is the block accepted just before it (forged here: a hash collision)."""
    bm = BlockManager(8, 2)
    a = seq("a", [1, 2, 3, 4, 5])  # blocks 0 [1 2], 1 [3 4]
    d = seq("d", [9, 9, 7])  # block 3 [9 9]
    admit(bm, a)
    admit(bm, d)
    assert d.block_table[0] == 3
    bm.free(a)
    bm.free(d)
    b = seq("b", [9, 9, 3, 4, 5])  # first block is d's, second has a's second block's tokens
    hb, ha = bm.block_hashes(b), bm.block_hashes(a)
    # Forge a collision: b's second hash names a's second block (tokens [3 4], but
    # computed after [1 2], not after [9 9]).
    del bm._cached[ha[1]]
    bm.digest.remove(ha[1])
    bm._cached[hb[1]] = 1
    bm._hash_of[1] = hb[1]
    bm.digest.add(hb[1])
    bm.check_accounting()
    # Checking only the block's own tokens would accept [3, 1]; the chain check stops at 3.
    assert bm.cached_prefix(b) == [3]


def test_hit_requires_the_blocks_own_tokens() -> None:
    """A block found by hash and chained right is still refused if its tokens are not the
    prompt's (a forged collision): the hits stop before it, and later blocks go with it."""
    bm = BlockManager(8, 2)
    a = seq("a", [1, 2, 3, 4, 5, 6, 7])  # blocks 0 [1 2], 1 [3 4], 2 [5 6]
    admit(bm, a)
    bm.free(a)
    again = seq("again", [1, 2, 3, 4, 5, 6, 7])
    assert bm.cached_prefix(again) == [0, 1, 2]
    bm._tokens_of[1] = (3, 9)  # block 1's hash now names other tokens
    assert bm.cached_prefix(again) == [0]
    bm._tokens_of[1] = (3, 4)
    bm._tokens_of[0] = (1, 9)
    assert bm.cached_prefix(again) == []


def test_eviction_uncaches_the_descendants_and_the_digest_follows() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    a = seq("a", [1, 2, 3, 4, 5, 6, 7])  # three full blocks 0 1 2, partial 3
    admit(bm, a)
    assert bm.num_cached_blocks == 3 and len(bm.digest) == 3
    bm.free(a)
    assert bm.free_block_ids() == [3, 2, 1, 0]
    # Revive the root alone through a prefix hit and free it again: it moves to the back.
    r = seq("r", [1, 2, 9])
    assert admit(bm, r) == [0]
    bm.free(r)  # r took block 3 for its partial block
    assert bm.free_block_ids() == [2, 1, 3, 0]
    # x takes all four: the children 2 and 1 go first, the root 0 last.
    x = seq("x", [8] * 7)
    admit(bm, x)
    assert x.block_table == [2, 1, 3, 0]
    # x's blocks replaced a's chain: none of a's hashes remain, in the cache or digest.
    a_hashes = block_hashes([1, 2, 3, 4, 5, 6, 7], 2, bm.hash_salt)
    view = DigestView(bm.prefix_digest())
    assert not set(a_hashes) & set(bm._cached)
    assert [h in view for h in a_hashes] == [False, False, False]
    bm.check_accounting()


def test_evicting_a_parent_uncaches_its_cached_children() -> None:
    """Whoever holds a block holds its chain, and frees go tail first, so a parent
    normally outlives its children in the free list; if it is evicted first anyway,
    the children go with it (no unreachable hash stays in the cache or digest)."""
    bm = BlockManager(num_blocks=4, block_size=2)
    a = seq("a", [1, 2, 3, 4, 5, 6, 7])  # blocks 0 1 2 chained, 3 partial
    admit(bm, a)
    bm.free(a)
    assert bm.free_block_ids() == [3, 2, 1, 0]
    bm._probation.move_to_end(2)
    bm._probation.move_to_end(1)  # free list: 3 0 2 1: the root goes before its children
    y = seq("y", [9, 9, 9])
    admit(bm, y)
    assert y.block_table == [3, 0]
    assert bm.num_cached_blocks == len(bm.digest) == 1  # only y's own full block
    view = DigestView(bm.prefix_digest())
    assert [h in view for h in block_hashes(a.token_ids, 2, bm.hash_salt)] == [False] * 3
    assert bm.cached_prefix(seq("again", [1, 2, 3, 4, 5])) == []
    bm.check_accounting()


def test_a_branching_chain_keeps_its_children_and_loses_them_all_with_the_parent() -> None:
    """A block's cached children grow as prompts branch off it; an evicted child leaves
    them, and an evicted parent takes every child left with it."""
    bm = BlockManager(num_blocks=8, block_size=2)
    a, b, c = seq("a", [1, 2, 3, 4, 5]), seq("b", [1, 2, 7, 8, 9]), seq("c", [1, 2, 6, 6, 9])
    admit(bm, a)
    assert a.block_table == [0, 1, 2] and bm._children == {0: {1}}
    assert admit(bm, b) == [0] and b.block_table == [0, 3, 4]
    assert bm._children == {0: {1, 3}}
    admit(bm, c)
    assert c.block_table == [0, 5, 6] and bm._children == {0: {1, 3, 5}}
    for s in (a, b, c):
        bm.free(s)
    bm._probation.move_to_end(3, last=False)  # b's second block goes first
    evicted: list[int] = []
    assert bm._take_free(evicted) == 3 and bm._children == {0: {1, 5}}
    bm._probation.move_to_end(0, last=False)  # then the root: a's and c's go with it
    assert bm._take_free(evicted) == 0 and bm._children == {}
    bm.digest.remove_many(evicted)  # as `allocate` does with what `_take_free` evicts
    assert bm.num_cached_blocks == len(bm.digest) == 0 and len(evicted) == 4


def test_duplicate_block_starts_no_chain() -> None:
    bm = BlockManager(num_blocks=8, block_size=2)
    a, b = seq("a", [1, 2, 3, 4, 5]), seq("b", [1, 2, 3, 4, 5])
    # Both admitted before either is computed: no hits, each computes its own copy.
    for s in (a, b):
        assert bm.cached_prefix(s) == []
        assert bm.allocate_prefilled(s, [], s.num_tokens)
    for s in (a, b):
        s.num_computed_tokens = s.num_tokens
        bm.cache_computed_blocks(s)
    # a's chain is cached; b's first block is a duplicate, so b's second is not
    # chained below it (its parent is not the cached holder of the first hash).
    assert sorted(bm._cached.values()) == a.block_table[:2]
    assert bm.cached_prefix(seq("c", [1, 2, 3, 4, 9])) == a.block_table[:2]
    bm.check_accounting()


def test_cached_block_hashes_under_a_limit_prefers_used_blocks() -> None:
    bm = BlockManager(num_blocks=8, block_size=2)
    a = seq("a", [1, 2, 3, 4, 5])
    admit(bm, a)
    bm.free(a)
    b = seq("b", [6, 7, 8, 9, 1])
    admit(bm, b)
    hb = bm.block_hashes(b)
    assert bm.cached_block_hashes(limit=2) == frozenset(hb)
    assert len(bm.cached_block_hashes()) == 4


def test_digest_add_remove_and_serialization() -> None:
    d = PrefixDigest(num_bits=1024, num_probes=3)
    hs = block_hashes(list(range(64)), 4, prefix_hash_salt("m", 4))
    for h in hs:
        d.add(h)
    view = DigestView(d.to_bytes())
    assert all(h in view for h in hs) and all(h in d for h in hs)
    assert len(d.to_bytes()) == 2 + 1024 // 8
    for h in hs[:8]:
        d.remove(h)
    view = DigestView(d.to_bytes())
    assert all(h in view for h in hs[8:])
    # 16 hashes in 1024 bits with 3 probes: a removed hash reads absent unless a
    # remaining one shares all its bits; these do not.
    assert [h in view for h in hs[:8]] == [False] * 8
    assert len(d) == 8
    with pytest.raises(ValueError):
        PrefixDigest(num_bits=1000)
    with pytest.raises(ValueError):
        DigestView(b"\x09\x03" + bytes(16))  # unknown version
    assert PrefixDigest.bits_for(10) == 8 * 1024
    assert PrefixDigest.bits_for(10_000) == 1 << 18
    assert PrefixDigest.bits_for(10**7) == 1 << 21


class _OneAtATime:
    """A counting Bloom filter updated one hash at a time: the counts and bits that
    `PrefixDigest`'s logged batches must equal (counters saturate at 255 and stay)."""

    def __init__(self, num_bits: int, num_probes: int = 4) -> None:
        self.num_bits, self.num_probes = num_bits, num_probes
        self.counts, self.bits = bytearray(num_bits), bytearray(num_bits // 8)

    def _probes(self, h: int) -> list[int]:
        lo, hi, mask = h & 0xFFFFFFFF, (h >> 32) | 1, self.num_bits - 1
        return [(lo + i * hi) & mask for i in range(self.num_probes)]

    def add(self, h: int) -> None:
        for p in self._probes(h):
            if self.counts[p] == 0:
                self.bits[p >> 3] |= 1 << (p & 7)
            self.counts[p] = min(255, self.counts[p] + 1)

    def remove(self, h: int) -> None:
        for p in self._probes(h):
            c = self.counts[p]
            assert c > 0, "removed a hash never added"
            if c < 255:
                self.counts[p] = c - 1
                if c == 1:
                    self.bits[p >> 3] &= ~(1 << (p & 7)) & 0xFF

    def state(self) -> tuple[bytes, bytes]:
        return bytes(self.counts), bytes(self.bits)


def _state(d: PrefixDigest) -> tuple[bytes, bytes]:
    return d.counts(), d.to_bytes()[2:]  # the bitset without its header


def test_batch_updates_leave_exactly_the_one_at_a_time_counts_and_bits() -> None:
    rng = random.Random(7)
    # 64 counters for 1,440 probes of 360 hashes (one repeated 300 times): counters collide,
    # and the repeated hash's saturate, so both the counting and the cap are exercised.
    hs = [rng.getrandbits(64) for _ in range(60)] + [12345] * 300
    rng.shuffle(hs)
    one, batch = _OneAtATime(64), PrefixDigest(num_bits=64, num_probes=4)
    for h in hs:
        one.add(h)
    batch.add_many(hs)
    assert _state(batch) == one.state()
    assert max(one.counts) == 255  # the repeated hash's counters saturated
    gone = hs[:50]
    for h in gone:
        one.remove(h)
    batch.remove_many(gone)
    assert _state(batch) == one.state() and len(batch) == 310
    for h in hs[50:55]:  # one at a time: logged the same
        one.remove(h)
        batch.remove(h)
    assert _state(batch) == one.state()
    fresh = PrefixDigest(num_bits=1024, num_probes=3)
    fresh.remove_many([rng.getrandbits(64) for _ in range(20)])
    with pytest.raises(ValueError, match="not in the digest"):
        fresh.to_bytes()  # the log is applied when the digest is read
    # A large filter: no two probes share a counter (the path that skips the counting).
    wide = [rng.getrandbits(64) for _ in range(100)]
    one, batch = _OneAtATime(1 << 20), PrefixDigest(num_bits=1 << 20)
    for h in wide:
        one.add(h)
    batch.add_many(wide)
    assert _state(batch) == one.state() and max(one.counts) == 1
    for h in wide[:60]:
        one.remove(h)
    batch.remove_many(wide[:60])
    assert _state(batch) == one.state()


def test_probe_positions_are_the_double_hashing_of_each_hash_at_every_size() -> None:
    rng = random.Random(9)
    hs = [rng.getrandbits(64) for _ in range(200)] + [0, 2**64 - 1, 2**63, 2**32 - 1]
    for num_bits in (8, 1 << 12, 1 << 21, 1 << 32, 1 << 33, 1 << 40):
        for probes in (1, 4, 16):
            want = [
                [((h & 0xFFFFFFFF) + i * ((h >> 32) | 1)) & (num_bits - 1) for h in hs]
                for i in range(probes)
            ]
            assert _positions_of(hs, num_bits, probes).tolist() == want


def _call_both(
    one: _OneAtATime, lazy: PrefixDigest, adding: bool, hashes: list[int], singly: bool = False
) -> None:
    """Add (or remove) `hashes` in both: in the digest as one run, or one hash at a time."""
    for h in hashes:
        (one.add if adding else one.remove)(h)
    if singly:
        for h in hashes:
            (lazy.add if adding else lazy.remove)(h)
    else:
        (lazy.add_many if adding else lazy.remove_many)(hashes)


def test_a_log_of_interleaved_calls_leaves_the_counts_and_bits_of_applying_them_in_order() -> None:
    """Adds and removes logged between two reads are applied at the read: all the adds
    then all the removes when no counter can saturate, the calls in order when one can."""
    rng = random.Random(11)
    pool = [rng.getrandbits(64) for _ in range(300)]
    one, lazy = _OneAtATime(1 << 11), PrefixDigest(num_bits=1 << 11)
    held: list[int] = []
    for step in range(40):
        if held and step % 3 == 2:  # remove some held hashes
            gone = [held.pop(rng.randrange(len(held))) for _ in range(min(len(held), 20))]
            _call_both(one, lazy, False, gone, singly=bool(step % 2))
        else:
            new = [pool.pop() for _ in range(rng.choice([1, 5, 30]))]
            held += new
            _call_both(one, lazy, True, new, singly=bool(step % 2))
        if step % 7 == 6:  # a read applies the log; the next calls start a new one
            assert _state(lazy) == one.state()
    assert _state(lazy) == one.state() and len(lazy) == len(held)
    assert all(h in lazy for h in held)
    # A saturated counter (the same hash 300 times): the log is replayed in order.
    one, lazy = _OneAtATime(64), PrefixDigest(num_bits=64)
    for h in [777] * 300:
        one.add(h)
    lazy.add_many([777] * 300)
    assert _state(lazy) == one.state() and max(one.counts) == 255
    calls = [(True, pool[:20]), (False, [777] * 3 + pool[:5]), (True, [777] * 2 + pool[20:40])]
    for adding, hashes in calls:
        _call_both(one, lazy, adding, hashes)
    assert _state(lazy) == one.state()
    lazy = PrefixDigest(num_bits=1 << 12)
    lazy.add_many(list(range(1, 40)))
    lazy.remove_many(list(range(1, 41)))  # 40 was never added
    with pytest.raises(ValueError, match="not in the digest"):
        lazy.to_bytes()


def _walk(view: DigestView, hashes: tuple[int, ...], limit: int) -> int:
    n = 0
    for h in hashes[:limit]:
        if h not in view:
            break
        n += 1
    return n


def test_leading_run_is_exactly_the_walk_to_the_first_miss() -> None:
    rng = random.Random(3)
    salt = prefix_hash_salt("m", 4)
    # Prompts over three shared prefixes, cut at random lengths, with private tails:
    # runs end anywhere, and both the loop (under 16 blocks) and the array test serve.
    bases = [[rng.randrange(1000) for _ in range(200)] for _ in range(3)]
    prompts = [
        tuple(
            block_hashes(
                b[: rng.randrange(4, 200)] + [rng.randrange(1000) for _ in range(12)], 4, salt
            )
        )
        for b in bases
        for _ in range(30)
    ]
    d = PrefixDigest(num_bits=1 << 14, num_probes=4)
    for p in prompts[::7]:  # some prompts cached whole, so runs end anywhere
        d.add_many([h for h in dict.fromkeys(p)])
    view = DigestView(d.to_bytes())
    fresh = DigestView(d.to_bytes())
    order = prompts * 2
    rng.shuffle(order)
    for p in order:
        limit = rng.choice([len(p), len(p) - 1, rng.randrange(0, len(p) + 2)])
        assert view.leading_run(p, limit) == _walk(fresh, p, limit)
        # A list (not cached by identity) and an equal tuple that is another object.
        assert view.leading_run(list(p), limit) == view.leading_run(tuple(list(p)), limit)
        assert view.leading_run(list(p), limit) == _walk(fresh, p, limit)
    assert view.leading_run((), 5) == 0
