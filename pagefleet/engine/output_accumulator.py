"""Deltas in, vLLM's cumulative `RequestOutput`s out, on the caller's side of the core."""

from __future__ import annotations

from dataclasses import dataclass, field

from .output_delta import CompletionOutputDelta, RequestOutputDelta
from .outputs import CompletionOutput, RequestOutput


@dataclass
class _Sample:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    def apply(self, d: CompletionOutputDelta) -> None:
        self.token_ids += d.token_ids
        self.text += d.text
        if d.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs += d.logprobs
        self.cumulative_logprob = d.cumulative_logprob
        self.finish_reason, self.stop_reason = d.finish_reason, d.stop_reason


@dataclass
class _Request:
    prompt: str | None
    prompt_token_ids: list[int]
    samples: dict[int, _Sample] = field(default_factory=dict)
    prompt_logprobs: list[dict[int, float] | None] | None = None


class OutputAccumulator:
    """Each request's outputs so far, by request id, from `add` until its finishing delta.

    `apply` returns the request as of that delta, in lists of its own (the next
    delta never changes an output handed out), with `new_token_ids` and
    `new_text` holding what the delta added. A best_of request's finishing
    delta names the samples kept (`kept`): the output holds those, renumbered
    0..n-1 in that order.
    """

    def __init__(self) -> None:
        self._requests: dict[str, _Request] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int]) -> None:
        self._requests[request_id] = _Request(prompt, prompt_token_ids)

    def discard(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def apply(self, delta: RequestOutputDelta, request_id: str | None = None) -> RequestOutput:
        """`delta` into its request's output (named `request_id` when given)."""
        req, new, order = self._take(delta)
        return _request_output(request_id or delta.request_id, req, delta, new, order)

    def apply_final(self, delta: RequestOutputDelta) -> RequestOutput | None:
        """`delta` taken in; the whole output only once it finished (offline use: no
        output is copied per step)."""
        req, new, order = self._take(delta)
        return _request_output(delta.request_id, req, delta, new, order) if delta.finished else None

    def _take(
        self, delta: RequestOutputDelta
    ) -> tuple[_Request, dict[int, CompletionOutputDelta], list[int]]:
        req = self._requests[delta.request_id]
        if delta.prompt_logprobs is not None:
            if req.prompt_logprobs is None:
                req.prompt_logprobs = []
            req.prompt_logprobs += delta.prompt_logprobs
        new: dict[int, CompletionOutputDelta] = {}
        for d in delta.outputs:
            req.samples.setdefault(d.index, _Sample()).apply(d)
            new[d.index] = d
        if delta.finished:
            del self._requests[delta.request_id]
        return req, new, delta.kept if delta.kept is not None else sorted(req.samples)


def _request_output(
    request_id: str,
    req: _Request,
    delta: RequestOutputDelta,
    new: dict[int, CompletionOutputDelta],
    order: list[int],
) -> RequestOutput:
    m = delta.metrics
    return RequestOutput(
        request_id=request_id,
        prompt=req.prompt,
        prompt_token_ids=list(req.prompt_token_ids),
        outputs=[_output(pos, req.samples[i], new.get(i)) for pos, i in enumerate(order)],
        finished=delta.finished,
        prompt_logprobs=None if req.prompt_logprobs is None else list(req.prompt_logprobs),
        metrics=m.copy(),
        embedding=delta.embedding,
    )


def _output(index: int, s: _Sample, new: CompletionOutputDelta | None) -> CompletionOutput:
    return CompletionOutput(
        index=index,
        text=s.text,
        token_ids=list(s.token_ids),
        finish_reason=s.finish_reason,
        stop_reason=s.stop_reason,
        cumulative_logprob=s.cumulative_logprob,
        logprobs=None if s.logprobs is None else list(s.logprobs),
        new_token_ids=[] if new is None else list(new.token_ids),
        new_text="" if new is None else new.text,
    )
