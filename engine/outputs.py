"""What the engine hands back for each request (vLLM's RequestOutput shape)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # the stop string or stop token that ended it


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    # What this step added, for streaming.
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    metrics: dict[str, float] = field(default_factory=dict)
