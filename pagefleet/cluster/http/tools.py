"""What a chat request's `tools` and `tool_choice` ask of the engine and of its answer.

- `none` (the default without tools): free text; the tools still go to the chat
  template (the model may read them, as OpenAI's does), nothing is parsed.
- `auto` (the default with tools): the model decides; its text is read for calls
  in its family's format (the server's `tool_call_parser`: `model_tool_parsers.py`),
  which become `tool_calls` with `finish_reason: "tool_calls"`.
- `required`: a grammar makes the output a JSON array of one or more calls, each
  `{"name": <one of the tools>, "parameters": <that tool's arguments schema>}` (as
  vLLM does), at most one with `parallel_tool_calls: false`.
- a named function: a grammar makes the output that function's arguments (its
  `parameters` schema); the answer is one call to it, finish_reason "stop" as
  OpenAI's is for a forced call.

`required` and a named function set the output constraint themselves, so they take
no `response_format` or `guided_*` besides; `auto` and `none` do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pagefleet.engine import StructuredOutputsParams

from .chat_parsing import ChoiceParser
from .errors import APIError
from .model_tool_parsers import tool_call_parser
from .protocol import ChatCompletionRequest, ChatTool, NamedToolChoice
from .tool_parsers import CallListParser, NamedParser, ToolCallParser

ANY_OBJECT: dict[str, Any] = {"type": "object"}


def _arguments_schema(tool: ChatTool) -> dict[str, Any]:
    return tool.function.parameters if tool.function.parameters is not None else ANY_OBJECT


def call_list_schema(tools: list[ChatTool], parallel: bool) -> dict[str, Any]:
    """The JSON schema of `required`'s output: a list of calls to the given tools."""
    one_of_the_tools = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t.function.name]},
                "parameters": _arguments_schema(t),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": one_of_the_tools}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


@dataclass(frozen=True)
class ToolPlan:
    mode: Literal["none", "auto", "required", "named"]
    tools: tuple[ChatTool, ...] = ()
    constraint: StructuredOutputsParams | None = None
    name: str | None = None  # the named function
    parallel: bool = True
    auto_parser: str = "hermes"  # the format `auto` reads calls in

    @classmethod
    def of(cls, req: ChatCompletionRequest, auto_parser: str = "hermes") -> ToolPlan:
        tools = tuple(req.tools or ())
        choice = req.tool_choice
        if choice is None:
            choice = "auto" if tools else "none"
        if choice == "none":
            return cls("none", tools)
        if not tools:
            raise APIError(400, 'tool_choice other than "none" needs tools', "tool_choice")
        names = [t.function.name for t in tools]
        if len(set(names)) != len(names):
            raise APIError(400, "tools must have distinct function names", "tools")
        if choice == "auto":
            return cls("auto", tools, parallel=req.parallel_tool_calls, auto_parser=auto_parser)
        if choice == "required":
            schema = call_list_schema(list(tools), req.parallel_tool_calls)
            return cls(
                "required",
                tools,
                StructuredOutputsParams(json=schema),
                parallel=req.parallel_tool_calls,
            )
        assert isinstance(choice, NamedToolChoice)
        wanted = choice.function.name
        tool = next((t for t in tools if t.function.name == wanted), None)
        if tool is None:
            raise APIError(
                400, f"tool_choice names {wanted!r}, which is not among tools", "tool_choice"
            )
        return cls("named", tools, StructuredOutputsParams(json=_arguments_schema(tool)), wanted)

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template reads them (OpenAI's definitions)."""
        if not self.tools:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def parser(self, max_depth: int) -> ToolCallParser | None:
        """A fresh parser for one sample's text (calls nested deeper than `max_depth`
        stay content); None when nothing is parsed."""
        if self.mode == "auto":
            return tool_call_parser(self.auto_parser, self.parallel, max_depth)
        if self.mode == "required":
            return CallListParser(parallel=self.parallel, max_depth=max_depth)
        if self.mode == "named":
            return NamedParser(name=self.name or "")
        return None

    def finish_reason(
        self, reason: str | None, parser: ToolCallParser | ChoiceParser | None
    ) -> str | None:
        """OpenAI's finish reason: "tool_calls" when a natural end made calls (not for a
        named function, nor for a sample cut short by max_tokens)."""
        if reason == "stop" and parser is not None and parser.calls and self.mode != "named":
            return "tool_calls"
        return reason
