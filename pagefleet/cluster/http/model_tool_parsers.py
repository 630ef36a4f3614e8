"""Tool-call parsers by model family (vLLM's `tool_call_parser` names), for `tool_choice: auto`.

Each reads one sample's text as it streams, with `tool_parsers.ToolCallParser`'s
contract: `feed` returns the piece's plain content and the calls it completed (a
call is one part, its id, name and whole arguments, once its text is complete),
`finish` flushes what was held back; a text that turns out to hold no call is
content, as it came.

- `hermes` (Qwen2.5, Qwen3, Hermes): `<tool_call>{"name", "arguments"}</tool_call>`
  blocks (`tool_parsers.HermesParser`).
- `llama3_json` (Llama 3.1 / 3.2 / 3.3 with JSON tool calling): the answer is
  `<|python_tag|>` (optional) then `{"name": ..., "parameters": {...}}` objects
  separated by `;`. An answer whose first character is not `{` (after the tag)
  is content.
- `mistral`: `[TOOL_CALLS]` then a JSON array of `{"name", "arguments"}`, or (newer
  tokenizers) `[TOOL_CALLS]name[ARGS]{...}` per call; content may come first.
  Call ids are 9 letters and digits: Mistral's templates refuse any other.
- `pythonic` (Llama 3.2 / 4 pythonic templates): the answer is a Python list of
  calls with keyword arguments, `[f(a=1, b='x'), g()]` (Llama 4 wraps it in
  `<|python_start|>` ... `<|python_end|>`); read with `ast`, never evaluated.
- `openai` (gpt-oss, the Harmony format): messages `<|channel|>CH<|message|>BODY`,
  separated by `<|end|><|start|>assistant`; a header with `to=functions.NAME` makes
  its body that function's arguments (the body ends at `<|call|>`, or the text's
  end, the call token being a stop token); any other message's body is content.
  (The analysis channel is taken out before, by `reasoning_parsers`.)

The markers of `llama3_json`, `mistral` and `openai` are special tokens, so a
request parsed by one keeps special tokens in its text (`NEEDS_SPECIAL_TOKENS`).
`choose` picks a parser from a chat template when the setting names none.
"""

from __future__ import annotations

import ast
import json
import random
import string
from dataclasses import dataclass

from .reasoning_parsers import held_back
from .tool_parsers import (
    DEFAULT_MAX_DEPTH,
    CallPart,
    HermesParser,
    ParsedCall,
    ToolCallParser,
    json_depth_exceeds,
    loads_bounded,
)

TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic", "openai")
NEEDS_SPECIAL_TOKENS = frozenset({"llama3_json", "mistral", "openai"})


class _JsonObjects:
    """Top-level JSON values in a stream of characters: `push` returns each value's
    text as its closing bracket arrives (strings and escapes tracked)."""

    def __init__(self) -> None:
        self.depth = 0
        self._in_string = False
        self._escaped = False
        self._current: list[str] = []

    def push(self, text: str) -> list[str]:
        done = []
        for ch in text:
            if self.depth:
                self._current.append(ch)
            if self._in_string:
                self._in_string = not (ch == '"' and not self._escaped)
                self._escaped = ch == "\\" and not self._escaped
            elif ch == '"' and self.depth:
                self._in_string = True
            elif ch in "[{":
                if not self.depth:
                    self._current = [ch]
                self.depth += 1
            elif ch in "]}" and self.depth:
                self.depth -= 1
                if not self.depth:
                    done.append("".join(self._current))
        return done


def _call_of(value: object) -> tuple[str, str] | None:
    """(name, arguments JSON) of one `{"name", "parameters" | "arguments"}` object."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = value.get("parameters", value.get("arguments", {}))
    return value["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def _loads(text: str, max_depth: int) -> object:
    try:
        return loads_bounded(text, max_depth)
    except ValueError:
        return None


PYTHON_TAG = "<|python_tag|>"


@dataclass
class Llama3JsonParser(ToolCallParser):
    _text: str = ""
    _mode: str = "start"  # start -> calls | content
    _scan: _JsonObjects | None = None

    def feed(self, text: str) -> tuple[str, list[CallPart]]:
        self._text += text
        if self._mode == "start":
            head = self._text.lstrip()
            if head.startswith(PYTHON_TAG):
                head = head[len(PYTHON_TAG) :].lstrip()
            elif PYTHON_TAG.startswith(head):
                return "", []
            if not head:
                return "", []
            self._mode = "calls" if head.startswith("{") else "content"
            if self._mode == "content":
                return self._text, []
            self._scan = _JsonObjects()
            return "", self._calls(head)
        if self._mode == "content":
            return text, []
        return "", self._calls(text)

    def _calls(self, text: str) -> list[CallPart]:
        assert self._scan is not None
        parts: list[CallPart] = []
        for body in self._scan.push(text):
            call = _call_of(_loads(body, self.max_depth))
            if call is not None:
                parts.extend(self._call(*call))
        return parts

    def finish(self) -> tuple[str, list[CallPart]]:
        if self._mode == "content" or self.calls:
            return "", []
        return self._text, []  # no call came out of it: the text, as content


TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
_ID_CHARS = string.ascii_letters + string.digits


def mistral_call_id() -> str:
    return "".join(random.choices(_ID_CHARS, k=9))


@dataclass
class MistralParser(ToolCallParser):
    _buf: str = ""
    _inside: bool = False
    _scan: _JsonObjects | None = None
    _name: str | None = None  # the [ARGS] form's function name, once read
    _after: str = ""  # all the text from the marker on (content, if no call comes of it)

    def feed(self, text: str) -> tuple[str, list[CallPart]]:
        self._buf += text
        if self._inside:
            self._after += text
            return "", self._calls()
        i = self._buf.find(TOOL_CALLS)
        if i < 0:
            cut = len(self._buf) - held_back(self._buf, TOOL_CALLS)
            content, self._buf = self._buf[:cut], self._buf[cut:]
            return content, []
        content, self._buf = self._buf[:i], self._buf[i:]
        self._inside, self._scan, self._after = True, _JsonObjects(), self._buf
        return content, self._calls()

    def _calls(self) -> list[CallPart]:
        """The calls the text after `[TOOL_CALLS]` completes (more markers may follow)."""
        assert self._scan is not None
        parts: list[CallPart] = []
        while self._buf:
            if self._scan.depth == 0 and self._name is None and not self._head():
                break
            for k, ch in enumerate(self._buf):
                done = self._scan.push(ch)
                if done:
                    self._take(done[0], parts)
                    self._buf = self._buf[k + 1 :]
                    break
            else:
                self._buf = ""
        return parts

    def _head(self) -> bool:
        """Between calls: skip a marker, read an `[ARGS]` form's name; False: wait."""
        head = self._buf.lstrip()
        while head.startswith(TOOL_CALLS):
            head = head[len(TOOL_CALLS) :].lstrip()
        self._buf = head
        if not head or TOOL_CALLS.startswith(head):
            return False
        if head[0] in "[{":
            return True
        j = head.find(ARGS)
        if j < 0:
            return False
        self._name, self._buf = head[:j].strip(), head[j + len(ARGS) :]
        return True

    def _take(self, body: str, parts: list[CallPart]) -> None:
        value = _loads(body, self.max_depth)
        if self._name is not None:
            args = json.dumps(value, ensure_ascii=False) if value is not None else body
            parts.extend(self._call(self._name, args))
            self._name = None
            return
        for item in value if isinstance(value, list) else [value]:
            call = _call_of(item)
            if call is not None:
                parts.extend(self._call(*call))

    def _call(self, name: str, arguments: str) -> list[CallPart]:
        if self.calls and not self.parallel:
            return []
        call = ParsedCall(mistral_call_id(), name, arguments)
        self.calls.append(call)
        return [CallPart(len(self.calls) - 1, arguments, call.id, name)]

    def finish(self) -> tuple[str, list[CallPart]]:
        rest, self._buf = self._buf, ""
        if self._inside:
            return ("" if self.calls else self._after), []
        return rest, []


PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"


def _python_calls(text: str, max_depth: int) -> list[tuple[str, str]] | None:
    """The calls of a pythonic list, `[f(a=1), g()]`; None if the text is not one or
    nests brackets more than `max_depth` deep."""
    if json_depth_exceeds(text.replace("(", "[").replace(")", "]"), max_depth):
        return None
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        return None
    items = tree.elts if isinstance(tree, ast.List) else [tree]
    calls = []
    for item in items:
        if not isinstance(item, ast.Call) or not isinstance(item.func, ast.Name) or item.args:
            return None
        try:
            args = {kw.arg: ast.literal_eval(kw.value) for kw in item.keywords if kw.arg}
        except ValueError:
            return None
        calls.append((item.func.id, json.dumps(args, ensure_ascii=False)))
    return calls


@dataclass
class PythonicParser(ToolCallParser):
    _text: str = ""
    _mode: str = "start"  # start -> list | content

    def feed(self, text: str) -> tuple[str, list[CallPart]]:
        self._text += text
        if self._mode == "content":
            return text, []
        head = self._text.lstrip()
        if self._mode == "start":
            if not head or PYTHON_START.startswith(head):
                return "", []
            opens = head.startswith("[") or head.startswith(PYTHON_START)
            self._mode = "list" if opens else "content"
            if self._mode == "content":
                return self._text, []
        body = head.removeprefix(PYTHON_START).split(PYTHON_END)[0]
        if not body.rstrip().endswith("]"):
            return "", []
        calls = _python_calls(body, self.max_depth)
        if calls is None or self.calls:
            return "", []
        return "", [p for call in calls for p in self._call(*call)]

    def finish(self) -> tuple[str, list[CallPart]]:
        if self._mode == "content" or self.calls:
            return "", []
        return self._text, []


START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
_BODY_ENDS = ("<|call|>", "<|end|>", "<|return|>")
_ROLE = "assistant"


@dataclass
class HarmonyParser(ToolCallParser):
    _buf: str = ""
    _header: str | None = None  # the message being read's header, once complete

    def feed(self, text: str) -> tuple[str, list[CallPart]]:
        self._buf += text
        content: list[str] = []
        parts: list[CallPart] = []
        while True:
            if self._header is None:
                j = self._buf.find(MESSAGE)
                if j < 0:
                    break
                self._header, self._buf = self._buf[:j], self._buf[j + len(MESSAGE) :]
            ends = [(self._buf.find(e), e) for e in _BODY_ENDS if e in self._buf]
            if not ends:
                if self._recipient() is None:  # content streams; a call waits for its end
                    cut = len(self._buf) - max(held_back(self._buf, e) for e in _BODY_ENDS)
                    content.append(self._buf[:cut])
                    self._buf = self._buf[cut:]
                break
            k, end = min(ends)
            self._body(self._buf[:k], content, parts)
            self._buf, self._header = self._buf[k + len(end) :], None
        return "".join(content), parts

    def _recipient(self) -> str | None:
        """The function the current message is addressed to (`to=functions.NAME`)."""
        header = self._header or ""
        i = header.find("to=")
        if i < 0:
            return None
        name = header[i + 3 :].split("<|")[0].split()[0] if header[i + 3 :].strip() else ""
        return name.removeprefix("functions.") or None

    def _body(self, body: str, content: list[str], parts: list[CallPart]) -> None:
        name = self._recipient()
        if name is None:
            content.append(body)
        else:
            value = _loads(body, self.max_depth)
            args = json.dumps(value, ensure_ascii=False) if value is not None else body
            parts.extend(self._call(name, args))

    def finish(self) -> tuple[str, list[CallPart]]:
        content: list[str] = []
        parts: list[CallPart] = []
        if self._header is not None:
            self._body(self._buf, content, parts)
        elif not self.calls:
            content.append(self._buf.removeprefix(START + _ROLE))
        self._buf, self._header = "", None
        return "".join(content), parts


def tool_call_parser(
    name: str, parallel: bool = True, max_depth: int = DEFAULT_MAX_DEPTH
) -> ToolCallParser:
    """A fresh `auto` parser of the named format for one sample's text (calls nested
    deeper than `max_depth` stay content)."""
    kinds: dict[str, type[ToolCallParser]] = {
        "hermes": HermesParser,
        "llama3_json": Llama3JsonParser,
        "mistral": MistralParser,
        "pythonic": PythonicParser,
        "openai": HarmonyParser,
    }
    if name not in kinds:
        raise ValueError(f"unknown tool call parser {name!r}; known: {', '.join(kinds)}")
    return kinds[name](parallel=parallel, max_depth=max_depth)


# What in a chat template says which format its model writes, in the order tried.
_TEMPLATE_MARKS = (
    ("openai", ("<|channel|>",)),
    ("mistral", ("[TOOL_CALLS]",)),
    ("pythonic", ("[func_name1(", "<|python_start|>")),
    ("llama3_json", ("<|python_tag|>", "<|eom_id|>", '"parameters": ')),
    ("hermes", ("<tool_call>",)),
)


def choose(chat_template: str | None) -> str:
    """The parser a chat template's model calls tools in (hermes when it says nothing)."""
    template = chat_template or ""
    for name, marks in _TEMPLATE_MARKS:
        if any(m in template for m in marks):
            return name
    return "hermes"
