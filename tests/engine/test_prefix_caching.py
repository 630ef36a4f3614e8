"""Prefix caching: exact hits, reused block ids, segmented-LRU eviction, and greedy equality."""

from __future__ import annotations

import random

import pytest

from pagefleet.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from pagefleet.engine.block_manager import PROTECTED_FRACTION, BlockManager
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


def run(bm: BlockManager, rid: str, tokens: list[int]) -> list[int]:
    """`admit`, then finish: the blocks it found cached."""
    s = seq(rid, tokens)
    cached = admit(bm, s)
    bm.free(s)
    return cached


def _grown(fraction: float = 0.8) -> tuple[BlockManager, list[int]]:
    """A pool whose reused prefix was evicted once, then admitted twice more: with a
    protected share, that miss grew the target to its cap (the prefix: root 5, child 4)."""
    bm = BlockManager(num_blocks=8, block_size=4, protected_fraction=fraction)
    prefix = list(range(9))  # blocks 0 and 1 full, 2 partial
    assert run(bm, "a", prefix) == []
    assert run(bm, "b", prefix) == [0, 1]
    # The target starts at 0: plain LRU, and two prompts of six new blocks evict the prefix.
    assert bm.free_block_ids() == [4, 5, 6, 7, 2, 3, 1, 0]
    assert run(bm, "u1", list(range(100, 124))) == []
    assert run(bm, "u2", list(range(200, 224))) == []
    assert bm.free_block_ids() == [5, 4, 6, 7, 2, 3, 0, 1]
    assert run(bm, "c", prefix) == []
    assert run(bm, "d", prefix) == [5, 4]
    return bm, prefix


def test_a_reused_prefix_evicted_too_soon_is_protected_from_then_on() -> None:
    """block_manager's "Eviction": missing a reused ghost grows the protected target, and
    the reused prefix then outlasts blocks never reused, where plain LRU evicts it."""
    bm, prefix = _grown()
    # c missed two reused ghosts against four never reused (u1's): 2 x 4 / 1 blocks, to
    # the cap, 6 (0.8 of 8); the blocks c and d evicted are ghosts never reused. d's hit
    # put the prefix on the protected list.
    assert (bm._protected_target, len(bm._ghosts), bm._reused_ghosts) == (6, 8, 0)
    assert (list(bm._probation), list(bm._protected)) == ([2, 3, 0, 1, 6, 7], [4, 5])
    for rid, first in (("u3", 300), ("u4", 400)):  # each takes probation's six blocks
        assert run(bm, rid, list(range(first, first + 24))) == []
        assert list(bm._protected) == [4, 5]
    assert run(bm, "e", prefix) == [5, 4]
    bm.check_accounting()
    lru, _ = _grown(0.0)
    assert (lru._protected_target, len(lru._ghosts)) == (0, 0)  # plain LRU remembers nothing
    for rid, first in (("u3", 300), ("u4", 400)):  # u4 takes the prefix's blocks
        assert run(lru, rid, list(range(first, first + 24))) == []
    assert run(lru, "e", prefix) == []
    lru.check_accounting()


def test_a_block_evicted_before_its_first_reuse_shrinks_the_target() -> None:
    bm, prefix = _grown()
    query = list(range(300, 324))
    run(bm, "u3", query)
    run(bm, "e", prefix)  # took block 7, u3's last: the newest ghost, never reused
    assert list(bm._ghosts.items())[-1] == (bm.block_hashes(seq("h", query))[-1], False)
    assert (len(bm._ghosts), bm._reused_ghosts, bm._protected_target) == (8, 0, 6)
    # u3's prompt again misses that block: the target shrinks by one, to 5, and u3's
    # reused blocks, freed into the protected list, push its oldest (4, 5) to probation.
    assert run(bm, "u3 again", query) == [2, 3, 0, 1, 6]
    assert bm._protected_target == 5
    assert (list(bm._probation), list(bm._protected)) == ([7, 4, 5], [6, 1, 0, 3, 2])
    bm.check_accounting()


def test_evicting_a_block_sends_its_protected_descendants_to_the_front() -> None:
    bm, _ = _grown()
    bm._protected.move_to_end(4)  # the root first (no order frees make; the code allows it)
    big = seq("big", [9] * 28)  # seven blocks: probation's six, then root 5
    assert admit(bm, big) == []
    assert big.block_table == [2, 3, 0, 1, 6, 7, 5]
    # Evicting root 5 uncached its child 4, which left the protected list for the front.
    assert (list(bm._probation), list(bm._protected)) == ([4], [])
    bm.check_accounting()


def test_the_pools_default_is_the_engines() -> None:
    field = EngineConfig.__dataclass_fields__["prefix_cache_protected_fraction"]
    assert field.default == PROTECTED_FRACTION


@pytest.mark.parametrize("fraction", [0.0, 0.3, 0.8, 1.0])
def test_random_admissions_and_frees_keep_the_accounting(fraction: float) -> None:
    """Both free lists under load: shared prefixes, private tails, forks, decode steps
    (copy-on-write included) and out-of-order frees."""
    rng = random.Random(11)
    bm = BlockManager(num_blocks=40, block_size=4, protected_fraction=fraction)
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(4, 20))] for _ in range(8)]
    live: list[Sequence] = []
    copies: list[tuple[int, int]] = []
    most_protected = 0  # the highest target
    for i in range(900):
        roll = rng.random()
        if live and (roll < 0.35 or bm.num_free_blocks < 8):
            bm.free(live.pop(rng.randrange(len(live))))
        elif live and roll < 0.5:  # a sibling sample sharing every block
            child = rng.choice(live).fork(i)
            bm.fork(next(s for s in live if s.request_id == child.request_id), child)
            live.append(child)
        elif live and roll < 0.7:  # a decode step: one token, written where it lands
            s = rng.choice(live)
            s.token_ids.append(rng.randrange(1000))
            if bm.allocate(s, s.num_tokens, copies):
                s.num_computed_tokens = s.num_tokens
                bm.cache_computed_blocks(s)
            else:
                s.token_ids.pop()
        else:
            tokens = rng.choice(prefixes) + [
                rng.randrange(1000) for _ in range(rng.randrange(1, 9))
            ]
            s = seq(f"r{i}", tokens)
            cached = bm.cached_prefix(s)
            if not bm.allocate_prefilled(s, cached, s.num_tokens):
                continue
            for k, block in enumerate(cached):  # a hit holds exactly the prompt's tokens
                assert bm._tokens_of[block] == tuple(tokens[4 * k : 4 * k + 4])
            s.num_computed_tokens = s.num_tokens
            bm.cache_computed_blocks(s)
            live.append(s)
        bm.check_accounting()
        most_protected = max(most_protected, bm._protected_target)
    assert bm.prefix_cache_hits > 0 and copies
    assert (most_protected > 0) == (fraction > 0)  # the target moved


def test_the_engine_passes_its_protected_fraction_to_the_pool(llama_dir: str) -> None:
    """A system prompt reused, evicted once, survives a flood of unique prompts on the
    engine's default, and not with plain LRU (`prefix_cache_protected_fraction=0`)."""
    system = list(range(3, 35))  # two full 16-token blocks
    p = SamplingParams(temperature=0, max_tokens=1)
    found = {}
    for fraction in (0.8, 0.0):
        llm = LLM(
            model=llama_dir,
            num_kv_blocks=16,
            block_size=16,
            prefix_cache_protected_fraction=fraction,
        )
        for rnd in range(2):
            # The system prompt reused, then 30 blocks of unique prompts through the
            # 16-block pool: on the first round it is evicted, and its miss on the second
            # grows the protected target; after the second it is protected.
            for i in range(2):
                llm.generate({"prompt_token_ids": [*system, 40 + i]}, p, use_tqdm=False)
            for i in range(6):
                flood = list(range(50 + 80 * i + 480 * rnd, 130 + 80 * i + 480 * rnd))
                llm.generate({"prompt_token_ids": flood}, p, use_tqdm=False)
        before = llm.stats().prefix_cache_hits
        llm.generate({"prompt_token_ids": [*system, 50]}, p, use_tqdm=False)
        found[fraction] = llm.stats().prefix_cache_hits - before
        llm.check_block_accounting()
    assert found == {0.8: 32, 0.0: 0}


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
