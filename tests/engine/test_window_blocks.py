"""Blocks out of every layer's sliding window go back to the pool: exact ids and counts."""

from __future__ import annotations

import pytest

from pagefleet.engine import SamplingParams
from pagefleet.engine.block_manager import BlockManager
from pagefleet.engine.sequence import Sequence


def seq(rid: str, n: int) -> Sequence:
    return Sequence(rid, list(range(100, 100 + n)), SamplingParams())


def computed(bm: BlockManager, s: Sequence, n: int) -> int:
    """Allocate and 'compute' `s` up to n tokens, as the scheduler's step and update do."""
    assert bm.allocate(s, n, [])
    s.num_computed_tokens = n
    bm.cache_computed_blocks(s)
    return bm.free_out_of_window(s)


def test_blocks_wholly_before_the_next_querys_window_are_freed() -> None:
    # Window 6, blocks of 4: the query at position p reads p - 5 .. p.
    bm = BlockManager(num_blocks=10, block_size=4, sliding_window=6, enable_prefix_caching=False)
    s = seq("s", 20)
    assert computed(bm, s, 8) == 0  # the next query, at 8, reads 3..8: block 0 (0..3) too
    assert computed(bm, s, 9) == 1  # at 9 it reads 4..9: block 0 is read by no one
    assert s.num_freed_blocks == 1 and bm.num_used_blocks == 2
    assert bm.free_out_of_window(s) == 0  # nothing more until the query moves
    assert computed(bm, s, 12) == 0  # p = 12 reads 7..12: block 1 (4..7) still read
    assert computed(bm, s, 13) == 1  # p = 13 reads 8..13
    assert s.num_freed_blocks == 2 and len(s.block_table) == 4
    assert bm.num_used_blocks == 2
    bm.check_accounting()
    bm.free(s)
    assert bm.num_free_blocks == 10 and s.num_freed_blocks == 0
    bm.check_accounting()


def test_a_sequence_holds_at_most_window_blocks_plus_one() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, sliding_window=8, enable_prefix_caching=False)
    s = seq("s", 400)
    for n in range(1, 401):
        computed(bm, s, n)
        assert bm.num_used_blocks <= -(-8 // 4) + 1
        bm.check_accounting()
    assert len(s.block_table) == 100
    bm.free(s)
    assert bm.num_free_blocks == 8
    bm.check_accounting()


def test_without_a_window_nothing_is_freed() -> None:
    bm = BlockManager(num_blocks=10, block_size=4)
    s = seq("s", 30)
    assert computed(bm, s, 30) == 0 and bm.num_used_blocks == 8


def test_freed_blocks_drop_their_hashes_and_their_descendants() -> None:
    """A prefix chain through a block freed out of a window can no longer be hit: its
    hash and its cached descendants' leave the cache and the digest; blocks still in
    the window stay held and in use."""
    bm = BlockManager(num_blocks=12, block_size=4, sliding_window=6)
    s = seq("s", 16)
    assert computed(bm, s, 8) == 0
    assert bm.num_cached_blocks == 2 and len(bm.digest) == 2
    other = seq("o", 16)  # the same prompt: its first two blocks are cached
    assert bm.cached_prefix(other) == s.block_table[:2]
    assert computed(bm, s, 12) == 1  # block 0 out of the window: the chain is gone
    assert bm.num_cached_blocks == 0 and len(bm.digest) == 0
    assert bm.cached_prefix(other) == []
    assert bm.num_used_blocks == 2
    bm.check_accounting()
    bm.free(s)
    bm.check_accounting()
    assert bm.num_free_blocks == 12


def test_a_shared_prefix_is_released_by_each_holder_once() -> None:
    bm = BlockManager(num_blocks=12, block_size=4, sliding_window=6)
    a = seq("a", 12)
    computed(bm, a, 8)
    b = seq("b", 12)
    hit = bm.cached_prefix(b)
    assert hit == a.block_table[:2]
    assert bm.allocate_prefilled(b, hit, 12)
    b.num_computed_tokens = 8
    assert bm.ref_count(hit[0]) == 2
    assert computed(bm, a, 12) == 1
    assert bm.ref_count(hit[0]) == 1  # b still reads it (its window has not moved)
    assert computed(bm, b, 12) == 1
    assert bm.ref_count(hit[0]) == 0 and hit[0] in bm.free_block_ids()
    for s in (a, b):
        bm.free(s)
    assert bm.num_free_blocks == 12
    bm.check_accounting()


def test_fork_shares_only_the_held_blocks() -> None:
    bm = BlockManager(num_blocks=12, block_size=4, sliding_window=6, enable_prefix_caching=False)
    parent = seq("p", 16)
    computed(bm, parent, 13)
    assert parent.num_freed_blocks == 2
    child = Sequence("p", parent.prompt_token_ids, SamplingParams(), index=1)
    bm.fork(parent, child)
    assert child.num_freed_blocks == 2
    assert [bm.ref_count(b) for b in parent.block_table] == [0, 0, 2, 2]
    bm.free(parent)
    bm.free(child)
    assert bm.num_free_blocks == 12
    bm.check_accounting()


def test_the_window_must_be_positive() -> None:
    with pytest.raises(ValueError, match="sliding_window"):
        BlockManager(num_blocks=4, block_size=4, sliding_window=0)


def test_a_sequence_never_holds_more_than_blocks_to_hold() -> None:
    bm = BlockManager(num_blocks=40, block_size=4, sliding_window=10, enable_prefix_caching=False)
    assert [bm.blocks_to_hold(n) for n in (1, 4, 5, 12, 13, 16, 17, 1000)] == [
        1,
        1,
        2,
        3,
        4,
        4,
        4,
        4,
    ]
    s = seq("s", 1)
    for n in range(1, 300):
        assert bm.allocate(s, n, [])  # the step's allocation comes before the update's free
        assert len(s.block_table) - s.num_freed_blocks <= bm.blocks_to_hold(n)
        s.num_computed_tokens = n
        bm.free_out_of_window(s)
    assert BlockManager(num_blocks=4, block_size=4).blocks_to_hold(1000) == 250
