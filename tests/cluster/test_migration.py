"""Mid-stream migration at the ingress's seam (`migration.MigratingStream`), over a real
in-process engine replica, no Ray: a replica stream cut after k token deltas (the actor
died, the engine died, the stream ended early) goes on as continuations, and the merged
stream the client reads is, sample by sample, exactly the uninterrupted one: tokens,
text (held-back stop strings included), logprobs, cumulative logprob, finish reason.
And `ServeBackend` hands a leaving replica's streams off once `migration_drain_s` is over;
over HTTP, the API layer streams a cut request exactly as an uncut one.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
from ray.exceptions import ActorDiedError

from pagefleet.cluster import ingress as ingress_module
from pagefleet.cluster import leaving
from pagefleet.cluster.config import ServeConfig
from pagefleet.cluster.http import APIError
from pagefleet.cluster.ingress import ServeBackend
from pagefleet.cluster.migration import (
    ENGINE_DEAD,
    REPLICA_FAILED,
    SCALE_IN,
    MigratingStream,
    stream_cut,
)
from pagefleet.cluster.replica import LLMReplica, LocalBackend
from pagefleet.cluster.replica_messages import ReplicaRequest, RequestDelta, encode_delta
from pagefleet.engine import EngineDeadError, SamplingParams
from pagefleet.engine.output_delta import merge_samples
from tests.cluster.http.test_api import Harness, serving, sse_events
from tests.conftest import prompt_ids
from tests.engine.test_continuation import JSON, SCHEMA

CASES = {
    "greedy": SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
    "greedy-logprobs": SamplingParams(temperature=0, max_tokens=20, logprobs=2, ignore_eos=True),
    "seeded": SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=24, ignore_eos=True),
    "seeded-n2-logprobs": SamplingParams(
        temperature=1.0, top_k=40, seed=3, max_tokens=20, n=2, logprobs=1, ignore_eos=True
    ),
    "seeded-min-tokens": SamplingParams(temperature=1.0, seed=11, max_tokens=20, min_tokens=12),
    "greedy-json": SamplingParams(temperature=0, max_tokens=40, structured_outputs=JSON),
    "seeded-n2-json": SamplingParams(
        temperature=1.0, top_k=50, seed=9, max_tokens=40, n=2, structured_outputs=JSON
    ),
}

FAILURES: dict[str, Callable[[], Exception]] = {
    REPLICA_FAILED: lambda: ActorDiedError(),
    ENGINE_DEAD: lambda: EngineDeadError("the engine core exited"),
    "cut": stream_cut,
}


@pytest.fixture(scope="module")
def runner() -> Iterator[asyncio.Runner]:
    with asyncio.Runner() as r:
        yield r


@pytest.fixture(scope="module")
def replica(llama_dir: str, runner: asyncio.Runner) -> Iterator[LLMReplica]:
    config = ServeConfig(model=llama_dir, engine={"num_kv_blocks": 256, "max_num_seqs": 8})
    r = LLMReplica(config, "r0", in_process=True)
    yield r
    runner.run(r.shutdown())


class Cutting:
    """Opens streams on the replica; the i-th stream opened fails (with `failure()`)
    before it passes on its (cuts[i] + 1)-th delta carrying tokens (None: never)."""

    def __init__(
        self, replica: LLMReplica, cuts: list[int | None], failure: Callable[[], Exception]
    ) -> None:
        self.replica = replica
        self.cuts = list(cuts)
        self.failure = failure
        self.opened: list[ReplicaRequest] = []
        self.made = 0  # cuts made (a lagging stream merges deltas: fewer than asked)

    async def open(self, request: ReplicaRequest) -> AsyncIterator[RequestDelta]:
        cut = self.cuts[len(self.opened)] if len(self.opened) < len(self.cuts) else None
        self.opened.append(request)
        passed = 0
        async with contextlib.aclosing(self.replica.generate(request)) as deltas:
            async for delta in deltas:
                if any(s.token_ids for s in delta.samples):
                    if passed == cut:
                        self.made += 1
                        raise self.failure()
                    passed += 1
                yield delta


async def client_view(
    replica: LLMReplica,
    params: SamplingParams,
    cuts: list[int | None],
    failure: Callable[[], Exception] = stream_cut,
    limit: int = 8,
) -> tuple[list[RequestDelta], list[str], Cutting]:
    prompt = prompt_ids(replica.config.model)[0]
    cutting = Cutting(replica, cuts, failure)
    reasons: list[str] = []
    request = ReplicaRequest("req", prompt, params)
    stream = MigratingStream(request, cutting.open, limit, reasons.append)
    deltas = [d async for d in stream.deltas()]
    await replica.check_block_accounting()
    stats = await replica.engine.fetch_stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    return deltas, reasons, cutting


def samples(deltas: list[RequestDelta]) -> list[Any]:
    """Each sample's whole output as the client assembles it from the stream."""
    merged: list[Any] = []
    for d in deltas:
        merged = merge_samples(merged, d.samples)
    return merged


def check_same(got: list[RequestDelta], want: list[RequestDelta]) -> None:
    assert [d.finished for d in got] == [False] * (len(got) - 1) + [True]
    assert got[0].replica == "r0" and not got[0].samples  # one admission, first
    assert all(d.request_id == "req" for d in got)
    assert {d.num_prompt_tokens for d in got} == {want[0].num_prompt_tokens}
    for a, b in zip(samples(got), samples(want), strict=True):
        assert (a.index, a.token_ids, a.text) == (b.index, b.token_ids, b.text)
        assert (a.finish_reason, a.stop_reason) == (b.finish_reason, b.stop_reason)
        if b.logprobs is not None:
            assert a.logprobs is not None and len(a.logprobs) == len(b.logprobs)
            for x, y in zip(a.logprobs, b.logprobs, strict=True):
                assert x.keys() == y.keys() and x == pytest.approx(y, abs=1e-4)
        if b.cumulative_logprob is not None:
            assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob, abs=1e-3)


@pytest.mark.parametrize("case", CASES)
def test_a_cut_stream_goes_on_exactly_as_the_uninterrupted_one(
    replica: LLMReplica, runner: asyncio.Runner, case: str
) -> None:
    params = CASES[case]
    want, reasons, _ = runner.run(client_view(replica, params, []))
    assert reasons == []
    tokens = sum(len(s.token_ids) for d in want for s in d.samples)
    assert tokens >= 6 * params.n
    for cut in (0, 1, 4):
        got, reasons, cutting = runner.run(client_view(replica, params, [cut]))
        check_same(got, want)
        assert reasons == [REPLICA_FAILED] * cutting.made
        assert cutting.made == 1 or cut > 0  # a first token always comes alone
        continuations = cutting.opened[1:]
        if cut == 0:  # nothing passed on yet: the request again, whole
            assert [r.params for r in continuations] == [params]
            continue
        # One continuation per unfinished sample, each n=1 with its own sample index.
        indices = [r.params.sample_index for r in continuations]
        assert indices == sorted(set(indices)) and set(indices) <= set(range(params.n))
        assert all(r.params.n == 1 for r in continuations)
        for r in continuations:
            k = r.params.output_offset
            assert r.prompt_token_ids == cutting.opened[0].prompt_token_ids + [
                t for t in samples(got)[r.params.sample_index].token_ids[:k]
            ]


@pytest.mark.parametrize("failure", FAILURES)
def test_a_continuation_that_fails_moves_again_until_the_limit(
    replica: LLMReplica, runner: asyncio.Runner, failure: str
) -> None:
    params = CASES["seeded-n2-logprobs"]
    want, _, _ = runner.run(client_view(replica, params, []))
    # The first stream cut after its first token delta, sample 0's continuation before
    # its first (a lagging stream may merge the first stream's rest into one delta).
    got, reasons, cutting = runner.run(
        client_view(replica, params, [1, 0, None, None], FAILURES[failure])
    )
    check_same(got, want)
    reason = REPLICA_FAILED if failure == "cut" else failure
    assert reasons == [reason] * cutting.made and cutting.made >= 1
    if cutting.made == 2:
        assert [r.params.sample_index for r in cutting.opened[1:]] == [0, 1, 0]
        assert cutting.opened[3].params.output_offset == cutting.opened[1].params.output_offset
    # With one migration allowed the second failure stands, as it would without migration
    # (both cut before their first token: the request, then its resubmission).
    with pytest.raises(Exception) as err:
        runner.run(client_view(replica, params, [0, 0, None], FAILURES[failure], limit=1))
    assert type(err.value) is type(FAILURES[failure]())


def test_a_request_cut_before_its_first_token_is_resubmitted_whole(
    replica: LLMReplica, runner: asyncio.Runner
) -> None:
    params = dataclasses.replace(CASES["seeded-n2-logprobs"], prompt_logprobs=1)
    want, _, _ = runner.run(client_view(replica, params, []))
    got, reasons, cutting = runner.run(client_view(replica, params, [0]))
    check_same(got, want)
    assert reasons == [REPLICA_FAILED]
    # Nothing was passed on: the same request (n=2, prompt logprobs), under a new id.
    assert cutting.opened[1].params == params and cutting.opened[1].request_id == "req-m1"
    assert [d.prompt_logprobs for d in got if d.prompt_logprobs] == [
        d.prompt_logprobs for d in want if d.prompt_logprobs
    ]


def test_held_back_stop_strings_cross_the_seam(replica: LLMReplica, runner: asyncio.Runner) -> None:
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    whole, _, _ = runner.run(client_view(replica, free, []))
    text = samples(whole)[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 6]
    assert len(stop.strip()) >= 3, text
    params = dataclasses.replace(free, stop=[stop])
    want, _, _ = runner.run(client_view(replica, params, []))
    assert samples(want)[0].finish_reason == "stop"
    for cut in range(len(samples(want)[0].token_ids)):
        got, _, _ = runner.run(client_view(replica, params, [cut]))
        check_same(got, want)


# -- the scale-in hand-off, through ServeBackend over a stand-in for Serve's handle ------


class Stream:
    """A replica stream as Serve's handle returns it: the deltas of `script`, each after
    `pace_s`; `cancel()` ends it (the replica aborts the request)."""

    def __init__(self, script: list[RequestDelta], pace_s: float) -> None:
        self.script, self.pace_s = script, pace_s
        self.cancelled = asyncio.Event()

    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self) -> bytes:
        if not self.script:
            raise StopAsyncIteration
        sleep = asyncio.ensure_future(asyncio.sleep(self.pace_s))
        cancel = asyncio.ensure_future(self.cancelled.wait())
        await asyncio.wait({sleep, cancel}, return_when=asyncio.FIRST_COMPLETED)
        sleep.cancel()
        cancel.cancel()
        if self.cancelled.is_set():
            raise StopAsyncIteration
        return encode_delta(self.script.pop(0))

    def cancel(self) -> None:
        self.cancelled.set()


class Handle:
    """Two replicas: the first request goes to "leaver", its continuation to "stayer"."""

    deployment_name = "EngineReplica"

    def __init__(self) -> None:
        self.calls: list[ReplicaRequest] = []
        self.generate = self

    def options(self, **_: Any) -> Handle:
        return self

    def remote(self, request: ReplicaRequest) -> Stream:
        self.calls.append(request)
        replica = "leaver" if len(self.calls) == 1 else "stayer"
        k = request.params.output_offset
        script = [RequestDelta(request.request_id, 3, [], False, replica=replica)]
        script += [
            RequestDelta(request.request_id, 3, [token(t, t == 9)], t == 9) for t in range(k, 10)
        ]
        return Stream(script, pace_s=0.05)


def token(t: int, last: bool) -> Any:
    from pagefleet.engine import CompletionOutputDelta

    return CompletionOutputDelta(0, [100 + t], f"t{t}", finish_reason="length" if last else None)


def test_a_leaving_replicas_streams_are_handed_off_after_the_short_drain(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ingress_module, "HAND_OFF_PERIOD_S", 0.02)
    monkeypatch.setattr(ingress_module.serve, "get_replica_context", lambda: None)
    handle = Handle()
    config = ServeConfig(model="m", migration_drain_s=0.1)
    backend = ServeBackend(handle, None, config)  # type: ignore[arg-type]
    request = ReplicaRequest("req", [1, 2, 3], SamplingParams(max_tokens=10, temperature=0))

    async def client() -> list[RequestDelta]:
        got = []
        async for d in backend.generate(request):
            got.append(d)
            if len(got) == 3:  # two tokens in: Serve stops offering the replica
                leaving.offered({"stayer"})
        return got

    counter = backend._migrated.labels(ingress=backend.ingress_id, reason=SCALE_IN)
    before = counter._value.get()
    leaving.offered({"leaver", "stayer"})
    got = asyncio.run(client())
    assert [t for d in got for s in d.samples for t in s.token_ids] == list(range(100, 110))
    assert "".join(s.text for d in got for s in d.samples) == "".join(f"t{t}" for t in range(10))
    assert [d.finished for d in got] == [False] * (len(got) - 1) + [True]
    (_, continuation) = handle.calls
    assert 2 <= continuation.params.output_offset < 10
    assert counter._value.get() == before + 1


def test_without_migration_a_cut_stream_is_a_503(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ingress_module.serve, "get_replica_context", lambda: None)

    class Cut(Handle):
        def remote(self, request: ReplicaRequest) -> Stream:
            self.calls.append(request)
            admitted = RequestDelta(request.request_id, 3, [], False, replica="leaver")
            return Stream([admitted, RequestDelta("req", 3, [token(0, False)], False)], 0.0)

    handle = Cut()
    backend = ServeBackend(handle, None, ServeConfig(model="m", migration_limit=0))  # type: ignore[arg-type]
    request = ReplicaRequest("req", [1, 2, 3], SamplingParams(max_tokens=10))

    async def client() -> None:
        async for _ in backend.generate(request):
            pass

    with pytest.raises(APIError) as err:
        asyncio.run(client())
    assert err.value.status == 503 and len(handle.calls) == 1


def test_a_replica_lost_after_the_final_delta_moves_nothing(
    replica: LLMReplica, runner: asyncio.Runner
) -> None:
    params = CASES["seeded-n2-logprobs"]
    want, _, _ = runner.run(client_view(replica, params, []))

    async def then_dies(request: ReplicaRequest) -> AsyncIterator[RequestDelta]:
        async for delta in replica.generate(request):
            yield delta
        raise ActorDiedError()

    async def view() -> tuple[list[RequestDelta], list[str]]:
        reasons: list[str] = []
        request = ReplicaRequest("req", prompt_ids(replica.config.model)[0], params)
        stream = MigratingStream(request, then_dies, 3, reasons.append)
        return [d async for d in stream.deltas()], reasons

    got, reasons = runner.run(view())
    check_same(got, want)
    assert reasons == []


# -- over HTTP: the API layer sees one continuous stream --------------------------------


MOVES: list[str] = []  # CutOnce's migrations, by reason


class CutOnce(LocalBackend):
    """Every request's first replica stream cut after its first token delta (the
    continuations run uncut)."""

    def generate(self, request: ReplicaRequest) -> AsyncIterator[RequestDelta]:
        cutting = Cutting(self.replica, [1], stream_cut)
        return MigratingStream(request, cutting.open, 3, MOVES.append).deltas()


def streamed(h: Harness, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """Per choice: its text (or content), token ids, logprobs and finish; and the usage."""
    out: dict[str, Any] = {"usage": None}
    for event in sse_events(h, path, {**body, "stream": True, "return_token_ids": True}):
        out["usage"] = event.get("usage") or out["usage"]
        for c in event["choices"]:
            choice = out.setdefault(c["index"], {"text": "", "ids": [], "lp": [], "end": None})
            choice["text"] += c.get("text") or (c.get("delta") or {}).get("content") or ""
            choice["ids"] += c.get("token_ids") or []
            choice["lp"] += ((c.get("logprobs") or {}).get("token_logprobs")) or []
            choice["end"] = c["finish_reason"] or choice["end"]
    return out


def test_the_http_stream_of_a_moved_request_is_the_uninterrupted_one(llama_dir: str) -> None:
    config = {"engine": {"num_kv_blocks": 128, "max_num_seqs": 8}, "limits": {"max_n": 4}}
    with (
        serving(llama_dir, config) as whole,
        serving(llama_dir, config, backend_class=CutOnce) as cut,
    ):
        plain = {"model": "tiny", "prompt": "seam test", "max_tokens": 24, "ignore_eos": True}
        text = streamed(whole, "/v1/completions", {**plain, "temperature": 0})[0]["text"]
        stop = text[len(text) // 2 : len(text) // 2 + 5]
        bodies = [
            ("/v1/completions", {**plain, "temperature": 0, "stop": [stop]}),
            ("/v1/completions", {**plain, "seed": 5, "n": 2, "logprobs": 2}),
            (
                "/v1/chat/completions",
                {
                    "model": "tiny",
                    "messages": [{"role": "user", "content": "a record"}],
                    "max_tokens": 40,
                    "seed": 3,
                    "response_format": {
                        "type": "json_schema",
                        "json_schema": {"name": "r", "schema": SCHEMA},
                    },
                    "stream_options": {"include_usage": True},
                },
            ),
        ]
        moved = 0
        for path, body in bodies:
            MOVES.clear()
            want, got = streamed(whole, path, body), streamed(cut, path, body)
            # One move, unless a lagging stream merged all after the first token.
            assert MOVES in ([], [REPLICA_FAILED]), (path, body)
            moved += len(MOVES)
            assert got.keys() == want.keys() and got["usage"] == want["usage"]
            for k in want.keys() - {"usage"}:
                assert want[k]["ids"], (path, k)
                lp = got[k].pop("lp")
                assert lp == pytest.approx(want[k].pop("lp"), abs=1e-4), (path, k)
                assert got[k] == want[k], (path, k)
        assert moved >= 1
