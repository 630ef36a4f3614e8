"""What one engine step adds to one request: the engine core's per-step message.

The core never sends a request's state, only its news: the tokens, text and
logprobs that came in this step, and the finish. Nothing sent once is sent
again and prompt ids never are, so a step's message costs O(requests that
moved), whatever the prompts' lengths and however much they have generated
(vLLM v1's EngineCoreOutput has the same shape). A caller that wants vLLM's
cumulative `RequestOutput` builds it with an `OutputAccumulator`; a server
relays the deltas as they are.

These are msgspec Structs encoded as arrays (no field names on the wire):
the core process sends them as typed msgpack, never pickle.
"""

from __future__ import annotations

from typing import TypeVar

import msgspec

from .request_metrics import RequestMetrics

T = TypeVar("T")
Logprobs = dict[int, float]  # {token id: logprob}: the chosen token and the top-k


class CompletionOutputDelta(msgspec.Struct, array_like=True):
    """One sample's news from one step."""

    index: int
    token_ids: list[int]
    text: str
    # Per new token, when the request asked for logprobs.
    logprobs: list[Logprobs] | None = None
    # The running total (not a delta: one float, whatever the length), when needed.
    cumulative_logprob: float | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None


class RequestOutputDelta(msgspec.Struct, array_like=True):
    """One request's news from one step (or several merged)."""

    request_id: str
    outputs: list[CompletionOutputDelta]
    finished: bool
    metrics: RequestMetrics
    # Prompt-token logprobs computed since the previous delta (None for the first token).
    prompt_logprobs: list[Logprobs | None] | None = None
    # best_of, on the finishing delta: the sample indices kept, most likely first.
    kept: list[int] | None = None
    # An embedding request's pooled, normalized vector, on its finishing delta.
    embedding: list[float] | None = None


def merge(first: RequestOutputDelta, then: RequestOutputDelta) -> RequestOutputDelta:
    """The two deltas of one request as one (what a lagging consumer is handed at once)."""
    return RequestOutputDelta(
        request_id=first.request_id,
        outputs=merge_samples(first.outputs, then.outputs),
        finished=then.finished,
        metrics=then.metrics,
        prompt_logprobs=concat(first.prompt_logprobs, then.prompt_logprobs),
        kept=then.kept if then.kept is not None else first.kept,
        embedding=then.embedding if then.embedding is not None else first.embedding,
    )


def merge_samples(
    first: list[CompletionOutputDelta], then: list[CompletionOutputDelta]
) -> list[CompletionOutputDelta]:
    """Two deltas' samples as one list, by index: each sample's news in order."""
    by_index = {c.index: c for c in first}
    for c in then:
        before = by_index.get(c.index)
        by_index[c.index] = c if before is None else merge_sample(before, c)
    return [by_index[i] for i in sorted(by_index)]


def merge_sample(a: CompletionOutputDelta, b: CompletionOutputDelta) -> CompletionOutputDelta:
    """One sample's two deltas as one: the news of both in order, the later finish."""
    return CompletionOutputDelta(
        index=a.index,
        token_ids=a.token_ids + b.token_ids,
        text=a.text + b.text,
        logprobs=concat(a.logprobs, b.logprobs),
        cumulative_logprob=b.cumulative_logprob,
        finish_reason=b.finish_reason or a.finish_reason,
        stop_reason=b.stop_reason if b.finish_reason else a.stop_reason,
    )


def concat(a: list[T] | None, b: list[T] | None) -> list[T] | None:
    """Two optional lists one after the other (None: neither had one)."""
    if b is None:
        return a
    return b if a is None else a + b
