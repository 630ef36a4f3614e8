"""Priority scheduling (vLLM's scheduling_policy "priority"): exact admission order and
preemption victim, block accounting balanced; fcfs ignores the field."""

from __future__ import annotations

import pytest

from pagefleet.engine import LLM, SamplingParams
from pagefleet.engine.block_manager import BlockManager
from pagefleet.engine.scheduler import Scheduler, SchedulerOutput, priority_order
from pagefleet.engine.sequence import Sequence


def make(policy: str, num_blocks: int = 16, budget: int = 64, max_seqs: int = 8) -> Scheduler:
    bm = BlockManager(num_blocks, 4, enable_prefix_caching=False)
    return Scheduler(bm, max_seqs, budget, False, scheduling_policy=policy)


def add(s: Scheduler, rid: str, prompt_len: int, priority: int, arrival: float) -> Sequence:
    seq = Sequence(
        rid, list(range(prompt_len)), SamplingParams(priority=priority), arrival_time=arrival
    )
    s.add(seq)
    return seq


def step(s: Scheduler) -> SchedulerOutput:
    out = s.schedule()
    s.update(out, [7 if sampling else None for sampling in out.sampling])
    return out


def ids(seqs: list[Sequence]) -> list[str]:
    return [q.request_id for q in seqs]


def test_priority_order_is_priority_then_arrival() -> None:
    seqs = [
        Sequence("late-urgent", [1], SamplingParams(priority=-1), arrival_time=3.0),
        Sequence("early-low", [1], SamplingParams(priority=5), arrival_time=0.0),
        Sequence("early", [1], SamplingParams(), arrival_time=1.0),
        Sequence("late", [1], SamplingParams(), arrival_time=2.0),
    ]
    assert ids(sorted(seqs, key=priority_order)) == ["late-urgent", "early", "late", "early-low"]


def test_admits_by_priority_then_arrival() -> None:
    s = make("priority", max_seqs=2)
    add(s, "low-1", 4, priority=2, arrival=0.0)
    add(s, "low-2", 4, priority=2, arrival=1.0)
    add(s, "mid", 4, priority=1, arrival=2.0)
    add(s, "high", 4, priority=0, arrival=3.0)
    assert ids(s.waiting) == ["high", "mid", "low-1", "low-2"]
    assert ids(step(s).seqs) == ["high", "mid"]
    assert ids(s.waiting) == ["low-1", "low-2"]
    s.block_manager.check_accounting()


def test_fcfs_ignores_priority() -> None:
    s = make("fcfs", max_seqs=2)
    add(s, "low", 4, priority=2, arrival=0.0)
    add(s, "high", 4, priority=0, arrival=1.0)
    add(s, "higher", 4, priority=-3, arrival=2.0)
    assert ids(step(s).seqs) == ["low", "high"]
    assert ids(s.waiting) == ["higher"]


def test_preempts_the_lowest_priority_then_latest_arrival() -> None:
    # 6 blocks of 4 tokens: three 8-token prompts take 2 blocks each; the first
    # decode step needs a third block for each, so someone must be preempted.
    s = make("priority", num_blocks=6)
    add(s, "urgent", 8, priority=0, arrival=2.0)
    add(s, "low-early", 8, priority=3, arrival=0.0)
    add(s, "normal", 8, priority=1, arrival=1.0)
    assert ids(step(s).seqs) == ["urgent", "normal", "low-early"]
    assert ids(s.running) == ["urgent", "normal", "low-early"]
    out = step(s)
    assert ids(out.preempted) == ["low-early"]
    assert ids(out.seqs) == ["urgent", "normal"]
    assert ids(s.waiting) == ["low-early"] and s.waiting[0].num_computed_tokens == 0
    bm = s.block_manager
    bm.check_accounting()
    assert bm.num_used_blocks == 6 and bm.num_free_blocks == 0
    for seq in list(s.running) + list(s.waiting):
        s.finish(seq, "abort")
    bm.check_accounting()
    assert bm.num_free_blocks == bm.num_total_blocks


def test_preempted_sequence_returns_to_its_priority_place() -> None:
    s = make("priority", num_blocks=6, max_seqs=3)
    add(s, "a", 8, priority=0, arrival=0.0)
    add(s, "b", 8, priority=0, arrival=1.0)
    add(s, "c", 8, priority=4, arrival=2.0)
    step(s)
    add(s, "d", 8, priority=2, arrival=3.0)  # waits: max_num_seqs reached
    out = step(s)
    assert ids(out.preempted) == ["c"]
    assert ids(s.waiting) == ["d", "c"]  # d is more urgent than the preempted c
    s.block_manager.check_accounting()


def test_scheduling_policy_is_checked() -> None:
    with pytest.raises(ValueError, match="scheduling_policy"):
        make("lifo")


def test_engine_admits_urgent_request_queued_behind_low_priority_ones(llama_dir: str) -> None:
    llm = LLM(model=llama_dir, num_kv_blocks=64, max_num_seqs=1, scheduling_policy="priority")
    engine = llm.engine  # type: ignore[attr-defined]
    order: list[str] = []

    def add(rid: str, priority: int) -> None:
        engine.add_request(
            rid, [1, 2, 3], SamplingParams(max_tokens=2, temperature=0, priority=priority)
        )

    add("low-1", 5)
    engine.step()  # low-1 runs; the others queue behind it
    add("low-2", 5)
    add("urgent", -1)
    while engine.has_unfinished_requests():
        order += [out.request_id for out in engine.step() if out.finished]
    llm.check_block_accounting()
    # max_num_seqs=1: the next admitted is the urgent one, queued after low-2.
    assert order == ["low-1", "urgent", "low-2"]
