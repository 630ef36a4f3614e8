"""What the engine hands back for each request (vLLM's RequestOutput shape)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .request_metrics import RequestMetrics


@dataclass
class CompletionOutput:
    """One sample of a request: everything so far, plus what the last step added."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # the stop string or stop token that ended it
    cumulative_logprob: float | None = None
    # Per output token: {token id: logprob} for the chosen token and the top-k.
    logprobs: list[dict[int, float]] | None = None
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""


@dataclass
class RequestOutput:
    """One request as of one step. Its lists and metrics are its own: later steps never change them."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    # Per prompt token (None for the first): {token id: logprob}.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    metrics: RequestMetrics | None = None
    # An embedding request's pooled, L2-normalized final hidden state (vLLM's
    # PoolingRequestOutput data), once finished.
    embedding: list[float] | None = None
