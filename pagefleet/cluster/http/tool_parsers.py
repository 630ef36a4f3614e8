"""Tool calls read out of a sample's text, as it streams.

A parser takes a sample's text piece by piece (`feed`) and hands back, for each
piece, the text that is plain content and the tool-call parts it completed; `finish`
flushes what it held back. The non-streamed answer feeds the whole text once, so a
streamed and a non-streamed answer hold the same calls. Three formats, one per
`tool_choice` (`tools.py` picks it):

- `HermesParser` (`auto`): the model writes `<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>` blocks, as the Hermes / Qwen2.5 chat templates teach it. Text
  outside the blocks is content; a tail that could still open (or, inside a block,
  close) one is held back until it cannot; a block whose body turns out to hold no
  call stays content, as it came. After the first call, a stretch of content that is
  only whitespace (the newlines between blocks) is dropped.
- `NamedParser` (a named function): the grammar makes the whole output the
  function's arguments, so every piece is more of one call's arguments.
- `CallListParser` (`required`): the grammar makes the output a JSON array of
  `{"name": ..., "parameters": {...}}` (vLLM's form), each element one call.

Calls stream as OpenAI's do: a call's first part carries its id, its name and the
arguments so far, as soon as its name is read and its arguments begin (a call
object that closes with none has `{}`); the next parts carry more of its arguments,
as the model writes them. A call's `arguments` are the raw JSON text the model
wrote, so its parts join to them exactly, streamed or not (`CallScanner` reads a
call's JSON character by character, tracking strings and escapes). A call once
begun stays a call: cut short (by `max_tokens`), its arguments end where the text
did. With `parallel_tool_calls: false` only the first call is kept.

Every parser is linear in the text it receives: each character is read once, and a
closing tag is looked for only where the new piece could complete it. Arguments
nested deeper than `max_depth` end where they pass it (the rest of the call is not
read); `json_depth_exceeds` is the same bound on a request's own JSON text (an
assistant message's call arguments).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

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
    _current: ParsedCall | None = None  # the call being streamed
    _skip: bool = False  # the call being read is one past the only one allowed
    _scan: CallScanner | None = None  # the call object being read

    def feed(self, text: str) -> tuple[str, list[CallPart]]:
        raise NotImplementedError

    def finish(self) -> tuple[str, list[CallPart]]:
        return "", []

    def new_id(self) -> str:
        return new_call_id()

    def _call(self, name: str, arguments: str) -> list[CallPart]:
        """A whole call, as one part; nothing when only one call is allowed and one is in."""
        parts = self._start(name, arguments)
        self._end_call()
        return parts

    def _start(self, name: str, arguments: str) -> list[CallPart]:
        """A call's first part (id, name, the arguments so far); nothing past the only one."""
        if self.calls and not self.parallel:
            self._skip = True
            return []
        self._current = ParsedCall(self.new_id(), name, arguments)
        self.calls.append(self._current)
        return [CallPart(len(self.calls) - 1, arguments, self._current.id, name)]

    def _more(self, arguments: str) -> list[CallPart]:
        """More arguments of the call being streamed."""
        if self._current is None or not arguments:
            return []
        self._current.arguments += arguments
        return [CallPart(len(self.calls) - 1, arguments)]

    def _stream(self, scan: CallScanner) -> list[CallPart]:
        """What a scanned call adds: its first part once its name is known and its arguments
        began (or its object closed without any: `{}`), then more arguments as they come."""
        if self._skip or scan.name is None:
            return []
        if self._current is None:
            if scan.args_state == "none" and not scan.done:
                return []
            return self._start(scan.name, scan.take() or "{}")
        return self._more(scan.take())

    def _end_call(self) -> None:
        self._current, self._skip = None, False

    def _read_calls(self, text: str, keys: tuple[str, ...]) -> list[CallPart]:
        """Call objects in `text` (JSON objects with a name and arguments under one of `keys`),
        each streamed as it is written; what lies between them is passed over."""
        parts: list[CallPart] = []
        k = 0
        while k < len(text):
            if self._scan is None:
                if text[k] != "{":
                    k += 1
                    continue
                self._scan = CallScanner(keys, self.max_depth)
            k += self._scan.feed(text[k:])
            parts += self._stream(self._scan)
            if self._scan.done:
                self._scan = None
                self._end_call()
        return parts


class CallScanner:
    """One call written as JSON, read character by character as it streams.

    Either a call object, `{"name": ..., KEY: ARGS, ...}` (KEY one of `keys`), or,
    with `name` given, a bare ARGS value (a format that writes the name apart).
    `feed` takes characters up to the value's end and returns how many it took;
    `take` hands out the arguments' raw text not handed out before, once the name is
    known. Strings and escapes are tracked, so brackets inside strings do not count.
    Arguments written as a JSON string are handed out decoded, once the string closes.
    Nesting deeper than `max_depth` ends the arguments where it starts.
    """

    __slots__ = (
        "_args",
        "_bare",
        "_escaped",
        "_expect",
        "_in_string",
        "_key",
        "_sent",
        "_string",
        "args_state",
        "depth",
        "done",
        "keys",
        "max_depth",
        "name",
    )

    def __init__(self, keys: tuple[str, ...], max_depth: int, name: str | None = None) -> None:
        self.keys, self.max_depth, self.name = keys, max_depth, name
        self._bare = name is not None and not keys  # the value is the arguments
        self.depth = 0
        self.done = False
        self.args_state = "none"  # none -> open -> closed
        self._in_string = self._escaped = False
        self._string: list[str] | None = None  # a depth-1 string being read
        self._key: str | None = None
        self._expect = "value" if name is not None else "object"
        self._args: list[str] = []
        self._sent = 0

    def take(self) -> str:
        """The arguments' text not handed out yet ("" until the name is known)."""
        if self.name is None or self.args_state == "none":
            return ""
        new = "".join(self._args[self._sent :])
        self._sent = len(self._args)
        return new

    def feed(self, text: str) -> int:
        """Read characters of `text` until the value ends; how many were read."""
        for k, ch in enumerate(text):
            if self.done:
                return k
            self._char(ch)
        return len(text)

    def _char(self, ch: str) -> None:
        if self._in_string:
            self._string_char(ch)
        elif ch == '"':
            self._in_string = True
            self._open_string(ch)
        elif ch in "[{":
            self._open(ch)
        elif ch in "]}":
            self._close(ch)
        elif self.args_state == "open":
            self._args.append(ch)
        elif self.depth == 1 and ch == ":" and self._expect == "colon":
            self._expect = "value"
        elif self.depth == 1 and ch == ",":
            self._key, self._expect = None, "key"
        elif not ch.isspace() and self._expect == "object":
            self.done = True  # not a JSON object: no call

    def _string_char(self, ch: str) -> None:
        closing = ch == '"' and not self._escaped
        self._escaped = ch == "\\" and not self._escaped
        if self.args_state == "open":
            self._args.append(ch)
        if self._string is not None:
            if not closing:
                self._string.append(ch)
                return
            self._end_string("".join(self._string))
        if closing:
            self._in_string = False

    def _open_string(self, ch: str) -> None:
        if self.args_state == "open":
            self._args.append(ch)
        elif self.depth == 1 and self._expect in ("key", "value"):
            self._string = []

    def _end_string(self, raw: str) -> None:
        self._string = None
        if self._expect == "key":
            self._key, self._expect = raw, "colon"
            return
        self._expect = "comma"
        try:
            value = json.loads(f'"{raw}"')
        except ValueError:
            return
        if self._key == "name" and self.name is None:
            self.name = value
        elif self._key in self.keys and self.args_state == "none":
            self._args, self.args_state = [value], "closed"

    def _open(self, ch: str) -> None:
        self.depth += 1
        if self._expect == "object":
            if ch != "{":
                self.done = True
            self._expect = "key"
            return
        at = 1 if self._bare else 2
        starts = self.args_state == "none" and self._expect == "value" and self.depth == at
        if starts and (self._bare or self._key in self.keys):
            self.args_state = "open"
        if self.args_state == "open":
            if self.depth > self.max_depth:
                self.args_state = "closed"
                return
            self._args.append(ch)

    def _close(self, ch: str) -> None:
        self.depth -= 1
        if self.args_state == "open":
            self._args.append(ch)
            if self.depth == (0 if self._bare else 1):
                self.args_state, self._expect = "closed", "comma"
        if self.depth <= 0:
            self.done = True


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
    _body: list[str] = field(default_factory=list)  # inside: the block's text so far
    _tail: str = ""  # inside: the last characters, held back where CLOSE could start

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
        self._scan = CallScanner(("arguments",), self.max_depth)
        return buf[i + len(OPEN) :]

    def _feed_inside(self, text: str, content: list[str], parts: list[CallPart]) -> str:
        """More of a block's body, its call streamed as it comes; once CLOSE comes, a block
        that held no call is content, and what follows CLOSE is returned."""
        window, self._tail = self._tail + text, ""
        j = window.find(CLOSE)
        if j < 0:
            cut = len(window) - _held_back(window, CLOSE)
            self._give(window[:cut], parts)
            self._tail = window[cut:]
            return ""
        self._give(window[:j], parts)
        if self._current is None and not self._skip:
            content.append(OPEN + "".join(self._body) + CLOSE)
        self._inside, self._body, self._scan = False, [], None
        self._end_call()
        return window[j + len(CLOSE) :]

    def _give(self, text: str, parts: list[CallPart]) -> None:
        assert self._scan is not None
        if text:
            self._body.append(text)
            self._scan.feed(text)
            parts += self._stream(self._scan)

    def finish(self) -> tuple[str, list[CallPart]]:
        parts: list[CallPart] = []
        rest = self._held
        if self._inside:
            self._give(self._tail, parts)
            if self._current is None and not self._skip:
                rest = OPEN + "".join(self._body) + rest
        self._held, self._inside, self._body, self._tail, self._scan = "", False, [], "", None
        self._end_call()
        return self._content(rest), parts

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

    def feed(self, text: str) -> tuple[str, list[CallPart]]:
        self._pieces.append(text)
        return "", self._read_calls(text, ("parameters",))

    def finish(self) -> tuple[str, list[CallPart]]:
        # No call came out of it (cut short by max_tokens): the text, as content.
        return ("" if self.calls else "".join(self._pieces)), []
