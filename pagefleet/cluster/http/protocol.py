"""OpenAI request bodies (pydantic), with vLLM's extra sampling fields (the response
bodies are `response_models.py`'s).

Unknown request fields are ignored, as vLLM and OpenAI do; wrong types and
values fail validation, which the API turns into OpenAI's error body. The
ranges here are the engine's own (`SamplingParams`), so the OpenAPI document
FastAPI derives from these models says exactly what the server accepts; the
limits an operator configures (`config.Limits`) are added to that document by
`openapi.py`. What can be checked from a request alone, against the limits, is
checked here (`check_limits`, `to_sampling_params`); what needs the engine (the
prompt's length against the context) is checked in `serving.py`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)
from pydantic.json_schema import SkipJsonSchema

from pagefleet.engine import MAX_LOGPROBS, SamplingParams, StructuredOutputsParams

from ..config import Limits
from .errors import APIError
from .tool_parsers import json_depth_exceeds

NonNegInt = Annotated[int, Field(ge=0)]
# A token id: an integer proper (pydantic's lax mode would take true/false as 1/0).
TokenId = Annotated[int, Field(ge=0)]
NonEmptyStr = Annotated[str, Field(min_length=1)]
# Seeds (and priorities) are 64-bit signed integers, vLLM's range.
_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1
# A sampling field a request leaves out: the checkpoint's default, else these (vLLM's).
_SAMPLING_DEFAULTS: dict[str, float] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
}


def _integral(value: Any) -> Any:
    """JSON Schema's integer: 5.0 is the integer 5 (in lists of token ids too)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_integral(v) for v in value]
    return value


# Every integer a request carries (a name missing from a model is skipped).
_INTEGER_FIELDS = (
    "n",
    "seed",
    "top_k",
    "min_tokens",
    "max_tokens",
    "max_completion_tokens",
    "best_of",
    "logprobs",
    "top_logprobs",
    "stop_token_ids",
    "tokens",
    "prompt",
)


class OpenAIModel(BaseModel):
    # strict: a value of the wrong JSON type is refused, not coerced (lax mode would take
    # `"logprobs": false` as 0, `"n": true` as 1 and `"n": "2"` as 2, which the schema
    # does not allow); an integral number such as 2.0 is the integer JSON Schema says it is.
    model_config = ConfigDict(extra="ignore", strict=True)

    @field_validator(*_INTEGER_FIELDS, mode="before", check_fields=False)
    @classmethod
    def _json_integers(cls, value: Any) -> Any:
        return _integral(value)


# -- requests -----------------------------------------------------------------------


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = Field(
        False, description="vLLM's: every chunk carries the usage so far"
    )
    include_obfuscation: bool = Field(True, description="accepted; no obfuscation is sent")


class RequestModel(OpenAIModel):
    """A request body: fields it does not model are kept (`model_extra`), so that
    `fields.py` can refuse those OpenAI's and vLLM's schemas know by name and log the rest."""

    model_config = ConfigDict(extra="allow", strict=True)


class SamplingFields(RequestModel):
    """Fields both endpoints share (OpenAI's and vLLM's extras)."""

    model: str | None = Field(None, description="the served model's name (default: it)")
    temperature: float | None = Field(
        None,
        ge=0,
        le=100,
        description="0 = greedy; default: the checkpoint's generation_config, else 1",
    )
    top_p: float | None = Field(
        None,
        gt=0,
        le=1,
        description="nucleus mass; default: the checkpoint's generation_config, else 1 (off)",
    )
    n: int = Field(1, ge=1, description="samples to return")
    stream: bool = Field(False, description="server-sent events instead of one JSON body")
    stream_options: StreamOptions | None = None
    stop: NonEmptyStr | list[NonEmptyStr] | None = Field(
        None, description="strings that end a sample (not included in its text)"
    )
    seed: int | None = Field(None, ge=_I64_MIN, le=_I64_MAX, description="per-request seed")
    priority: int | None = Field(
        0,
        ge=_I64_MIN,
        le=_I64_MAX,
        description="lower is sooner (vLLM's); needs engine.scheduling_policy: priority",
    )
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
    logit_bias: dict[str, float] | None = Field(
        None, description="token id (as a string) -> bias in [-100, 100] added to its logit"
    )
    allowed_token_ids: list[TokenId] | None = Field(
        None, min_length=1, description="vLLM's: only these tokens may be sampled"
    )
    bad_words: list[NonEmptyStr] | None = Field(None, description="vLLM's: words never generated")
    prompt_logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="vLLM's: top logprobs per prompt token"
    )
    return_token_ids: bool = Field(False, description="vLLM's: token ids beside the text")
    use_beam_search: bool = Field(False, description="vLLM's: beam search, n beams")
    length_penalty: float = Field(
        1.0, ge=-10, le=10, description="beam search's length penalty (the exponent of the length)"
    )
    truncate_prompt_tokens: int | None = Field(
        None, ge=1, description="vLLM's: keep only the prompt's last k tokens"
    )

    def logit_bias_ids(self) -> dict[int, float] | None:
        """`logit_bias` keyed by token id; a key that is not one is a 400 naming the field."""
        if self.logit_bias is None:
            return None
        try:
            out = {int(k): v for k, v in self.logit_bias.items()}
        except ValueError:
            raise APIError(400, "logit_bias keys must be token ids", "logit_bias") from None
        if any(t < 0 for t in out) or any(not -100 <= v <= 100 for v in out.values()):
            raise APIError(400, "logit_bias maps token ids to values in [-100, 100]", "logit_bias")
        return out

    cache_salt: str | None = Field(
        None,
        min_length=1,
        description="prefix-cache isolation: the prompt shares cached blocks only with "
        "prompts sent with the same salt",
    )

    def check_limits(
        self,
        limits: Limits,
        logprobs: int | None,
        best_of: int | None,
        logprobs_param: str = "logprobs",
    ) -> None:
        """Each configured limit this request could exceed: a 400 naming it."""
        if self.n > limits.max_n:
            raise APIError(400, f"n ({self.n}) exceeds the limit of {limits.max_n} samples", "n")
        if best_of is not None:
            if best_of > limits.max_n:
                raise APIError(
                    400, f"best_of ({best_of}) exceeds the limit of {limits.max_n}", "best_of"
                )
            if best_of < self.n:
                raise APIError(400, f"best_of ({best_of}) must be >= n ({self.n})", "best_of")
            if self.stream and best_of > self.n:
                raise APIError(400, "best_of > n cannot be streamed", "best_of")
        if logprobs is not None and logprobs > limits.max_logprobs:
            raise APIError(
                400,
                f"{logprobs_param} ({logprobs}) exceeds the limit of {limits.max_logprobs}",
                logprobs_param,
            )
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > limits.max_stop:
            raise APIError(
                400, f"{len(stops)} stop strings exceed the limit of {limits.max_stop}", "stop"
            )
        longest = max(map(len, stops), default=0)
        if longest > limits.max_stop_length:
            raise APIError(
                400,
                f"a stop string of {longest} characters exceeds the limit of "
                f"{limits.max_stop_length} (max_stop_length)",
                "stop",
            )
        total = sum(map(len, stops))
        if total > limits.max_stop_total_length:
            raise APIError(
                400,
                f"the stop strings take {total} characters, more than the limit of "
                f"{limits.max_stop_total_length} (max_stop_total_length)",
                "stop",
            )
        stop_ids = self.stop_token_ids or []
        if len(stop_ids) > limits.max_stop:
            raise APIError(
                400,
                f"{len(stop_ids)} stop token ids exceed the limit of {limits.max_stop}",
                "stop_token_ids",
            )

    def _sampling_fields(self, defaults: Mapping[str, float]) -> dict[str, Any]:
        """The request's sampling fields; each left out: `defaults`' value, else vLLM's."""
        return {
            name: value
            if (value := getattr(self, name)) is not None
            else defaults.get(name, fallback)
            for name, fallback in _SAMPLING_DEFAULTS.items()
        }

    def sampling_params(
        self,
        limits: Limits,
        max_tokens: int | None,
        logprobs: int | None,
        best_of: int | None,
        prompt_logprobs: int | None,
        structured_outputs: StructuredOutputsParams | None = None,
        defaults: Mapping[str, float] | None = None,
    ) -> SamplingParams:
        """The engine's parameters for one prompt (`max_tokens` as resolved for it); a
        sampling field the request leaves out takes `defaults`' value (the checkpoint's
        generation_config.json), else vLLM's."""
        given = self._sampling_fields(defaults or {})
        if max_tokens is not None and max_tokens < 1:
            raise APIError(400, f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
        if max_tokens is not None and self.min_tokens > max_tokens:
            raise APIError(
                400,
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({max_tokens})",
                "min_tokens",
            )
        if (
            limits.max_tokens is not None
            and max_tokens is not None
            and max_tokens > limits.max_tokens
        ):
            raise APIError(
                400,
                f"max_tokens ({max_tokens}) exceeds the limit of {limits.max_tokens}",
                "max_tokens",
            )
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=given["temperature"],
                top_p=given["top_p"],
                top_k=given["top_k"],
                min_p=given["min_p"],
                seed=self.seed,
                priority=self.priority or 0,
                min_tokens=self.min_tokens,
                stop=self.stop,
                stop_token_ids=self.stop_token_ids,
                ignore_eos=self.ignore_eos,
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                repetition_penalty=given["repetition_penalty"],
                skip_special_tokens=self.skip_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output,
                n=self.n,
                best_of=best_of,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                structured_outputs=structured_outputs,
                logit_bias=self.logit_bias_ids(),
                allowed_token_ids=self.allowed_token_ids,
                bad_words=self.bad_words,
            )
        except ValueError as e:  # SamplingParams' own checks: the caller's values
            raise APIError(400, str(e)) from None


TokenIds = Annotated[list[TokenId], Field(min_length=1)]
PromptInput = (
    NonEmptyStr
    | Annotated[list[NonEmptyStr], Field(min_length=1)]
    | TokenIds
    | Annotated[list[TokenIds], Field(min_length=1)]
)


UNSUPPORTED = "{} is not supported by this server"


class JsonSchemaFormat(OpenAIModel):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    # `schema` would shadow pydantic's own attribute: the field is read by its alias.
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    """OpenAI's `response_format`: free text, any JSON object, or JSON that follows a
    schema (the SDK's `parse(response_format=Model)` sends the model's schema here)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_for_json_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('type "json_schema" needs a json_schema object')
        return self


class StructuredOutputsRequest(OpenAIModel):
    """vLLM's `structured_outputs` object: one constraint of the five, or only options
    for the `response_format` beside it. pagefleet's JSON is always compact, so
    vLLM's `disable_any_whitespace` is taken and changes nothing."""

    json_value: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None

    @property
    def has_constraint(self) -> bool:
        fields = (self.json_value, self.regex, self.choice, self.grammar, self.json_object)
        return any(f is not None for f in fields)


class StructuredOutputFields(RequestModel):
    """The ways a request constrains its output (OpenAI's `response_format`, vLLM's
    `guided_*` extras and their newer `structured_outputs` object); at most one may be
    given (`structured.py` reads them into the engine's `StructuredOutputsParams`)."""

    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputsRequest | None = None


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
    add_special_tokens: bool = Field(True, description="vLLM's: BOS etc. added to a text prompt")

    def requested_max_tokens(self, limits: Limits) -> int | None:
        """max_tokens as asked; OpenAI's default of 16 when left out, within the limit
        (a limit below 16 must not turn a request that did not ask into a 400)."""
        if "max_tokens" in self.model_fields_set or limits.max_tokens is None:
            return self.max_tokens
        return min(self.max_tokens or 16, limits.max_tokens)

    def to_sampling_params(
        self,
        limits: Limits,
        max_tokens: int | None,
        structured_outputs: StructuredOutputsParams | None = None,
        defaults: Mapping[str, float] | None = None,
    ) -> SamplingParams:
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is None and self.echo and self.logprobs is not None:
            prompt_logprobs = self.logprobs
        return self.sampling_params(
            limits,
            max_tokens,
            self.logprobs,
            self.best_of,
            prompt_logprobs,
            structured_outputs,
            defaults,
        )


class TextPart(OpenAIModel):
    type: Literal["text"]
    text: str


class FunctionCall(OpenAIModel):
    name: str
    arguments: str = Field(description="the call's arguments, as JSON text")


class ToolCall(OpenAIModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text for p in self.content)  # as vLLM joins text parts

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it (transformers' convention: a call's
        arguments as an object where they parse as one)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "id": c.id,
                    "type": c.type,
                    "function": {"name": c.function.name, "arguments": _arguments(c.function)},
                }
                for c in self.tool_calls
            ]
        return out


def _arguments(call: FunctionCall) -> Any:
    try:
        value = json.loads(call.arguments)
    except ValueError:
        return call.arguments
    return value if isinstance(value, dict) else call.arguments


class FunctionDefinition(OpenAIModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema")
    strict: bool | None = None


class ChatTool(OpenAIModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"] = "function"
    function: NamedFunction


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
    continue_final_message: bool = Field(
        False, description="vLLM's: the last message left open for the model to continue"
    )
    add_special_tokens: bool = Field(False, description="vLLM's: BOS etc. beside the template's")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="vLLM's: more variables for the chat template (allow-listed keys)"
    )
    documents: list[dict[str, str]] | None = Field(None, description="vLLM's: for RAG templates")
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = (
        Field(None, description="passed to the chat template")
    )
    include_reasoning: bool = Field(True, description="vLLM's: false drops reasoning_content")
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description='default "auto" with tools, "none" without'
    )
    parallel_tool_calls: bool = Field(True, description="false: at most one call")
    # OpenAI's deprecated forms of tools: refused by name, never dropped.
    functions: SkipJsonSchema[list[Any] | None] = None
    function_call: SkipJsonSchema[Any] = None

    def refuse_functions(self) -> None:
        if self.functions:
            raise APIError(400, UNSUPPORTED.format("functions (use tools)"), "functions")
        if self.function_call not in (None, "none"):
            raise APIError(
                400, UNSUPPORTED.format("function_call (use tool_choice)"), "function_call"
            )

    @property
    def top_k_logprobs(self) -> int | None:
        """Top logprobs per token for the engine (0: the chosen token's only)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def check_chat_limits(self, limits: Limits) -> None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        self.check_limits(
            limits, self.top_logprobs if self.logprobs else None, None, "top_logprobs"
        )
        self.check_call_arguments(limits.max_json_depth)

    def check_call_arguments(self, max_depth: int) -> None:
        """A 400 naming the call whose arguments (JSON text, parsed for the chat template)
        nest deeper than `max_depth`."""
        for i, message in enumerate(self.messages):
            for j, call in enumerate(message.tool_calls or ()):
                if json_depth_exceeds(call.function.arguments, max_depth):
                    param = f"messages.{i}.tool_calls.{j}.function.arguments"
                    raise APIError(
                        400,
                        f"{param}: JSON nested more than {max_depth} levels deep (max_json_depth)",
                        param,
                    )

    def requested_max_tokens(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )

    def to_sampling_params(
        self,
        limits: Limits,
        max_tokens: int | None,
        structured_outputs: StructuredOutputsParams | None = None,
        defaults: Mapping[str, float] | None = None,
    ) -> SamplingParams:
        return self.sampling_params(
            limits,
            max_tokens,
            self.top_k_logprobs,
            None,
            self.prompt_logprobs,
            structured_outputs,
            defaults,
        )


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
