"""Tool-call parsers by model family (vLLM's `tool_call_parser` names), for `tool_choice: auto`.

Each reads one sample's text as it streams, with `tool_parsers.ToolCallParser`'s
contract: `feed` returns the piece's plain content and the parts of calls it wrote
(a call's first part, with its id and name, as soon as its arguments begin; then
its arguments' raw text in fragments as they are written, joining to the call's
`arguments`), `finish` flushes what was held back; a text that turns out to hold
no call is content, as it came. `pythonic` alone sends each call in one part: its
arguments are Python, turned into JSON once the list is complete.

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
  its body that function's arguments, streamed as written (the body ends at
  `<|call|>`, or the text's end, the call token being a stop token); any other
  message's body is content.
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
    CallScanner,
    HermesParser,
    ToolCallParser,
    json_depth_exceeds,
)

TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic", "openai")
NEEDS_SPECIAL_TOKENS = frozenset({"llama3_json", "mistral", "openai"})


PYTHON_TAG = "<|python_tag|>"
CALL_KEYS = ("parameters", "arguments")


@dataclass
class Llama3JsonParser(ToolCallParser):
    _text: str = ""
    _mode: str = "start"  # start -> calls | content

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
            return "", self._read_calls(head, CALL_KEYS)
        if self._mode == "content":
            return text, []
        return "", self._read_calls(text, CALL_KEYS)

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
    _buf: str = ""  # outside: a tail that could start the marker; inside: text between calls
    _inside: bool = False
    _after: str = ""  # all the text from the marker on (content, if no call comes of it)
    _seen: int = 0  # how much of `_buf` was searched for `[ARGS]` already

    def new_id(self) -> str:
        return mistral_call_id()

    def feed(self, text: str) -> tuple[str, list[CallPart]]:
        if self._inside:
            self._after += text
            return "", self._calls(text)
        self._buf += text
        i = self._buf.find(TOOL_CALLS)
        if i < 0:
            cut = len(self._buf) - held_back(self._buf, TOOL_CALLS)
            content, self._buf = self._buf[:cut], self._buf[cut:]
            return content, []
        content, rest = self._buf[:i], self._buf[i:]
        self._inside, self._after, self._buf = True, rest, ""
        return content, self._calls(rest)

    def _calls(self, text: str) -> list[CallPart]:
        """The calls the text after `[TOOL_CALLS]` writes, each streamed as it comes."""
        parts: list[CallPart] = []
        while text:
            if self._scan is None:
                self._buf, text = self._buf + text, ""
                self._scan = self._head()
                if self._scan is None:
                    break
                text, self._buf = self._buf, ""
            k = self._scan.feed(text)
            parts += self._stream(self._scan)
            text = text[k:]
            if self._scan.done:
                self._scan = None
                self._end_call()
        return parts

    def _head(self) -> CallScanner | None:
        """Between calls: pass over markers and the array's brackets and commas; the next
        call's scanner once it starts (an object, or `name[ARGS]`), None: wait for more."""
        head = self._buf
        while True:
            head = head.lstrip()
            if head.startswith(TOOL_CALLS):
                head = head[len(TOOL_CALLS) :]
            elif head[:1] in ("[", ",", "]") and not TOOL_CALLS.startswith(head):
                head = head[1:]
            else:
                break
        self._buf = head
        if not head or TOOL_CALLS.startswith(head):
            return None
        if head[0] == "{":
            return CallScanner(CALL_KEYS, self.max_depth)
        j = head.find(ARGS, max(0, self._seen - len(ARGS)))
        if j < 0:
            self._seen = len(head)
            return None
        self._buf, self._seen = head[j + len(ARGS) :], 0
        return CallScanner((), self.max_depth, name=head[:j].strip())

    def finish(self) -> tuple[str, list[CallPart]]:
        rest, self._buf, self._scan = self._buf, "", None
        self._end_call()
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
                name = self._recipient()
                if name is not None:
                    parts += self._start(name, "")
            ends = [(self._buf.find(e), e) for e in _BODY_ENDS if e in self._buf]
            if not ends:  # the body streams, short of what could start its end
                cut = len(self._buf) - max(held_back(self._buf, e) for e in _BODY_ENDS)
                self._body(self._buf[:cut], content, parts)
                self._buf = self._buf[cut:]
                break
            k, end = min(ends)
            self._body(self._buf[:k], content, parts)
            self._buf, self._header = self._buf[k + len(end) :], None
            self._end_call()
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
        """More of the current message's body: content, or its call's arguments."""
        if self._recipient() is None:
            content.append(body)
        else:
            parts += self._more(body)

    def finish(self) -> tuple[str, list[CallPart]]:
        content: list[str] = []
        parts: list[CallPart] = []
        if self._header is not None:
            self._body(self._buf, content, parts)
        elif not self.calls:
            content.append(self._buf.removeprefix(START + _ROLE))
        self._buf, self._header = "", None
        self._end_call()
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
