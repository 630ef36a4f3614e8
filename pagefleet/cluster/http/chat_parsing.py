"""One chat choice's text read for reasoning, then tool calls, as it streams.

The reasoning parser (if the server names one) splits each piece into reasoning
and answer; the answer goes on to the tool-call parser (if the request has
tools), which splits it into content and calls. `finish` flushes both in that
order. With a grammar, `serving.after_reasoning` decides: `<think>` reasoning still
open after the prompt leaves the grammar to the answer (the engine waits for
`</think>`); otherwise the grammar shapes the text from its first token, and only
a reasoning parser that reads reasoning where the text opens it (`qwen3`,
`openai_gptoss`) is kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .reasoning_parsers import ReasoningParser
from .tool_parsers import CallPart, ParsedCall, ToolCallParser


@dataclass
class Parsed:
    content: str = ""
    reasoning: str = ""
    parts: list[CallPart] = field(default_factory=list)


@dataclass
class ChoiceParser:
    reasoning: ReasoningParser | None = None
    tools: ToolCallParser | None = None

    @property
    def calls(self) -> list[ParsedCall]:
        return self.tools.calls if self.tools is not None else []

    def feed(self, text: str) -> Parsed:
        reasoning, answer = ("", text) if self.reasoning is None else self.reasoning.feed(text)
        return self._answer(answer, reasoning)

    def finish(self) -> Parsed:
        reasoning, answer = ("", "") if self.reasoning is None else self.reasoning.finish()
        out = self._answer(answer, reasoning)
        if self.tools is not None:
            rest, more = self.tools.finish()
            out.content, out.parts = out.content + rest, out.parts + more
        return out

    def _answer(self, answer: str, reasoning: str) -> Parsed:
        if self.tools is None:
            return Parsed(answer, reasoning)
        content, parts = self.tools.feed(answer)
        return Parsed(content, reasoning, parts)
