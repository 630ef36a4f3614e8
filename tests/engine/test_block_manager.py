"""BlockManager: exact block ids, free counts and ref counts."""

from __future__ import annotations

import pytest

from pagefleet.engine import SamplingParams
from pagefleet.engine.block_manager import BlockManager
from pagefleet.engine.sequence import Sequence
from tests.engine.test_prefix_caching import run


def seq(rid: str, n: int = 1) -> Sequence:
    return Sequence(rid, list(range(n)), SamplingParams())


def test_allocates_ceil_blocks_from_the_front_of_the_free_list() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = seq("a"), seq("b")
    assert bm.allocate(a, 5, [])  # 2 blocks
    assert bm.allocate(b, 4, [])  # exactly 1 block
    assert a.block_table == [0, 1]
    assert b.block_table == [2]
    assert bm.num_free_blocks == 5 and bm.num_used_blocks == 3
    assert [bm.ref_count(i) for i in range(8)] == [1, 1, 1, 0, 0, 0, 0, 0]
    bm.check_accounting()


def test_appends_a_block_only_when_the_last_is_full() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    s = seq("s")
    assert bm.allocate(s, 1, []) and s.block_table == [0]
    for n in (2, 3, 4):
        assert bm.allocate(s, n, []) and s.block_table == [0]
    assert bm.allocate(s, 5, []) and s.block_table == [0, 1]
    assert bm.blocks_needed(s, 9) == 1
    assert bm.blocks_needed(s, 8) == 0


def test_allocation_is_all_or_nothing() -> None:
    bm = BlockManager(num_blocks=3, block_size=2)
    a, b = seq("a"), seq("b")
    assert bm.allocate(a, 4, [])
    assert not bm.allocate(b, 4, [])  # needs 2, 1 free
    assert b.block_table == [] and bm.num_free_blocks == 1
    bm.check_accounting()


def test_free_returns_blocks_tail_first_to_the_back_of_the_list() -> None:
    bm = BlockManager(num_blocks=6, block_size=2)
    a, b, c = seq("a"), seq("b"), seq("c")
    bm.allocate(a, 6, [])  # 0 1 2
    bm.allocate(b, 2, [])  # 3
    bm.free(a)
    assert a.block_table == []
    assert list(bm._probation) == [4, 5, 2, 1, 0]
    bm.allocate(c, 6, [])
    assert c.block_table == [4, 5, 2]
    bm.free(b)
    bm.free(c)
    assert bm.num_free_blocks == 6
    bm.check_accounting()


def test_accounting_check_catches_corruption() -> None:
    bm = BlockManager(num_blocks=2, block_size=2)
    s = seq("s")
    bm.allocate(s, 1, [])
    bm._ref_counts[0] = 0  # a used block with no reference
    with pytest.raises(AssertionError):
        bm.check_accounting()


def test_usage_fraction() -> None:
    bm = BlockManager(num_blocks=4, block_size=1)
    bm.allocate(seq("s"), 3, [])
    assert bm.usage == 0.75


def test_hot_cached_blocks_are_those_reused_in_the_last_minute() -> None:
    now = [100.0]
    bm = BlockManager(num_blocks=8, block_size=4, clock=lambda: now[0])

    prompt = list(range(9))  # two full blocks and one token
    assert (len(run(bm, "a", prompt)), bm.num_hot_cached_blocks()) == (0, 0)  # computed, not reused
    now[0] = 130.0
    assert (len(run(bm, "b", prompt)), bm.num_hot_cached_blocks()) == (2, 2)
    now[0] = 150.2
    assert len(run(bm, "c", prompt[:5])) == 1  # the first block again: it moves to second 150
    assert (bm._reused_in, bm.num_hot_cached_blocks()) == ({130: 1, 150: 1}, 2)
    bm.check_accounting()
    now[0] = 190.5  # second 130 is past the 60 s window
    assert (bm.num_hot_cached_blocks(), bm._reused_in) == (1, {150: 1})
    # A prompt that takes every block evicts the cached ones: nothing is hot.
    now[0] = 191.0
    assert len(run(bm, "d", list(range(100, 132)))) == 0
    assert (bm.num_hot_cached_blocks(), bm._reused_in) == (0, {150: 0})
    bm.check_accounting()
    now[0] = 210.0
    assert (bm.num_hot_cached_blocks(), bm._reused_in) == (0, {})
