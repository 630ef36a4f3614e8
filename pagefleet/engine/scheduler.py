"""Iteration-level scheduling (continuous batching).

"Scheduling" here means choosing, before every model step, which sequences
run and how many of their tokens are computed, so that a finished sequence's
place is taken by a waiting one at the very next step rather than when the
whole batch is done (Orca's iteration-level scheduling).

There are no separate prefill and decode phases: each sequence simply has
tokens whose K/V are not yet computed: its whole prompt on admission (less
what the prefix cache already holds), one token per step while it decodes.
A step computes up to `max_num_batched_tokens` tokens:

1. Running sequences first, oldest first. Each needs blocks for the tokens it
   computes now. When the pool is short, the most recently admitted running
   sequence is preempted by recompute (its blocks freed, its progress reset,
   put back at the front of the queue) until the older sequence fits; if the
   one that needs the block is itself the newest, it is the one preempted.
2. Then, only if nobody was preempted in this step, waiting sequences are
   admitted first-come-first-served while the token budget, `max_num_seqs`
   (a request with n samples counts n) and the block pool allow. A waiting
   sequence first takes the blocks of its longest cached prefix. Without
   chunked prefill the rest of its prompt must fit the remaining budget
   whole; with it, the last admitted prompt may take just the budget that is
   left and continue next step.

The scheduling policy (vLLM's `scheduling_policy`) is one ordering: under
"fcfs" the queues keep arrival (and admission) order, as above; under
"priority" both queues are kept sorted by `priority_order` (the request's
priority, lower first, then arrival), so the waiting request admitted next is
the most urgent one and the preemption victim, the last running sequence, is
the least urgent one (highest priority value, latest arrival). A preempted
sequence goes back to its place in that order.

The scheduler decides; the BlockManager keeps the books; neither touches
tensors. The result of a step's decision is a `SchedulerOutput`.

A decision that raises part-way (a bug: nothing in it is expected to fail)
raises `SchedulingError` naming the sequences the step had already taken
plus the one it was deciding on; the caller ends their requests. Every
other sequence is left where a finished decision would have left it:
running, waiting, or preempted back to the front of the queue.
"""

from __future__ import annotations

import bisect
import contextlib
from collections import deque
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    """The hand-off from the scheduler to the model runner for one step.

    `seqs[i]` computes `num_scheduled_tokens[i]` tokens starting at its
    `num_computed_tokens`; `sampling[i]` says whether that reaches the end of
    its known tokens, so that the step samples its next token (a prompt chunk
    that stops short does not).
    """

    seqs: list[Sequence] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    sampling: list[bool] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # Copy-on-write: (source block, destination block) pairs to copy before the step.
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)

    def append(self, seq: Sequence, num_new: int) -> None:
        self.seqs.append(seq)
        self.num_scheduled_tokens.append(num_new)
        self.sampling.append(seq.num_computed_tokens + num_new == seq.num_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


class SchedulingError(RuntimeError):
    """`schedule` raised part-way; `seqs` are the sequences the step had touched."""

    def __init__(self, seqs: list[Sequence]) -> None:
        super().__init__("scheduling failed")
        self.seqs = seqs


def priority_order(seq: Sequence) -> tuple[int, float]:
    """The "priority" policy's order: lower priority value first, then earlier arrival."""
    return seq.params.priority, seq.arrival_time


SCHEDULING_POLICIES = ("fcfs", "priority")


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool,
        scheduling_policy: str = "fcfs",
    ) -> None:
        if scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.by_priority = scheduling_policy == "priority"
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self._enqueue(self.waiting, seq, front=False)

    def _enqueue(self, queue: deque[Sequence] | list[Sequence], seq: Sequence, front: bool) -> None:
        """Put `seq` in its place: by `priority_order` under "priority"; else at the back
        (or, for a preempted sequence, the front)."""
        if self.by_priority:
            queue.insert(bisect.bisect_right(queue, priority_order(seq), key=priority_order), seq)
        elif front:
            queue.insert(0, seq)
        else:
            queue.append(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        # The sequence being decided on: on a failure it is half-updated (blocks
        # taken, or popped from a queue), so it fails along with those in `out`.
        current: list[Sequence | None] = [None]
        try:
            self._schedule(out, current)
        except Exception as e:
            touched = [*out.seqs, *(s for s in current if s is not None and s not in out.seqs)]
            raise SchedulingError(touched) from e
        return out

    def _schedule(self, out: SchedulerOutput, current: list[Sequence | None]) -> None:
        budget = self.max_num_batched_tokens

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            current[0] = seq
            num_new = min(seq.num_schedulable_tokens, budget)
            bm = self.block_manager
            while not bm.allocate(seq, seq.num_computed_tokens + num_new, out.blocks_to_copy):
                victim = self.running.pop()
                current.append(victim)  # half-preempted if _preempt raises
                self._preempt(victim)
                current.pop()
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.append(seq, num_new)
                budget -= num_new
                i += 1

        while self.waiting and budget > 0 and not out.preempted:
            seq = self.waiting[0]
            current[0] = seq
            if len(self.running) + 1 + seq.num_forks_pending > self.max_num_seqs:
                break
            cached = self.block_manager.cached_prefix(seq)
            seq.num_computed_tokens = len(cached) * self.block_manager.block_size
            num_new = seq.num_schedulable_tokens
            if num_new > budget:
                if not self.enable_chunked_prefill:
                    seq.num_computed_tokens = 0
                    break
                num_new = budget
            end = seq.num_computed_tokens + num_new
            if not self.block_manager.allocate_prefilled(seq, cached, end):
                seq.num_computed_tokens = 0
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self._enqueue(self.running, seq, front=False)
            out.append(seq, num_new)
            budget -= num_new

    def update(self, out: SchedulerOutput, sampled: list[int | None]) -> list[Sequence]:
        """Record a finished step: advance progress, append sampled tokens,
        register newly computed full blocks, fork requests that are ready.

        Returns the sequences forked in this update.
        """
        bm = self.block_manager
        forked: list[Sequence] = []
        for seq, num_new, token in zip(out.seqs, out.num_scheduled_tokens, sampled, strict=True):
            seq.num_computed_tokens += num_new
            if token is not None:
                seq.token_ids.append(token)
            bm.cache_computed_blocks(seq)
            bm.free_out_of_window(seq)
            if seq.num_forks_pending and seq.num_schedulable_tokens == 0:
                forked += self._fork(seq)
        return forked

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """Split `parent` into its n samples; they share every block until they write."""
        count, parent.num_forks_pending = parent.num_forks_pending, 0
        children: list[Sequence] = []
        for i in range(1, 1 + count):
            children.append(
                self.fork_running(parent, i, after=children[-1] if children else parent)
            )
        return children

    def fork_running(self, parent: Sequence, index: int, after: Sequence | None = None) -> Sequence:
        """A running copy of `parent` sharing its blocks, placed after `after` (default: parent)."""
        child = parent.fork(index)
        self.block_manager.fork(parent, child)
        self.running.insert(self.running.index(after or parent) + 1, child)
        return child

    def finish(self, seq: Sequence, reason: str, stop_reason: str | int | None = None) -> None:
        """Remove a running or waiting sequence and release its blocks."""
        if seq.status is SequenceStatus.FINISHED:
            return
        queue, other = (
            (self.running, self.waiting)
            if seq.status is SequenceStatus.RUNNING
            else (self.waiting, self.running)
        )
        try:
            queue.remove(seq)
        except ValueError:
            # Only after a failed step: a sequence caught between the queues (its
            # status not yet updated, or in neither) is still ended and freed.
            with contextlib.suppress(ValueError):
                other.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self._enqueue(self.waiting, seq, front=True)
        self.num_preemptions += 1
