"""Tool calls read out of a sample's text, as it streams.

A parser takes a sample's text piece by piece (`feed`) and hands back, for each
piece, the text that is plain content and the tool-call parts it completed; `finish`
flushes what it held back. The non-streamed answer feeds the whole text once, so a
streamed and a non-streamed answer hold the same calls. Three formats, one per
`tool_choice` (`tools.py` picks it):

- `HermesParser` (`auto`): the model writes `<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>` blocks, as the Hermes / Qwen2.5 chat templates teach it. Text
  outside the blocks is content; a tail that could still open a block is held back
  until it cannot; a block is one call once it closes (a block whose body is not a
  call stays content, as it came). After the first call, a stretch of content that
  is only whitespace (the newlines between blocks) is dropped.
- `NamedParser` (a named function): the grammar makes the whole output the
  function's arguments, so every piece is more of one call's arguments.
- `CallListParser` (`required`): the grammar makes the output a JSON array of
  `{"name": ..., "parameters": {...}}` (vLLM's form); each element is one call once
  its closing brace comes. The scan tracks strings and escapes, so braces inside a
  string do not count.

A call's parts: the first carries the call's id and name; the rest more arguments.
With `parallel_tool_calls: false` only the first call is kept.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class CallPart:
    """One streamed part of call `index`: its id and name on the first part only."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


@dataclass
class ParsedCall:
    id: str
    name: str
    arguments: str  # JSON text


@dataclass
class ToolCallParser:
    """The calls found so far and the parts that made them (see the module docstring)."""

    parallel: bool = True
    calls: list[ParsedCall] = field(default_factory=list)

    def feed(self, text: str) -> tuple[str, list[CallPart]]:
        raise NotImplementedError

    def finish(self) -> tuple[str, list[CallPart]]:
        return "", []

    def _call(self, name: str, arguments: str) -> list[CallPart]:
        """A whole call, as one part; nothing when only one call is allowed and one is in."""
        if self.calls and not self.parallel:
            return []
        call = ParsedCall(new_call_id(), name, arguments)
        self.calls.append(call)
        return [CallPart(len(self.calls) - 1, arguments, call.id, name)]


def _as_call(body: str, arguments_key: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a call's JSON body; None if it is not one."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = value.get(arguments_key, {})
    return value["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def _held_back(text: str, tag: str) -> int:
    """How many trailing characters of `text` could be the start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


@dataclass
class HermesParser(ToolCallParser):
    _buf: str = ""
    _inside: bool = False

    def feed(self, text: str) -> tuple[str, list[CallPart]]:
        self._buf += text
        content: list[str] = []
        parts: list[CallPart] = []
        while True:
            if not self._inside:
                i = self._buf.find(OPEN)
                if i < 0:
                    keep = _held_back(self._buf, OPEN)
                    cut = len(self._buf) - keep
                    content.append(self._content(self._buf[:cut]))
                    self._buf = self._buf[cut:]
                    break
                content.append(self._content(self._buf[:i]))
                self._buf = self._buf[i + len(OPEN) :]
                self._inside = True
            else:
                j = self._buf.find(CLOSE)
                if j < 0:
                    break
                body, self._buf = self._buf[:j], self._buf[j + len(CLOSE) :]
                self._inside = False
                call = _as_call(body, "arguments")
                if call is None:
                    content.append(OPEN + body + CLOSE)
                else:
                    parts.extend(self._call(*call))
        return "".join(content), parts

    def finish(self) -> tuple[str, list[CallPart]]:
        rest = (OPEN if self._inside else "") + self._buf
        self._buf, self._inside = "", False
        return self._content(rest), []

    def _content(self, text: str) -> str:
        return "" if self.calls and not text.strip() else text


@dataclass
class NamedParser(ToolCallParser):
    name: str = ""

    def feed(self, text: str) -> tuple[str, list[CallPart]]:
        if not self.calls:
            call = ParsedCall(new_call_id(), self.name, text)
            self.calls.append(call)
            return "", [CallPart(0, text, call.id, self.name)]
        if not text:
            return "", []
        self.calls[0].arguments += text
        return "", [CallPart(0, text)]


@dataclass
class CallListParser(ToolCallParser):
    _text: str = ""
    _depth: int = 0
    _in_string: bool = False
    _escaped: bool = False
    _item_start: int = -1

    def feed(self, text: str) -> tuple[str, list[CallPart]]:
        parts: list[CallPart] = []
        base = len(self._text)
        self._text += text
        for k, ch in enumerate(text, base):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "[{":
                self._depth += 1
                if self._depth == 2 and ch == "{":
                    self._item_start = k
            elif ch in "]}":
                self._depth -= 1
                if self._depth == 1 and ch == "}" and self._item_start >= 0:
                    call = _as_call(self._text[self._item_start : k + 1], "parameters")
                    self._item_start = -1
                    if call is not None:
                        parts.extend(self._call(*call))
        return "", parts

    def finish(self) -> tuple[str, list[CallPart]]:
        # No call came out of it (cut short by max_tokens): the text, as content.
        return ("" if self.calls else self._text), []
