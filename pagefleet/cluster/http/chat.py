"""`POST /v1/chat/completions`: the route, and the builder of its answer (chunks or one
body). A streamed choice opens with a chunk that says its role, then carries content.

With tools (`tools.py`), each choice's text goes through its own tool-call parser as
it streams: what is plain text is content, each call a `tool_calls` delta in OpenAI's
form (the call's first part with its id, type and name, then more arguments under
the same index). A non-streamed choice's whole text goes through a parser once.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request

from ..replica_messages import RequestDelta
from .gate import arrival
from .logprobs import chat_logprobs
from .protocol import (
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    FunctionCall,
    ToolCall,
    UsageInfo,
)
from .serving import Serving
from .sse import ChunkEnvelope, answer
from .state import ServingDep
from .tool_parsers import CallPart, ToolCallParser
from .tools import ToolPlan

router = APIRouter()


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    parser: ToolCallParser | None = None  # a streamed choice's, with tools


def _tool_call_delta(part: CallPart) -> dict[str, Any]:
    """`DeltaToolCall`'s fields as sent: id, type and name on a call's first part only."""
    if part.id is None:
        return {"index": part.index, "function": {"arguments": part.arguments}}
    return {
        "index": part.index,
        "id": part.id,
        "type": "function",
        "function": {"name": part.name, "arguments": part.arguments},
    }


class ChatBuilder:
    def __init__(
        self,
        serving: Serving,
        req: ChatCompletionRequest,
        rid: str,
        created: int,
        tools: ToolPlan | None = None,
    ) -> None:
        self.serving = serving
        self.req = req
        self.tools = tools or ToolPlan("none")
        self.rid = rid
        self.created = created
        self.with_usage = bool(req.stream_options and req.stream_options.include_usage)
        self.envelope = ChunkEnvelope(
            rid, "chat.completion.chunk", created, serving.model_name, self.with_usage
        )
        self.choices: dict[int, _Choice] = {}
        self.num_prompt = 0
        self.completion_tokens = 0

    async def add(self, i: int, d: RequestDelta) -> list[dict[str, Any]]:
        """Take one delta; what it adds, as stream choices (a new choice's role first; the
        fields of `ChatCompletionStreamChoice`, as a dict: see sse.py)."""
        self.num_prompt = d.num_prompt_tokens
        out: list[dict[str, Any]] = []
        k = self.req.top_logprobs or 0
        for s in d.samples:
            if self.req.stream and s.index not in self.choices:
                out.append(_stream_choice(s.index, {"role": "assistant", "content": ""}))
                self.choices[s.index] = _Choice(
                    parser=self.tools.parser(self.serving.limits.max_json_depth)
                )
            choice = self.choices.setdefault(s.index, _Choice())
            self.completion_tokens += len(s.token_ids)
            if s.finish_reason is not None:
                choice.finish_reason, choice.stop_reason = s.finish_reason, s.stop_reason
            if not self.req.stream:
                choice.text.append(s.text)
                choice.token_ids.extend(s.token_ids)
                choice.logprobs.extend(s.logprobs or [])
                continue
            if not s.text and not s.token_ids and s.finish_reason is None:
                continue
            logprobs = None
            if self.req.logprobs and s.logprobs:
                tok = self.serving.tokenizer
                logprobs = chat_logprobs(tok, s.token_ids, s.logprobs, k).model_dump()
            finish_reason = s.finish_reason
            if choice.parser is None:
                # DeltaMessage sends only the fields it carries: no content on a bare finish.
                delta = {"content": s.text} if s.text or s.finish_reason is None else {}
            else:
                delta = self._parsed_delta(choice.parser, s.text, s.finish_reason is not None)
                finish_reason = self.tools.finish_reason(finish_reason, choice.parser)
                if not delta and not logprobs and finish_reason is None:
                    continue  # held back: it may open a tool call
            out.append(_stream_choice(s.index, delta, logprobs, finish_reason, s.stop_reason))
        return out

    @staticmethod
    def _parsed_delta(parser: ToolCallParser, text: str, last: bool) -> dict[str, Any]:
        content, parts = parser.feed(text)
        if last:
            rest, more = parser.finish()
            content, parts = content + rest, parts + more
        delta: dict[str, Any] = {}
        if content:
            delta["content"] = content
        if parts:
            delta["tool_calls"] = [_tool_call_delta(p) for p in parts]
        return delta

    @staticmethod
    def _message(text: str, parser: ToolCallParser | None) -> ChatResponseMessage:
        """A whole choice's message; with tools, its text read for calls (`parser` is
        left holding them, for the finish reason)."""
        if parser is None:
            return ChatResponseMessage(content=text)
        content, _ = parser.feed(text)
        rest, _ = parser.finish()
        content += rest
        calls = [
            ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
            for c in parser.calls
        ]
        if calls and not content.strip():
            return ChatResponseMessage(content=None, tool_calls=calls)
        return ChatResponseMessage(content=content, tool_calls=calls)

    def chunk(self, choices: list[ChatCompletionStreamChoice]) -> ChatCompletionStreamResponse:
        return ChatCompletionStreamResponse(
            id=self.rid, created=self.created, model=self.serving.model_name, choices=choices
        )

    def usage(self) -> UsageInfo:
        return UsageInfo.of(self.num_prompt, self.completion_tokens)

    def response(self) -> ChatCompletionResponse:
        k = self.req.top_logprobs or 0
        tok = self.serving.tokenizer
        out = [
            ChatCompletionChoice(
                index=idx,
                message=self._message("".join(c.text), parser),
                logprobs=chat_logprobs(tok, c.token_ids, c.logprobs, k)
                if self.req.logprobs
                else None,
                finish_reason=self.tools.finish_reason(c.finish_reason, parser),
                stop_reason=c.stop_reason,
            )
            for idx, c in sorted(self.choices.items())
            for parser in [self.tools.parser(self.serving.limits.max_json_depth)]
        ]
        return ChatCompletionResponse(
            id=self.rid,
            created=self.created,
            model=self.serving.model_name,
            choices=out,
            usage=self.usage(),
        )


def _stream_choice(
    index: int,
    delta: dict[str, Any],
    logprobs: dict[str, Any] | None = None,
    finish_reason: str | None = None,
    stop_reason: str | int | None = None,
) -> dict[str, Any]:
    """`ChatCompletionStreamChoice`'s fields, in its order."""
    return {
        "index": index,
        "delta": delta,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse)
async def chat(req: ChatCompletionRequest, serving: ServingDep, request: Request) -> Any:
    arrived = arrival(request.scope)
    prep = await serving.in_time(arrived, serving.prepare_chat(req))
    rid = f"chatcmpl-{uuid.uuid4().hex}"  # server-side, as for completions
    builder = ChatBuilder(serving, req, rid, int(time.time()), prep.tools)
    deltas = serving.start(prep, rid, arrived)
    await deltas.admit()
    return await answer(builder, deltas, req.stream)
