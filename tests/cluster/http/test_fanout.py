"""The ingress's fan-out: a consumer that lags gets what came meanwhile as one delta
(one SSE chunk, not one per token), in order and exactly; one that keeps up gets each."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from pagefleet.cluster.http.fanout import Fanout, RequestStream
from pagefleet.cluster.replica_messages import (
    ReplicaRequest,
    RequestDelta,
    SampleDelta,
    merge_deltas,
)
from pagefleet.engine import SamplingParams


def delta(ids: list[int], finished: bool = False, reason: str | None = None) -> RequestDelta:
    text = "".join(chr(97 + t) for t in ids)
    lps = [{t: -float(t)} for t in ids]
    sample = SampleDelta(0, ids, text, lps, finish_reason=reason)
    return RequestDelta("r", 2, [sample], finished)


class Backend:
    """A replica stream: admitted, then a delta per token as `step` is set."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.sent = 0
        self.step = asyncio.Event()

    async def generate(self, request: ReplicaRequest) -> AsyncIterator[RequestDelta]:
        yield RequestDelta("r", 2, [], False)
        for t in range(self.n):
            await self.step.wait()
            self.step.clear()
            last = t == self.n - 1
            yield delta([t], last, "length" if last else None)
            self.sent += 1


def request() -> list[ReplicaRequest]:
    return [ReplicaRequest("r", [1, 2], SamplingParams(max_tokens=5))]


def test_a_lagging_consumer_gets_what_came_meanwhile_as_one_delta() -> None:
    async def main() -> list[RequestDelta]:
        backend = Backend(5)
        stream = RequestStream(Fanout(backend, request()), 1, None, None)  # type: ignore[arg-type]
        await stream.admit()
        for _ in range(3):  # three tokens come while the consumer is busy elsewhere
            backend.step.set()
            while backend.step.is_set():
                await asyncio.sleep(0)
        await asyncio.sleep(0)
        got = [(await anext(stream))[1]]
        for _ in range(2):  # then it keeps up: one delta each
            backend.step.set()
            got.append((await anext(stream))[1])
        await stream.aclose()
        return got

    got = asyncio.run(main())
    assert [d.samples[0].token_ids for d in got] == [[0, 1, 2], [3], [4]]
    assert got[0].samples[0].text == "abc"
    assert got[0].samples[0].logprobs == [{0: -0.0}, {1: -1.0}, {2: -2.0}]
    assert [d.finished for d in got] == [False, False, True]
    assert got[-1].samples[0].finish_reason == "length"


def test_merged_deltas_are_the_deltas_in_order() -> None:
    a, b, c = delta([1]), delta([2, 3]), delta([], True, "stop")
    m = merge_deltas(merge_deltas(a, b), c)
    assert m == RequestDelta(
        "r",
        2,
        [SampleDelta(0, [1, 2, 3], "bcd", [{1: -1.0}, {2: -2.0}, {3: -3.0}], finish_reason="stop")],
        True,
    )
