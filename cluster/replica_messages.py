"""The hand-off between the ingress and an engine replica (plain data, no torch).

The ingress asks each replica for its `EngineInfo` once, then sends one
`ReplicaRequest` per prompt (token ids, not text: it tokenized
once, and the router reads them to find cached prefixes). The replica streams
`RequestDelta`s back: only what is new since the previous message (the engine
core's own deltas, merged when the ingress lags), so a long stream costs
O(tokens) in serialization, not O(tokens^2) as resending a cumulative output
would. The first delta of every request is empty (`admitted_delta`): the
engine has queued it. A non-streamed request then gets one delta holding
everything, after the engine has finished it (best_of's choice applied).

Through Serve a delta travels as msgpack bytes (`encode_delta` / `decode_delta`):
Ray passes bytes through as they are, where a Python object would go through
cloudpickle on the replica and back on the ingress, per token per stream.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from pagefleet.engine import RequestOutputDelta, SamplingParams


@dataclass(frozen=True)
class EngineInfo:
    """What the ingress needs to validate requests before they reach an engine."""

    max_model_len: int
    vocab_size: int
    block_size: int
    num_kv_blocks: int


@dataclass(frozen=True)
class ReplicaRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool = True


class SampleDelta(msgspec.Struct, array_like=True):
    index: int
    token_ids: list[int]
    text: str
    # Per new token: {token id: logprob} for the chosen token and the top-k.
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class RequestDelta(msgspec.Struct, array_like=True):
    request_id: str
    num_prompt_tokens: int
    samples: list[SampleDelta]
    finished: bool
    # Only in the first delta of a request that asked for prompt logprobs.
    prompt_logprobs: list[dict[int, float] | None] | None = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(RequestDelta)


def encode_delta(delta: RequestDelta) -> bytes:
    return _encoder.encode(delta)


def decode_delta(data: bytes) -> RequestDelta:
    return _decoder.decode(data)


def admitted_delta(request: ReplicaRequest) -> RequestDelta:
    """The empty first delta: the replica's engine has queued the request."""
    return RequestDelta(request.request_id, len(request.prompt_token_ids), [], finished=False)


def delta_of(delta: RequestOutputDelta, num_prompt_tokens: int) -> RequestDelta:
    """The engine's delta as the ingress takes it; a best_of request's finishing delta
    holds only the samples kept, renumbered in their order."""
    by_index = {c.index: c for c in delta.outputs}
    order = delta.kept if delta.kept is not None else [c.index for c in delta.outputs]
    samples = [
        SampleDelta(pos, c.token_ids, c.text, c.logprobs, c.finish_reason, c.stop_reason)
        for pos, c in enumerate(by_index[i] for i in order)
    ]
    return RequestDelta(
        request_id=delta.request_id,
        num_prompt_tokens=num_prompt_tokens,
        samples=samples,
        finished=delta.finished,
        prompt_logprobs=delta.prompt_logprobs,
    )


def merge_deltas(first: RequestDelta, then: RequestDelta) -> RequestDelta:
    """Two deltas of one request as one: what a lagging stream hands on at once."""
    by_index = {s.index: s for s in first.samples}
    for s in then.samples:
        a = by_index.get(s.index)
        if a is None:
            by_index[s.index] = s
            continue
        logprobs = a.logprobs
        if s.logprobs is not None:
            logprobs = s.logprobs if logprobs is None else logprobs + s.logprobs
        done = s.finish_reason is not None
        by_index[s.index] = SampleDelta(
            s.index,
            a.token_ids + s.token_ids,
            a.text + s.text,
            logprobs,
            s.finish_reason if done else a.finish_reason,
            s.stop_reason if done else a.stop_reason,
        )
    prompt = first.prompt_logprobs
    if then.prompt_logprobs is not None:
        prompt = then.prompt_logprobs if prompt is None else prompt + then.prompt_logprobs
    return RequestDelta(
        first.request_id,
        then.num_prompt_tokens,
        [by_index[i] for i in sorted(by_index)],
        then.finished,
        prompt,
    )
