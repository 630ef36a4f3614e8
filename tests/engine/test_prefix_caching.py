"""Prefix caching: exact hits, reused block ids, LRU eviction, and greedy equality."""

from __future__ import annotations

import pytest

from pagefleet.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from pagefleet.engine.block_manager import BlockManager
from pagefleet.engine.sequence import Sequence
from tests.conftest import hf_greedy, prompt_ids


def seq(rid: str, tokens: list[int]) -> Sequence:
    return Sequence(rid, tokens, SamplingParams())


def admit(bm: BlockManager, s: Sequence) -> list[int]:
    """Admit `s` as the scheduler does, compute it, register its blocks; return its hits."""
    cached = bm.cached_prefix(s)
    assert bm.allocate_prefilled(s, cached, s.num_tokens)
    s.num_computed_tokens = s.num_tokens
    bm.cache_computed_blocks(s)
    return cached


def test_reuses_exact_blocks_and_counts_tokens() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq("a", list(range(10)))  # blocks: [0-3] [4-7] [8 9]
    assert admit(bm, a) == []
    assert a.block_table == [0, 1, 2]
    assert bm.num_cached_blocks == 2  # only full blocks are cached
    b = seq("b", [*range(8), 100, 101])
    assert admit(bm, b) == [0, 1]
    assert b.block_table == [0, 1, 3]
    assert [bm.ref_count(i) for i in range(4)] == [2, 2, 1, 1]
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (20, 8)
    # A different first block breaks the chain: nothing matches, not even block 1's tokens.
    c = seq("c", [99, 1, 2, 3, 4, 5, 6, 7, 8])
    assert admit(bm, c) == []
    bm.check_accounting()


def test_always_leaves_one_token_to_compute() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    admit(bm, seq("a", list(range(8))))
    # 8 tokens = 2 full blocks, but only (8 - 1) // 4 = 1 may be reused.
    assert bm.cached_prefix(seq("b", list(range(8)))) == [0]
    assert bm.cached_prefix(seq("c", list(range(9)))) == [0, 1]


def test_freed_blocks_stay_cached_and_are_evicted_lru() -> None:
    bm = BlockManager(num_blocks=6, block_size=2)
    a = seq("a", [1, 2, 3, 4, 5])  # blocks 0 [1 2], 1 [3 4], 2 [5]
    admit(bm, a)
    bm.free(a)
    # Tail first to the back: 2 (uncached), then 1, then 0.
    assert bm.free_block_ids() == [3, 4, 5, 2, 1, 0]
    assert bm.num_free_blocks == 6 and bm.num_cached_blocks == 2
    b = seq("b", [1, 2, 3, 4, 9])  # finds both blocks, takes free block 3
    assert admit(bm, b) == [0, 1]
    assert b.block_table == [0, 1, 3]
    bm.free(b)
    assert bm.free_block_ids() == [4, 5, 2, 3, 1, 0]
    # Filling the pool takes from the front: 4, 5, 2, 3 (uncached), then 1, evicting [3 4].
    big = seq("big", [7] * 9)
    assert admit(bm, big) == []
    assert big.block_table == [4, 5, 2, 3, 1]
    assert bm.free_block_ids() == [0]
    # [1 2] is still cached; big's four full blocks are chained, so four distinct hashes.
    assert bm.num_cached_blocks == 1 + 4
    assert bm.cached_prefix(seq("c", [1, 2, 3, 4, 5])) == [0]
    bm.check_accounting()


def test_eviction_removes_the_hash() -> None:
    bm = BlockManager(num_blocks=2, block_size=2)
    a = seq("a", [1, 2, 3])
    admit(bm, a)
    bm.free(a)
    other = seq("o", [5, 6, 7])
    admit(bm, other)  # takes both blocks, evicting [1 2]
    bm.free(other)
    assert bm.cached_prefix(seq("again", [1, 2, 3])) == []


@pytest.fixture(scope="module")
def expected(llama_dir: str) -> dict[tuple[int, ...], list[int]]:
    return {}


def _oracle(cache: dict, path: str, ids: list[int], n: int) -> list[int]:
    key = (*ids, -n)
    if key not in cache:
        cache[key] = hf_greedy(path, ids, n)
    return cache[key]


@pytest.mark.parametrize("chunk", [16, 64, 512])
@pytest.mark.parametrize("caching", [True, False])
def test_greedy_equality_with_shared_prefixes_arriving_mid_decode(
    llama_dir: str, expected: dict, chunk: int, caching: bool
) -> None:
    base = prompt_ids(llama_dir)
    system = base[12] + base[8]  # a long shared prefix (about 60 tokens)
    first_wave = [system + p for p in base[:4]] + base[4:7]
    second_wave = [system + p for p in base[7:11]] + [system]
    engine = LLMEngine(
        EngineConfig(
            model=llama_dir,
            num_kv_blocks=96,
            block_size=8,
            max_num_batched_tokens=chunk,
            enable_prefix_caching=caching,
        )
    )
    params = SamplingParams(temperature=0, max_tokens=12)
    done = {}
    for i, ids in enumerate(first_wave):
        engine.add_request(f"a{i}", {"prompt_token_ids": ids}, params)
    for _ in range(6):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert engine.stats().num_running > 0  # the second wave arrives while these decode
    for i, ids in enumerate(second_wave):
        engine.add_request(f"b{i}", {"prompt_token_ids": ids}, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    stats = engine.stats()
    if caching:
        assert stats.prefix_cache_hits >= 4 * (len(system) // 8) * 8
    else:
        assert stats.prefix_cache_hits == stats.prefix_cache_queries == 0
    engine.check_block_accounting()
    for rid, ids in [
        *((f"a{i}", x) for i, x in enumerate(first_wave)),
        *((f"b{i}", x) for i, x in enumerate(second_wave)),
    ]:
        assert done[rid].outputs[0].token_ids == _oracle(expected, llama_dir, ids, 12), rid


def test_second_identical_prompt_hits_all_full_blocks(llama_dir: str) -> None:
    llm = LLM(model=llama_dir, num_kv_blocks=32, block_size=16)
    ids = list(range(3, 43))  # 40 tokens: 2 full blocks
    p = SamplingParams(temperature=0, max_tokens=4)
    first = llm.generate({"prompt_token_ids": ids}, p, use_tqdm=False)
    second = llm.generate({"prompt_token_ids": ids}, p, use_tqdm=False)
    assert first[0].outputs[0].token_ids == second[0].outputs[0].token_ids
    stats = llm.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (80, 32)
    assert len(stats.cached_block_hashes) == stats.num_cached_blocks >= 2
    llm.check_block_accounting()
