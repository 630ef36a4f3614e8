"""Mid-stream migration: a request whose engine replica is lost goes on on another one.

The ingress keeps, per sample of each request, what it has passed on: the token ids,
the running cumulative logprob and whether the sample finished (`Progress`). When the
replica's stream fails in a way another replica can serve around (`migration_reason`:
the actor died, its engine died or lost a rank, the stream ended before the request's
final delta, or the replica, being stopped by a scale-in, ended it with a migrate
signal), each unfinished sample is resubmitted as a continuation: the prompt followed by
that sample's tokens, `output_offset` their count (over an earlier offset), `sample_index`
the sample's, n = 1, every other sampling setting as it was. The engine replays the
sample's state over those tokens (text, held-back stop strings, penalties, the grammar),
counts max_tokens and min_tokens over the whole output, and draws a seeded token's noise
from (seed, sample index, output index): a greedy or seeded sample goes on exactly as the
uninterrupted one would have.

Invariants of the merged stream the client reads:
- every token and character is passed on once, in order (the continuation's first text
  is what the lost replica was still holding back);
- a continuation's deltas carry the sample's own index, the original prompt's length,
  the cumulative logprob counted on from the earlier tokens', and no admission (the
  client saw its request admitted) and no prompt logprobs (passed on already);
- the request finishes once every sample has.

A request none of whose tokens was passed on yet (still in its prefill, non-streamed,
best_of) is resubmitted whole, unchanged but for its id. At most `migration_limit`
migrations per request; beyond it, or for any other failure, the error stands.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import DeploymentUnavailableError

from pagefleet.engine import EngineDeadError

from .http.errors import APIError
from .replica_messages import ReplicaRequest, RequestDelta, SampleDelta

# Why a request moved (the `reason` label of pagefleet:migrated_requests).
REPLICA_FAILED = "replica_failed"  # the actor died, or its stream ended early
ENGINE_DEAD = "engine_dead"  # the replica's engine core died or lost a rank
SCALE_IN = "scale_in"  # the replica is being stopped: the ingress cut the stream to move it
MIGRATION_REASONS = (REPLICA_FAILED, ENGINE_DEAD, SCALE_IN)
MIGRATED_REQUESTS = "pagefleet:migrated_requests"

Opener = Callable[[ReplicaRequest], AsyncIterator[RequestDelta]]


class ReplicaLost(APIError):
    """A replica's stream ended before its request did (a 503 unless it migrates)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(503, message)
        self.reason = reason


def stream_cut() -> ReplicaLost:
    # A killed actor's stream can end with no error of its own.
    return ReplicaLost(
        REPLICA_FAILED, "the engine replica ended the request's stream before it finished"
    )


def handed_off() -> ReplicaLost:
    return ReplicaLost(SCALE_IN, "the engine replica stopped (scale-in) before the request ended")


def migrated_requests_counter(ingress: str) -> Any:
    """`pagefleet:migrated_requests` in this process's default registry (the ingress's
    router counters' registry, pushed to the hub with them), each reason's series at 0."""
    from prometheus_client import Counter

    from .metrics import registered

    counter = registered(
        Counter,
        MIGRATED_REQUESTS,
        "Requests that went on on another engine replica, by ingress replica and reason.",
        ("ingress", "reason"),
    )
    for reason in MIGRATION_REASONS:
        counter.labels(ingress=ingress, reason=reason)
    return counter


def migration_reason(exc: BaseException) -> str | None:
    """Why `exc` lets its request move to another replica; None: it does not."""
    if isinstance(exc, ReplicaLost):
        return exc.reason
    cause = exc.cause if isinstance(exc, RayTaskError) else None
    if isinstance(exc, EngineDeadError) or isinstance(cause, EngineDeadError):
        return ENGINE_DEAD
    if isinstance(exc, RayActorError | DeploymentUnavailableError) and cause is None:
        return REPLICA_FAILED
    return None


@dataclasses.dataclass
class SampleProgress:
    """One sample as the client has it so far."""

    token_ids: list[int] = dataclasses.field(default_factory=list)
    cumulative_logprob: float | None = None
    finished: bool = False


@dataclasses.dataclass(frozen=True)
class Leg:
    """One replica stream of a request: the whole request (`sample` None), or the
    continuation of one of its samples."""

    request: ReplicaRequest
    sample: int | None = None
    # The sample's cumulative logprob when the continuation began (its deltas count on).
    base_logprob: float = 0.0


class Progress:
    """What the client was passed of one request; the continuations that go on from it."""

    def __init__(self, request: ReplicaRequest) -> None:
        self.request = request
        self.samples = [SampleProgress() for _ in range(request.params.n)]
        self.admitted = False
        self.migrations = 0
        self.prompt_logprobs_passed = 0
        # A resubmitted request's prompt logprobs the client has already (by request id).
        self._skip: dict[str, int] = {}

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)

    @property
    def started(self) -> bool:
        """Whether any token was passed on."""
        return any(s.token_ids for s in self.samples)

    def leg_finished(self, leg: Leg) -> bool:
        """Whether everything `leg` streams has reached the client."""
        return self.finished if leg.sample is None else self.samples[leg.sample].finished

    def take(self, leg: Leg, delta: RequestDelta) -> RequestDelta | None:
        """`delta` of `leg` as the client's stream carries it (None: nothing to pass on)."""
        if leg.sample is not None:
            delta = self._relabel(leg.sample, leg.base_logprob, delta)
        else:
            delta = self._without_passed_prompt_logprobs(delta)
            if self.admitted and not (delta.samples or delta.finished or delta.prompt_logprobs):
                return None  # a resubmitted request's admission: the client saw one
        self.admitted = True
        self.prompt_logprobs_passed += len(delta.prompt_logprobs or ())
        for s in delta.samples:
            self._record(s)
        if leg.sample is not None:
            return msgspec.structs.replace(delta, finished=self.finished)
        if delta.finished:
            for sample in self.samples:
                sample.finished = True
        return delta

    def _without_passed_prompt_logprobs(self, delta: RequestDelta) -> RequestDelta:
        """A resubmitted request's delta without the prompt logprobs passed on before."""
        skip = self._skip.get(delta.request_id, 0)
        if delta.request_id == self.request.request_id:
            return delta
        if not skip or not delta.prompt_logprobs:
            return msgspec.structs.replace(delta, request_id=self.request.request_id)
        self._skip[delta.request_id] = max(0, skip - len(delta.prompt_logprobs))
        return msgspec.structs.replace(
            delta,
            request_id=self.request.request_id,
            prompt_logprobs=delta.prompt_logprobs[skip:] or None,
        )

    def _record(self, s: SampleDelta) -> None:
        sample = self.samples[s.index]
        sample.token_ids.extend(s.token_ids)
        if s.cumulative_logprob is not None:
            sample.cumulative_logprob = s.cumulative_logprob
        sample.finished = sample.finished or s.finish_reason is not None

    def _relabel(self, index: int, base: float, delta: RequestDelta) -> RequestDelta:
        """A continuation's delta as its sample's: index, prompt length, running logprob."""
        samples = [
            msgspec.structs.replace(
                s,
                index=index,
                cumulative_logprob=None
                if s.cumulative_logprob is None
                else base + s.cumulative_logprob,
            )
            for s in delta.samples
        ]
        num_prompt = len(self.request.prompt_token_ids)
        return RequestDelta(self.request.request_id, num_prompt, samples, delta.finished)

    def resume(self, leg: Leg) -> list[Leg]:
        """The legs that go on from `leg`'s unfinished samples (one request whole, while
        nothing was passed on yet)."""
        self.migrations += 1
        attempt = f"{self.request.request_id}-m{self.migrations}"
        if leg.sample is None and not self.started:
            self._skip[attempt] = self.prompt_logprobs_passed
            return [Leg(dataclasses.replace(self.request, request_id=attempt))]
        indices = range(len(self.samples)) if leg.sample is None else [leg.sample]
        return [
            Leg(
                self._continuation(i, f"{attempt}-{i}"),
                i,
                self.samples[i].cumulative_logprob or 0.0,
            )
            for i in indices
            if not self.samples[i].finished
        ]

    def _continuation(self, index: int, request_id: str) -> ReplicaRequest:
        """Sample `index` resubmitted: prompt + its tokens, offset and index set, n = 1."""
        r, tokens = self.request, self.samples[index].token_ids
        params = dataclasses.replace(
            r.params,
            n=1,
            best_of=None,
            prompt_logprobs=None,
            output_offset=r.params.output_offset + len(tokens),
            sample_index=r.params.sample_index + index,
        )
        return dataclasses.replace(
            r,
            request_id=request_id,
            prompt_token_ids=[*r.prompt_token_ids, *tokens],
            params=params,
            replica=None,
        )


class MigratingStream:
    """One request's deltas across the replicas it runs on.

    The first leg is read as it comes; once it fails with a migratable error
    (`migration_reason`) and the request has migrations left, its continuations run
    concurrently (one per unfinished sample), their deltas merged into one stream.
    """

    def __init__(
        self,
        request: ReplicaRequest,
        open_stream: Opener,
        migration_limit: int,
        on_migrate: Callable[[str], None],
    ) -> None:
        self.progress = Progress(request)
        self._open = open_stream
        self._limit = migration_limit
        self._on_migrate = on_migrate

    async def deltas(self) -> AsyncIterator[RequestDelta]:
        first = Leg(self.progress.request)
        try:
            async for delta in self._open(first.request):
                out = self.progress.take(first, delta)
                if out is not None:
                    yield out
            if not self.progress.finished:
                raise stream_cut()
        except Exception as e:
            if self.progress.finished:
                return  # the replica failed after the request's final delta
            legs = self._resume(first, e)
        else:
            return
        async for delta in self._merged(legs):
            yield delta

    def _resume(self, leg: Leg, exc: Exception) -> list[Leg]:
        """The legs that go on from `leg`, or `exc` raised when the request cannot move."""
        reason = migration_reason(exc)
        if reason is None or self.progress.migrations >= self._limit:
            raise exc
        self._on_migrate(reason)
        return self.progress.resume(leg)

    async def _merged(self, legs: list[Leg]) -> AsyncIterator[RequestDelta]:
        """The legs' deltas as they come; a failed leg is replaced by its continuation."""
        queue: asyncio.Queue[tuple[Leg, Any]] = asyncio.Queue()
        tasks: set[asyncio.Task[None]] = set()
        self._start(legs, queue, tasks)
        try:
            while tasks or not queue.empty():
                leg, item = await queue.get()
                if isinstance(item, Exception):
                    if not self.progress.leg_finished(leg):
                        self._start(self._resume(leg, item), queue, tasks)
                    continue
                out = self.progress.take(leg, item)
                if out is not None:
                    yield out
                if self.progress.finished:
                    return
        finally:
            for task in tasks:
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(*tasks, return_exceptions=True)

    def _start(
        self, legs: list[Leg], queue: asyncio.Queue[tuple[Leg, Any]], tasks: set[asyncio.Task[None]]
    ) -> None:
        for leg in legs:
            task = asyncio.ensure_future(self._pump(leg, queue))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    async def _pump(self, leg: Leg, queue: asyncio.Queue[tuple[Leg, Any]]) -> None:
        """One leg's deltas into `queue`, then stream_cut() if it ended unfinished, or
        what it raised."""
        finished = False
        try:
            async for delta in self._open(leg.request):
                finished = finished or delta.finished
                queue.put_nowait((leg, delta))
            if not finished:
                queue.put_nowait((leg, stream_cut()))
        except Exception as e:
            queue.put_nowait((leg, e))
