"""The typed hand-offs between the engine's stages.

    InputProcessor --EngineRequest--> TokenEngine and OutputProcessor
    TokenEngine --TokenStepOutput--> OutputProcessor --ProcessedOutputs--> LLMEngine
    LLMEngine --RequestOutputDelta--> EngineCore's caller (output_delta.py)

Each is plain data, built fresh for the hand-off: nothing in it is a list the
producer goes on mutating.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .output_delta import RequestOutputDelta
from .sampling_params import SamplingParams


@dataclass(frozen=True)
class EngineRequest:
    """A validated request: the prompt as token ids, ready to schedule."""

    request_id: str
    prompt: str | None  # the prompt's text, when the caller gave one
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float  # time.monotonic() when the engine accepted it
    cache_salt: str | None = None  # shares prefix-cache blocks only with the same salt


# SampleUpdate and RequestUpdate are made for every token of every request: plain
# slotted classes, cheaper to build than frozen dataclasses. Nothing mutates them after
# the token engine hands them over.


@dataclass(slots=True)
class SampleUpdate:
    """One sample of a request after a step (token None: it sampled nothing this step)."""

    index: int
    token: int | None
    # {token id: logprob} of the chosen token and the top-k, when the request asked.
    logprobs: dict[int, float] | None
    chosen_logprob: float | None  # when cumulative logprobs are needed (logprobs, best_of)
    # Set once the core finished the sample: "stop" (EOS, a stop token or a complete
    # grammar), "length" or "abort". Stop strings are decided on the output side.
    finish_reason: str | None
    stop_reason: int | None  # the stop token id, for a stop token
    # "stop" because this token completed the sample's grammar (structured outputs): an
    # ordinary token whose text is output, unlike an EOS or stop token's.
    grammar_complete: bool = False


@dataclass(slots=True)
class RequestUpdate:
    """What one step did to one request: every sample's state, in index order."""

    request_id: str
    samples: list[SampleUpdate]
    # Prompt-token logprobs computed this step, continuing those before.
    new_prompt_logprobs: list[dict[int, float]]
    # An embedding request's pooled vector, on the update that finishes it.
    embedding: list[float] | None = None

    @property
    def has_new_token(self) -> bool:
        return any(s.token is not None for s in self.samples)


@dataclass(frozen=True)
class TokenStepOutput:
    """One token-engine step: when it ran, who started, what changed."""

    step_time: float  # time.monotonic() when the step's tokens were known
    scheduled_time: float  # time.monotonic() when the step was scheduled
    first_scheduled: list[str]  # request ids scheduled for the first time in this step
    updates: list[RequestUpdate]
    num_preempted: int = 0  # sequences preempted (their blocks freed) to make room
    # Every request scheduled in the step (once each): those a failure after it must end.
    scheduled: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class StopStringHit:
    """A sample the output side ended with a stop string; the token engine must free it."""

    request_id: str
    index: int
    stop: str


@dataclass(frozen=True)
class ProcessedOutputs:
    """What the output side made of one token-engine step."""

    deltas: list[RequestOutputDelta]
    stop_string_hits: list[StopStringHit]
