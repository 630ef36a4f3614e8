"""`POST /v1/chat/completions`: the route, and the builder of its answer (chunks or one
body). A streamed choice opens with a chunk that says its role, then carries content.

With tools (`tools.py`) or a reasoning parser, each choice's text goes through its
own parser as it streams (`chat_parsing.py`): reasoning is `reasoning_content`
(vLLM's field; dropped with `include_reasoning: false`), what is plain text is
content, each call a `tool_calls` delta in OpenAI's form (the call's first part with
its id, type and name, then more arguments under the same index). A non-streamed
choice's whole text goes through a parser once.

vLLM's extras: `return_token_ids` adds the prompt's ids (the first chunk, or the
body) and each choice's ids (each chunk's new ones); `prompt_logprobs` adds the
prompt's table to the body; `stream_options.continuous_usage_stats` puts the usage
so far in every chunk.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request

from ..replica_messages import RequestDelta
from .beam import beam_chat
from .chat_parsing import ChoiceParser
from .gate import arrival
from .logprobs import chat_logprobs, prompt_logprobs_table
from .model_tool_parsers import tool_call_parser
from .protocol import ChatCompletionRequest, FunctionCall, ToolCall
from .reasoning_parsers import reasoning_parser
from .response_models import (
    ChatCompletionChoice,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    UsageInfo,
)
from .serving import Prepared, Serving
from .sse import ChunkEnvelope, answer
from .state import ServingDep
from .tool_parsers import CallPart

router = APIRouter()


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    parser: ChoiceParser | None = None  # a streamed choice's, with tools or reasoning


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
        prep: Prepared,
    ) -> None:
        self.serving = serving
        self.req = req
        assert prep.tools is not None
        self.tools = prep.tools
        self.prep = prep
        self.rid = rid
        self.created = created
        options = req.stream_options
        self.with_usage = bool(options and options.include_usage)
        self.continuous_usage = self.with_usage and bool(options and options.continuous_usage_stats)
        self.envelope = ChunkEnvelope(
            rid, "chat.completion.chunk", created, serving.model_name, self.with_usage
        )
        self.choices: dict[int, _Choice] = {}
        self.num_prompt = 0
        self.completion_tokens = 0
        self.prompt_logprobs: list[dict[int, float] | None] = []
        self._sent_prompt_ids = False

    def parser(self) -> ChoiceParser | None:
        """A fresh parser for one choice's text; None when nothing is read out of it."""
        reasoning = reasoning_parser(self.prep.reasoning_parser)
        max_depth = self.serving.limits.max_json_depth
        tools = self.tools.parser(max_depth)
        if tools is None and self.prep.reasoning_parser == "openai_gptoss":
            tools = tool_call_parser(
                "openai", max_depth=max_depth
            )  # gpt-oss's answer is in channels too
        if reasoning is None and tools is None:
            return None
        return ChoiceParser(reasoning, tools)

    def extra_fields(self) -> dict[str, Any]:
        """Top-level fields of the next chunk beyond the shared ones."""
        extra: dict[str, Any] = {}
        if self.req.return_token_ids and not self._sent_prompt_ids:
            extra["prompt_token_ids"] = self.prep.prompts[0]
            self._sent_prompt_ids = True
        if self.continuous_usage:
            extra["usage"] = self.usage().model_dump()
        return extra

    async def add(self, i: int, d: RequestDelta) -> list[dict[str, Any]]:
        """Take one delta; what it adds, as stream choices (a new choice's role first; the
        fields of `ChatCompletionStreamChoice`, as a dict: see sse.py)."""
        self.num_prompt = d.num_prompt_tokens
        self.prompt_logprobs.extend(d.prompt_logprobs or [])
        out: list[dict[str, Any]] = []
        k = self.req.top_logprobs or 0
        for s in d.samples:
            if self.req.stream and s.index not in self.choices:
                out.append(self._role_choice(s.index))
                self.choices[s.index] = _Choice(parser=self.parser())
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
                    continue  # held back: it may open a tool call or close reasoning
            chunk = _stream_choice(s.index, delta, logprobs, finish_reason, s.stop_reason)
            if self.req.return_token_ids:
                chunk["token_ids"] = list(s.token_ids)
            out.append(chunk)
        return out

    def _role_choice(self, index: int) -> dict[str, Any]:
        chunk = _stream_choice(index, {"role": "assistant", "content": ""})
        if self.req.return_token_ids:
            chunk["token_ids"] = []
        return chunk

    def _parsed_delta(self, parser: ChoiceParser, text: str, last: bool) -> dict[str, Any]:
        parsed = parser.feed(text)
        if last:
            rest = parser.finish()
            parsed.content += rest.content
            parsed.reasoning += rest.reasoning
            parsed.parts += rest.parts
        delta: dict[str, Any] = {}
        if parsed.reasoning and self.req.include_reasoning:
            delta["reasoning_content"] = parsed.reasoning
        if parsed.content:
            delta["content"] = parsed.content
        if parsed.parts:
            delta["tool_calls"] = [_tool_call_delta(p) for p in parsed.parts]
        return delta

    def _message(self, text: str, parser: ChoiceParser | None) -> ChatResponseMessage:
        """A whole choice's message; with tools, its text read for calls (`parser` is
        left holding them, for the finish reason)."""
        if parser is None:
            return ChatResponseMessage(content=text)
        parsed, rest = parser.feed(text), parser.finish()
        content = parsed.content + rest.content
        reasoning = (parsed.reasoning + rest.reasoning) or None
        if not self.req.include_reasoning:
            reasoning = None
        calls = [
            ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
            for c in parser.calls
        ]
        if calls and not content.strip():
            content = None  # type: ignore[assignment]
        return ChatResponseMessage(content=content, reasoning_content=reasoning, tool_calls=calls)

    def chunk(self, choices: list[ChatCompletionStreamChoice]) -> ChatCompletionStreamResponse:
        return ChatCompletionStreamResponse(
            id=self.rid, created=self.created, model=self.serving.model_name, choices=choices
        )

    def usage(self) -> UsageInfo:
        return UsageInfo.of(self.num_prompt, self.completion_tokens)

    def response(self) -> ChatCompletionResponse:
        k = self.req.top_logprobs or 0
        tok = self.serving.tokenizer
        ids = self.req.return_token_ids
        out = [
            ChatCompletionChoice(
                index=idx,
                message=self._message("".join(c.text), parser),
                logprobs=chat_logprobs(tok, c.token_ids, c.logprobs, k)
                if self.req.logprobs
                else None,
                finish_reason=self.tools.finish_reason(c.finish_reason, parser),
                stop_reason=c.stop_reason,
                token_ids=c.token_ids if ids else None,
            )
            for idx, c in sorted(self.choices.items())
            for parser in [self.parser()]
        ]
        prompt_lps = None
        if self.req.prompt_logprobs is not None:
            prompt_lps = prompt_logprobs_table(
                tok, self.prep.prompts[0], self.prompt_logprobs, self.req.prompt_logprobs
            )
        return ChatCompletionResponse(
            id=self.rid,
            created=self.created,
            model=self.serving.model_name,
            choices=out,
            usage=self.usage(),
            prompt_logprobs=prompt_lps,
            prompt_token_ids=self.prep.prompts[0] if ids else None,
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
    if req.use_beam_search:
        return await beam_chat(serving, req, prep, rid, arrived)
    builder = ChatBuilder(serving, req, rid, int(time.time()), prep)
    deltas = serving.start(prep, rid, arrived)
    await deltas.admit()
    return await answer(builder, deltas, req.stream)
