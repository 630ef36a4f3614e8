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

from pagefleet.engine import CompletionOutputDelta, RequestOutputDelta, SamplingParams
from pagefleet.engine.output_delta import concat, merge_samples


@dataclass(frozen=True)
class EngineInfo:
    """What the ingress needs to validate requests before they reach an engine."""

    max_model_len: int
    vocab_size: int
    block_size: int
    num_kv_blocks: int
    # Seconds the replica's start-up spent compiling its forward (None: eager).
    compile_seconds: float | None = None
    # Seconds per start-up phase, in the order they ran (`pagefleet.engine.startup.PHASES`),
    # up to the replica's readiness.
    startup_seconds: dict[str, float] | None = None


@dataclass(frozen=True)
class ReplicaRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool = True
    # A router's warm-up (`routing/scale_in.py`): the replica (its Serve unique id) the
    # router must send it to; None for every user's request.
    replica: str | None = None
    # The client's `cache_salt`: its prompt shares prefix-cache blocks only with the
    # same salt (the router hashes it the same way).
    cache_salt: str | None = None
    # The ingress's `route` span's context (W3C `traceparent`) when traces are on (`tracing.py`).
    trace_context: dict[str, str] | None = None


# One sample's news in a delta: the engine's own type (its index renumbered for best_of).
SampleDelta = CompletionOutputDelta


class RequestDelta(msgspec.Struct, array_like=True):
    request_id: str
    num_prompt_tokens: int
    samples: list[SampleDelta]
    finished: bool
    # Only in the first delta of a request that asked for prompt logprobs.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # Only in the first (admission) delta: the engine replica that took the request.
    replica: str | None = None
    # Only in the finishing delta of an embedding request: its pooled, normalized vector.
    embedding: list[float] | None = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(RequestDelta)


def encode_delta(delta: RequestDelta) -> bytes:
    return _encoder.encode(delta)


def decode_delta(data: bytes) -> RequestDelta:
    return _decoder.decode(data)


def admitted_delta(request: ReplicaRequest, replica: str | None = None) -> RequestDelta:
    """The empty first delta: the replica's engine has queued the request."""
    return RequestDelta(
        request.request_id, len(request.prompt_token_ids), [], finished=False, replica=replica
    )


def delta_of(delta: RequestOutputDelta, num_prompt_tokens: int) -> RequestDelta:
    """The engine's delta as the ingress takes it; a best_of request's finishing delta
    holds only the samples kept, renumbered in their order."""
    by_index = {c.index: c for c in delta.outputs}
    order = delta.kept if delta.kept is not None else [c.index for c in delta.outputs]
    samples = [
        c if c.index == pos else msgspec.structs.replace(c, index=pos)
        for pos, c in enumerate(by_index[i] for i in order)
    ]
    return RequestDelta(
        request_id=delta.request_id,
        num_prompt_tokens=num_prompt_tokens,
        samples=samples,
        finished=delta.finished,
        prompt_logprobs=delta.prompt_logprobs,
        embedding=delta.embedding,
    )


def merge_deltas(first: RequestDelta, then: RequestDelta) -> RequestDelta:
    """Two deltas of one request as one: what a lagging stream hands on at once."""
    return RequestDelta(
        first.request_id,
        then.num_prompt_tokens,
        merge_samples(first.samples, then.samples),
        then.finished,
        concat(first.prompt_logprobs, then.prompt_logprobs),
        first.replica or then.replica,
        then.embedding if then.embedding is not None else first.embedding,
    )
