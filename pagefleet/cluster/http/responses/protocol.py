"""`/v1/responses` request bodies, and how their conversation reads as chat messages.

A request's conversation is its `instructions` (a system message, never carried to
the next turn, as OpenAI's), the stored history of `previous_response_id`, then its
`input`: a string (one user message) or items: messages (`role`, `content` as text or
`input_text`/`output_text` parts), `function_call` (an assistant's call, by `call_id`)
and `function_call_output` (the call's result, a `tool` message). Consecutive calls
join one assistant message, as the chat template expects them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator

from ..errors import APIError
from ..protocol import OpenAIModel, RequestModel


class ContentPart(OpenAIModel):
    type: Literal["input_text", "output_text", "text"]
    text: str


class MessageItem(OpenAIModel):
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class FunctionCallItem(OpenAIModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(OpenAIModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str


def _item_kind(item: Any) -> str | None:
    if isinstance(item, dict):
        return item.get("type", "message")
    return getattr(item, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(_item_kind),
]


class FunctionTool(OpenAIModel):
    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def for_chat(self) -> dict[str, Any]:
        function = {"name": self.name, "description": self.description}
        function |= {"parameters": self.parameters, "strict": self.strict}
        return {
            "type": "function",
            "function": {k: v for k, v in function.items() if v is not None},
        }


class FunctionToolChoice(OpenAIModel):
    type: Literal["function"]
    name: str


class TextFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(OpenAIModel):
    format: TextFormat | None = None


class ResponsesRequest(RequestModel):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    store: bool | None = None
    previous_response_id: str | None = None
    stream: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None

    @field_validator("input")
    @classmethod
    def _not_empty(cls, value: str | list[Any]) -> str | list[Any]:
        if isinstance(value, list) and not value:
            raise ValueError("input must not be an empty list")
        return value

    def input_messages(self) -> list[dict[str, Any]]:
        """This turn's input as chat messages (no instructions)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        return items_as_messages(self.input)

    def chat_fields(self) -> dict[str, Any]:
        """The chat completion fields this request sets (all but `messages`)."""
        fields: dict[str, Any] = {
            "model": self.model,
            "stream": True,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "max_completion_tokens": self.max_output_tokens,
            "parallel_tool_calls": self.parallel_tool_calls,
        }
        if self.tools:
            fields["tools"] = [t.for_chat() for t in self.tools]
        if isinstance(self.tool_choice, FunctionToolChoice):
            fields["tool_choice"] = {
                "type": "function",
                "function": {"name": self.tool_choice.name},
            }
        elif self.tool_choice is not None:
            fields["tool_choice"] = self.tool_choice
        fmt = self.text.format if self.text else None
        forced = self.tool_choice == "required" or isinstance(self.tool_choice, FunctionToolChoice)
        if fmt is not None and not forced:  # a forced call's output is the call, not text
            fields["response_format"] = _response_format(fmt)
        return {k: v for k, v in fields.items() if v is not None}


def _response_format(fmt: TextFormat) -> dict[str, Any]:
    if fmt.type != "json_schema":
        return {"type": fmt.type}
    if fmt.json_schema is None or not fmt.name:
        raise APIError(400, "text.format json_schema needs a name and a schema", "text.format")
    inner = {"name": fmt.name, "schema": fmt.json_schema, "strict": fmt.strict}
    return {"type": "json_schema", "json_schema": {k: v for k, v in inner.items() if v is not None}}


def items_as_messages(items: list[Any]) -> list[dict[str, Any]]:
    """Input items as chat messages: each call joins the assistant message before it."""
    out: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, MessageItem):
            out.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            function = {"name": item.name, "arguments": item.arguments}
            call = {"id": item.call_id, "type": "function", "function": function}
            if not out or out[-1]["role"] != "assistant":
                out.append({"role": "assistant", "content": None})
            out[-1].setdefault("tool_calls", []).append(call)
        else:
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    return out
