"""OpenAI request and response bodies (pydantic), with vLLM's extra sampling fields.

Unknown request fields are ignored, as vLLM and OpenAI do; wrong types and
values fail validation, which the API turns into OpenAI's error body. The
ranges here are the engine's own (`SamplingParams`), so the OpenAPI document
FastAPI derives from these models says exactly what the server accepts; the
limits an operator configures (`config.Limits`) are added to that document by
`api.py`.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

from pagefleet.engine.sampling import MAX_LOGPROBS

NonNegInt = Annotated[int, Field(ge=0)]
# A token id: an integer proper (pydantic's lax mode would take true/false as 1/0).
TokenId = Annotated[StrictInt, Field(ge=0)]
NonEmptyStr = Annotated[str, Field(min_length=1)]
# torch's generators take 64-bit seeds; a sample's seed is seed + its index (vLLM's range).
_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


# -- errors -----------------------------------------------------------------------


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# -- requests -----------------------------------------------------------------------


class StreamOptions(OpenAIModel):
    include_usage: bool = False


class SamplingFields(OpenAIModel):
    """Fields both endpoints share (OpenAI's and vLLM's extras)."""

    model: str | None = Field(None, description="the served model's name (default: it)")
    temperature: float | None = Field(None, ge=0, le=100, description="0 = greedy; default 1")
    top_p: float | None = Field(None, gt=0, le=1, description="nucleus mass; default 1 (off)")
    n: int = Field(1, ge=1, description="samples to return")
    stream: bool = Field(False, description="server-sent events instead of one JSON body")
    stream_options: StreamOptions | None = None
    stop: NonEmptyStr | list[NonEmptyStr] | None = Field(
        None, description="strings that end a sample (not included in its text)"
    )
    seed: int | None = Field(None, ge=_I64_MIN, le=_I64_MAX, description="per-request seed")
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    user: str | None = Field(None, description="accepted and ignored")
    # vLLM's extras
    top_k: int | None = Field(
        None, ge=-1, le=2**31 - 1, description="-1 or 0: off; else the k most likely tokens"
    )
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, le=2)
    min_tokens: NonNegInt = Field(0, description="tokens before EOS or a stop may end a sample")
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = Field(None, description="token ids that end a sample")
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True


TokenIds = Annotated[list[TokenId], Field(min_length=1)]
PromptInput = (
    NonEmptyStr
    | Annotated[list[NonEmptyStr], Field(min_length=1)]
    | TokenIds
    | Annotated[list[TokenIds], Field(min_length=1)]
)


class StructuredOutputFields(OpenAIModel):
    """Structured output and tools: read so that a request asking for them is refused by
    name (400) rather than answered 200 with free text. `response_format: {"type":
    "text"}`, `tool_choice: "none"` and an empty `tools` ask for nothing and pass."""

    response_format: dict[str, Any] | None = Field(
        None, description='only {"type": "text"} (structured output is not supported)'
    )
    guided_json: Any = Field(None, description="not supported (400)")
    guided_regex: Any = Field(None, description="not supported (400)")
    guided_choice: Any = Field(None, description="not supported (400)")
    guided_grammar: Any = Field(None, description="not supported (400)")
    structured_outputs: Any = Field(None, description="not supported (400)")


class CompletionRequest(SamplingFields, StructuredOutputFields):
    prompt: PromptInput = Field(
        description="a string, a list of strings, a list of token ids or a list of such lists"
    )
    max_tokens: int | None = Field(
        16,
        ge=1,
        description="new tokens at most (OpenAI's default 16; null: what the context leaves)",
    )
    best_of: int | None = Field(None, ge=1, description="samples generated; the best n returned")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="top logprobs per token")
    echo: bool = Field(False, description="prepend the prompt to the text")


class TextPart(OpenAIModel):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIModel):
    # "tool" and `tool_calls` are read so that they can be refused by name (the server
    # does not support tools yet), never dropped: a history with tool calls must not be
    # answered as if they were not there.
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = Field(None, description="not supported (400)")
    tool_call_id: str | None = Field(None, description="not supported (400)")

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text for p in self.content)  # as vLLM joins text parts


class ChatCompletionRequest(SamplingFields, StructuredOutputFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(
        None, ge=1, description="deprecated by OpenAI for max_completion_tokens"
    )
    max_completion_tokens: int | None = Field(
        None, ge=1, description="new tokens at most (default: what the context leaves)"
    )
    logprobs: bool = False
    top_logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="needs logprobs: true"
    )
    add_generation_prompt: bool = True
    tools: list[Any] | None = Field(None, description="not supported (400 unless empty)")
    tool_choice: Any = Field(None, description='only "none" (tools are not supported)')
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = Field(None, description="not supported (400 unless empty)")
    function_call: Any = Field(None, description='only "none" (functions are not supported)')


class TokenizeRequest(OpenAIModel):
    """A prompt or a conversation (at least one; `messages` wins when both are given)."""

    model_config = ConfigDict(
        extra="ignore",
        json_schema_extra={"anyOf": [{"required": ["prompt"]}, {"required": ["messages"]}]},
    )

    model: str | None = None
    # Absent, not null: the document says "one of the two keys", so null is refused too.
    prompt: str = Field(None, description="text to tokenize")  # type: ignore[assignment]
    messages: list[ChatMessage] = Field(  # type: ignore[assignment]
        None, min_length=1, description="a conversation, rendered by the chat template"
    )
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeRequest:
        if self.prompt is None and self.messages is None:
            raise ValueError("give `prompt` or `messages`")
        return self


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[TokenId]


# -- responses ------------------------------------------------------------------------


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagefleet"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


def dump(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(exclude_none=False)
