"""Scheduler: exact admission order, token budget, preemption victim and requeue order."""

from __future__ import annotations

from pagefleet.engine import SamplingParams
from pagefleet.engine.block_manager import BlockManager
from pagefleet.engine.scheduler import Scheduler, SchedulerOutput
from pagefleet.engine.sequence import Sequence, SequenceStatus


def make(
    num_blocks: int = 16,
    block_size: int = 4,
    max_seqs: int = 8,
    budget: int = 64,
    chunked: bool = False,
    caching: bool = False,
) -> Scheduler:
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
    return Scheduler(bm, max_seqs, budget, chunked)


def add(s: Scheduler, rid: str, prompt_len: int) -> Sequence:
    seq = Sequence(rid, list(range(prompt_len)), SamplingParams())
    s.add(seq)
    return seq


def step(s: Scheduler, token: int = 7) -> SchedulerOutput:
    """Schedule, then pretend the model ran: every sampling sequence gets `token`."""
    out = s.schedule()
    s.update(out, [token if sampling else None for sampling in out.sampling])
    return out


def ids(seqs: list[Sequence]) -> list[str]:
    return [q.request_id for q in seqs]


def test_admits_fcfs_and_then_decodes_one_token_each() -> None:
    s = make()
    add(s, "a", 5)
    add(s, "b", 3)
    out = step(s)
    assert ids(out.seqs) == ["a", "b"] and out.num_scheduled_tokens == [5, 3]
    out = step(s)
    assert ids(out.seqs) == ["a", "b"] and out.num_scheduled_tokens == [1, 1]
    assert [q.num_computed_tokens for q in s.running] == [6, 4]


def test_token_budget_limits_admission_without_chunking() -> None:
    s = make(budget=8)
    add(s, "a", 5)
    add(s, "b", 4)  # does not fit in the 3 tokens left
    add(s, "c", 2)  # FCFS: not admitted past b
    out = step(s)
    assert ids(out.seqs) == ["a"]
    assert ids(s.waiting) == ["b", "c"]
    out = step(s)  # a decodes (1 token), then b (4) and c (2) fit in the 7 left
    assert ids(out.seqs) == ["a", "b", "c"] and out.num_scheduled_tokens == [1, 4, 2]


def test_chunked_prefill_splits_a_long_prompt() -> None:
    s = make(budget=4, chunked=True)
    a = add(s, "a", 10)
    out = step(s)
    assert out.num_scheduled_tokens == [4] and out.sampling == [False]
    assert a.num_computed_tokens == 4 and a.num_output_tokens == 0
    step(s)
    out = step(s)
    assert out.num_scheduled_tokens == [2] and out.sampling == [True]
    assert a.num_output_tokens == 1


def test_max_num_seqs() -> None:
    s = make(max_seqs=2)
    for r in "abc":
        add(s, r, 1)
    out = step(s)
    assert ids(out.seqs) == ["a", "b"] and ids(s.waiting) == ["c"]


def test_preempts_newest_running_sequence_and_requeues_it_first() -> None:
    # 4 blocks of 2 tokens. a, b, c take one block each (2-token prompts).
    s = make(num_blocks=4, block_size=2)
    a, b, c = add(s, "a", 2), add(s, "b", 2), add(s, "c", 2)
    add(s, "d", 4)  # needs 2 blocks: stays waiting (1 free)
    step(s)
    assert [q.block_table for q in (a, b, c)] == [[0], [1], [2]]
    # Each now needs a second block for its 3rd token; only block 3 is free.
    out = step(s)
    assert ids(out.seqs) == ["a", "b"]
    assert ids(out.preempted) == ["c"]
    assert a.block_table == [0, 3] and b.block_table == [1, 2]
    assert c.status is SequenceStatus.WAITING and c.num_computed_tokens == 0 and c.block_table == []
    assert ids(s.waiting) == ["c", "d"]  # the victim goes before later arrivals
    assert s.num_preemptions == 1
    # Its generated token survives: it recomputes prompt + output later.
    assert c.token_ids == [0, 1, 7]
    s.block_manager.check_accounting()


def test_sequence_preempts_itself_when_it_is_the_newest() -> None:
    s = make(num_blocks=2, block_size=2)
    a, b = add(s, "a", 2), add(s, "b", 2)
    step(s)
    out = step(s)  # a takes... no free block: b (newest) is evicted for a
    assert ids(out.seqs) == ["a"] and ids(out.preempted) == ["b"]
    assert a.block_table == [0, 1]
    # Next: a fits in its block; b cannot come back while a holds both blocks.
    out = step(s)
    assert ids(out.seqs) == ["a"] and ids(s.waiting) == ["b"]
    s.finish(a, "length")
    out = step(s)
    assert ids(out.seqs) == ["b"] and out.num_scheduled_tokens == [3]
    assert b.block_table == [1, 0]


def test_no_admission_in_a_step_that_preempted() -> None:
    s = make(num_blocks=3, block_size=2)
    add(s, "a", 2)
    add(s, "b", 2)
    step(s)
    add(s, "c", 1)
    step(s)  # a gets block 2, b preempted: c must not be admitted this step
    assert ids(s.running) == ["a"]
    assert ids(s.waiting) == ["b", "c"]


def test_finish_and_abort_release_blocks() -> None:
    s = make(num_blocks=4, block_size=2)
    a, b = add(s, "a", 3), add(s, "b", 2)
    c = add(s, "c", 9)  # never admitted
    step(s)
    s.finish(a, "stop")
    s.finish(c, "abort")
    assert a.status is SequenceStatus.FINISHED and a.finish_reason == "stop"
    assert ids(s.running) == ["b"] and not s.waiting
    assert s.block_manager.num_free_blocks == 3
    s.finish(b, "length")
    s.finish(b, "length")  # finishing twice is harmless
    assert s.block_manager.num_free_blocks == 4
    s.block_manager.check_accounting()


def test_admission_reuses_cached_prefix_blocks() -> None:
    s = make(num_blocks=4, block_size=2, caching=True)
    a = add(s, "a", 4)  # blocks 0 1, full and cached once computed
    step(s)
    s.finish(a, "stop")  # free list: 2 3 1 0, blocks 0 and 1 still cached
    c = Sequence("c", [0, 1, 2, 3, 9], SamplingParams())
    s.add(c)
    out = step(s)
    assert out.num_scheduled_tokens == [1]  # only the token after the cached prefix
    assert c.block_table == [0, 1, 2]
    assert (s.block_manager.prefix_cache_hits, s.block_manager.prefix_cache_queries) == (4, 4 + 5)
    s.block_manager.check_accounting()


def test_request_with_samples_forks_after_its_prompt() -> None:
    s = make(num_blocks=16, block_size=4)
    parent = add(s, "p", 6)
    parent.num_forks_pending = 2
    out = s.schedule()
    assert out.num_scheduled_tokens == [5] and out.sampling == [False]
    forked = s.update(out, [None])
    assert [c.index for c in forked] == [1, 2]
    assert ids(s.running) == ["p", "p", "p"]
    assert all(q.block_table == parent.block_table for q in forked)
    assert [s.block_manager.ref_count(b) for b in parent.block_table] == [3, 3]
    out = s.schedule()  # each writes the last prompt token into shared block 1: two copies
    assert out.num_scheduled_tokens == [1, 1, 1] and out.sampling == [True, True, True]
    assert out.blocks_to_copy == [(1, 2), (1, 3)]
    assert [q.block_table for q in s.running] == [[0, 2], [0, 3], [0, 1]]
    s.block_manager.check_accounting()
