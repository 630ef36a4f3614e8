"""Reasoning read out of a sample's text, as it streams (vLLM's `reasoning_parser` names).

A reasoning parser takes a sample's text piece by piece (`feed`) and hands back,
for each piece, the part that is reasoning and the part that is the answer;
`finish` flushes what it held back. A tail that could still be the start of a tag
is held back until it cannot, so the two streams never carry a piece of a tag, and
a streamed answer holds exactly what the whole text parsed at once holds.

- `deepseek_r1`: the chat template opens `<think>` in the prompt, so the text is
  reasoning from its start (a `<think>` the model writes again is dropped) until
  `</think>`; the rest is the answer. Text that never closes is all reasoning.
- `qwen3`: reasoning only when the text opens with `<think>` (with
  `enable_thinking: false` Qwen3's template closes an empty block in the prompt,
  and the text is all answer); then as `deepseek_r1`.
- `openai_gptoss`: gpt-oss's channels (the Harmony format): the `analysis`
  channel's messages are reasoning; everything else (the `final` channel, tool
  calls on `commentary`) goes on as answer text, headers and all, for the
  `openai` tool-call parser to read.
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
REASONING_PARSERS = ("deepseek_r1", "qwen3", "openai_gptoss")
# Parsers that read reasoning only where the text opens it: they can read a text a
# grammar shaped from its first token (the others would take all of it for reasoning).
OPENED_IN_TEXT = frozenset({"qwen3", "openai_gptoss"})


def held_back(text: str, tag: str) -> int:
    """How many trailing characters of `text` could be the start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


@dataclass
class ReasoningParser:
    """(reasoning, answer) of each piece; see the module docstring."""

    def feed(self, text: str) -> tuple[str, str]:
        raise NotImplementedError

    def finish(self) -> tuple[str, str]:
        return "", ""


@dataclass
class ThinkParser(ReasoningParser):
    """`<think>` ... `</think>` (deepseek_r1; qwen3 with `opens_in_text`)."""

    opens_in_text: bool = False
    _buf: str = ""
    _state: str = "start"  # start -> thinking -> answer (or start -> answer)

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        if self._state == "start":
            self._open()
        if self._state == "thinking":
            return self._thinking(), ""
        if self._state == "answer":
            out, self._buf = self._buf, ""
            return "", out
        return "", ""

    def _open(self) -> None:
        """Decide, once the text's head shows it, whether reasoning opens the text."""
        head = self._buf.lstrip()
        if head.startswith(THINK_OPEN):
            self._buf, self._state = head[len(THINK_OPEN) :], "thinking"
        elif THINK_OPEN.startswith(head):
            return  # not enough text yet to tell
        else:
            self._state = "answer" if self.opens_in_text else "thinking"

    def _thinking(self) -> str:
        j = self._buf.find(THINK_CLOSE)
        if j < 0:
            cut = len(self._buf) - held_back(self._buf, THINK_CLOSE)
            out, self._buf = self._buf[:cut], self._buf[cut:]
            return out
        out, self._buf = self._buf[:j], self._buf[j + len(THINK_CLOSE) :]
        self._state = "answer"
        return out

    def finish(self) -> tuple[str, str]:
        rest, self._buf = self._buf, ""
        if self._state == "thinking" or (self._state == "start" and not self.opens_in_text):
            return rest, ""
        return "", rest


CHANNEL, MESSAGE, END = "<|channel|>", "<|message|>", "<|end|>"
_ANALYSIS = "analysis"


@dataclass
class HarmonyReasoningParser(ReasoningParser):
    """gpt-oss: `<|channel|>analysis<|message|>...<|end|>` is reasoning; the rest, answer
    (a header runs from `<|channel|>` to `<|message|>`)."""

    _buf: str = ""
    _in_analysis: bool = False

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        reasoning: list[str] = []
        answer: list[str] = []
        while True:
            if self._in_analysis:
                j = self._buf.find(END)
                if j < 0:
                    cut = len(self._buf) - held_back(self._buf, END)
                    reasoning.append(self._buf[:cut])
                    self._buf = self._buf[cut:]
                    break
                reasoning.append(self._buf[:j])
                self._buf, self._in_analysis = self._buf[j + len(END) :], False
                continue
            opened = self._analysis_header()
            if opened is None:
                break
            answer.append(opened)
        return "".join(reasoning), "".join(answer)

    def _analysis_header(self) -> str | None:
        """Answer text before an analysis message's body (None: wait for more text)."""
        i = self._buf.find(CHANNEL + _ANALYSIS)
        if i < 0:
            cut = len(self._buf) - max(
                held_back(self._buf, CHANNEL + _ANALYSIS), _open_header(self._buf)
            )
            out, self._buf = self._buf[:cut], self._buf[cut:]
            return out or None
        j = self._buf.find(MESSAGE, i)
        if j < 0:
            out, self._buf = self._buf[:i], self._buf[i:]
            return out or None
        out = self._buf[:i]
        self._buf, self._in_analysis = self._buf[j + len(MESSAGE) :], True
        return out

    def finish(self) -> tuple[str, str]:
        rest, self._buf = self._buf, ""
        return (rest, "") if self._in_analysis else ("", rest)


def _open_header(text: str) -> int:
    """Trailing characters that are an unfinished `<|channel|>...` header (it may yet
    name the analysis channel)."""
    i = text.rfind(CHANNEL)
    if i < 0 or MESSAGE in text[i:]:
        return 0
    rest = text[i + len(CHANNEL) :]
    return len(text) - i if _ANALYSIS.startswith(rest) else 0


def reasoning_parser(name: str | None) -> ReasoningParser | None:
    """A fresh parser for one sample's text (None: no reasoning is read)."""
    if name is None:
        return None
    if name == "deepseek_r1":
        return ThinkParser(opens_in_text=False)
    if name == "qwen3":
        return ThinkParser(opens_in_text=True)
    if name == "openai_gptoss":
        return HarmonyReasoningParser()
    raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(REASONING_PARSERS)}")
