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

Every parser is linear in the text it receives: a block or array element being
written is kept as its pieces (joined once, when it closes), and a closing tag is
looked for only where the new piece could complete it. A call's JSON nested deeper
than `max_depth` is not parsed (`loads_bounded`): the block stays content, as any
body that is not a call does. `loads_bounded` is also what a request's JSON text
(an assistant message's call arguments) is read with.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
DEFAULT_MAX_DEPTH = 64
# A JSON string (closed or not), or one bracket: what nesting depth is counted from.
_JSON_TOKENS = re.compile(r'"(?:[^"\\]+|\\.)*"?|[\[{\]}]')


def json_depth_exceeds(text: str, limit: int) -> bool:
    """Whether JSON text nests arrays and objects more than `limit` deep (brackets inside
    strings do not count); linear, and stops at the first level past the limit."""
    depth = 0
    for m in _JSON_TOKENS.finditer(text):
        c = m.group()[0]
        if c in "[{":
            depth += 1
            if depth > limit:
                return True
        elif c in "]}":
            depth -= 1
    return False


def loads_bounded(text: str, max_depth: int) -> Any:
    """`json.loads`, refusing (ValueError) text nested more than `max_depth` deep."""
    if json_depth_exceeds(text, max_depth):
        raise ValueError(f"JSON nested more than {max_depth} levels deep")
    return json.loads(text)


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
    max_depth: int = DEFAULT_MAX_DEPTH
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


def _as_call(body: str, arguments_key: str, max_depth: int) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a call's JSON body; None if it is not one."""
    try:
        value = loads_bounded(body, max_depth)
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
    _held: str = ""  # outside a block: a tail that could start OPEN
    _inside: bool = False
    _body: list[str] = field(default_factory=list)  # inside: the block's pieces so far
    _tail: str = ""  # inside: the body's last characters, where CLOSE could start

    def feed(self, text: str) -> tuple[str, list[CallPart]]:
        content: list[str] = []
        parts: list[CallPart] = []
        if not text:
            return "", []
        while text:
            if self._inside:
                text = self._feed_inside(text, content, parts)
            else:
                text = self._feed_outside(text, content)
        return "".join(content), parts

    def _feed_outside(self, text: str, content: list[str]) -> str:
        """Content up to OPEN (what follows it is returned), or up to a held-back tail."""
        buf, self._held = self._held + text, ""
        i = buf.find(OPEN)
        if i < 0:
            cut = len(buf) - _held_back(buf, OPEN)
            content.append(self._content(buf[:cut]))
            self._held = buf[cut:]
            return ""
        content.append(self._content(buf[:i]))
        self._inside, self._body, self._tail = True, [], ""
        return buf[i + len(OPEN) :]

    def _feed_inside(self, text: str, content: list[str], parts: list[CallPart]) -> str:
        """More of a block's body; once CLOSE comes, the block as a call (or content),
        and what follows CLOSE is returned."""
        window = self._tail + text
        j = window.find(CLOSE)
        if j < 0:
            self._body.append(text)
            self._tail = window[-(len(CLOSE) - 1) :]
            return ""
        k = j - len(self._tail)  # where CLOSE starts in `text` (< 0: in earlier pieces)
        body = "".join(self._body)
        body = body[: len(body) + k] if k < 0 else body + text[:k]
        self._inside, self._body, self._tail = False, [], ""
        call = _as_call(body, "arguments", self.max_depth)
        if call is None:
            content.append(OPEN + body + CLOSE)
        else:
            parts.extend(self._call(*call))
        return text[k + len(CLOSE) :]

    def finish(self) -> tuple[str, list[CallPart]]:
        rest = (OPEN + "".join(self._body) if self._inside else "") + self._held
        self._held, self._inside, self._body, self._tail = "", False, [], ""
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
    _pieces: list[str] = field(default_factory=list)  # everything received
    _item: list[str] | None = None  # the array element being written, as pieces
    _depth: int = 0
    _in_string: bool = False
    _escaped: bool = False

    def feed(self, text: str) -> tuple[str, list[CallPart]]:
        parts: list[CallPart] = []
        self._pieces.append(text)
        start = 0  # where the element being written starts in `text`
        for k, ch in enumerate(text):
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
                    self._item, start = [], k
            elif ch in "]}":
                self._depth -= 1
                if self._depth == 1 and ch == "}" and self._item is not None:
                    body = "".join(self._item) + text[start : k + 1]
                    self._item = None
                    call = _as_call(body, "parameters", self.max_depth)
                    if call is not None:
                        parts.extend(self._call(*call))
        if self._item is not None:
            self._item.append(text[start:])
        return "", parts

    def finish(self) -> tuple[str, list[CallPart]]:
        # No call came out of it (cut short by max_tokens): the text, as content.
        return ("" if self.calls else "".join(self._pieces)), []
