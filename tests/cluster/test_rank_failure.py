"""`RankFailure`: a tensor-parallel group's failure, recorded by the rank watcher's thread
and learnt by every failed stream at once (no thread per waiter)."""

from __future__ import annotations

import asyncio
import threading
import time

from pagefleet.cluster.rank_failure import RankFailure

REASON = "tensor-parallel rank 1 died: its process was killed"


def test_sixty_four_streams_learn_the_failure_together_without_threads() -> None:
    failure = RankFailure()

    async def main() -> tuple[list[str | None], list[float], int]:
        t0 = time.monotonic()
        before = threading.active_count()
        waits = [asyncio.create_task(failure.wait(3.0)) for _ in range(64)]
        await asyncio.sleep(0.05)
        threads = threading.active_count() - before  # threads the waits took
        threading.Timer(0.2, failure.record, args=(REASON,)).start()  # the watcher's thread
        done: list[float] = []
        for w in waits:
            w.add_done_callback(lambda _: done.append(time.monotonic() - t0))
        reasons = await asyncio.gather(*waits)
        return reasons, done, threads

    reasons, done, threads = asyncio.run(main())
    assert reasons == [REASON] * 64
    # All 64 within moments of the record (0.2 s in), not in turns of the grace period.
    assert max(done) < 1.0, max(done)
    assert threads == 0


def test_no_failure_within_the_grace_is_none_and_a_late_one_is_kept() -> None:
    failure = RankFailure()
    calls: list[str] = []
    failure.on_failure(calls.append)
    assert asyncio.run(failure.wait(0.05)) is None
    assert failure.record(REASON) is True
    assert failure.record("a second reason") is False  # the first one stays
    assert failure.reason == REASON and calls == [REASON]
    assert asyncio.run(failure.wait(5.0)) == REASON  # at once, already recorded
    late: list[str] = []
    failure.on_failure(late.append)
    assert late == [REASON]


def test_once_stopping_ranks_that_end_are_no_failure_and_waits_return() -> None:
    failure = RankFailure()
    calls: list[str] = []
    failure.on_failure(calls.append)

    async def main() -> str | None:
        wait = asyncio.create_task(failure.wait(30.0))
        await asyncio.sleep(0.05)
        failure.stopping()  # the replica stops its own ranks
        t0 = time.monotonic()
        reason = await wait
        assert time.monotonic() - t0 < 10.0  # at once, not after the 30 s wait
        return reason

    assert asyncio.run(main()) is None
    assert failure.record(REASON) is False
    assert failure.reason is None and calls == []


def test_sixty_four_streams_with_no_rank_lost_all_give_up_after_one_grace() -> None:
    """A step that failed with every rank alive: each stream waits the grace once, all
    together (parked in a default executor of a few threads they took 30+ s in turns)."""
    failure = RankFailure()

    async def main() -> tuple[list[str | None], float]:
        t0 = time.monotonic()
        reasons = await asyncio.gather(*(failure.wait(0.5) for _ in range(64)))
        return reasons, time.monotonic() - t0

    reasons, took = asyncio.run(main())
    assert reasons == [None] * 64
    # Together: one grace (0.5 s) plus a noisy machine's slack, far from 64 in turns.
    assert 0.5 <= took < 3.0, took
