"""`POST /v1/completions`: the route, and the builder of its answer (chunks or one body).

The builder takes the request's deltas as they come and keeps, per returned choice
(prompt i, sample s: index i * n + s), what the client has been sent. Streamed, each
delta becomes a chunk; not streamed, the choices are kept until the end and
returned in one body. With `echo`, the prompt (its text and, with logprobs, its
prompt logprobs) goes first: in a choice's first chunk, or at the head of its text.
vLLM's extras: `return_token_ids` adds each choice's prompt ids (its first chunk, or
the body) and its ids; `prompt_logprobs` the prompt's table (not streamed);
`stream_options.continuous_usage_stats` the usage so far in every chunk.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request

from ..replica_messages import RequestDelta, SampleDelta
from .beam import beam_completion
from .gate import arrival
from .logprobs import completion_logprobs, prompt_logprobs_table
from .protocol import CompletionRequest
from .response_models import (
    CompletionChoice,
    CompletionResponse,
    CompletionStreamChoice,
    CompletionStreamResponse,
    UsageInfo,
)
from .serving import Prepared, Serving
from .sse import ChunkEnvelope, answer
from .state import ServingDep

router = APIRouter()


@dataclass
class _Choice:
    """One returned choice as accumulated so far."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float] | None] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    sent_chars: int = 0  # streamed: text offset of the next chunk
    echoed: bool = False
    prompt: int = 0  # the prompt it answers
    sent_prompt_ids: bool = False


class CompletionBuilder:
    def __init__(
        self, serving: Serving, req: CompletionRequest, prep: Prepared, rid: str, created: int
    ) -> None:
        self.serving = serving
        self.req = req
        self.prep = prep
        self.rid = rid
        self.created = created
        options = req.stream_options
        self.with_usage = bool(options and options.include_usage)
        self.continuous_usage = self.with_usage and bool(options and options.continuous_usage_stats)
        self.envelope = ChunkEnvelope(
            rid, "text_completion", created, serving.model_name, self.with_usage
        )
        self.choices: dict[int, _Choice] = {}
        self.num_prompt = dict.fromkeys(range(len(prep.prompts)), 0)
        self.prompt_logprobs: dict[int, list[dict[int, float] | None]] = {}
        self.completion_tokens = 0

    async def _prompt_text(self, i: int) -> str:
        return self.prep.prompt_texts[i] or await self.serving.tokenizer.decode(
            self.prep.prompts[i]
        )

    async def _new_part(
        self, i: int, d: RequestDelta, s: SampleDelta, choice: _Choice
    ) -> tuple[str, list[int], list[dict[int, float] | None]]:
        """The text, ids and logprobs this sample delta adds, the echoed prompt first."""
        text, ids = s.text, list(s.token_ids)
        lps: list[dict[int, float] | None] = list(s.logprobs or [])
        if self.req.echo and not choice.echoed:
            choice.echoed = True
            prompt = self.prep.prompts[i]
            text = await self._prompt_text(i) + text
            ids = prompt + ids
            lps = list(d.prompt_logprobs or [None] * len(prompt)) + lps
        return text, ids, lps

    async def add(self, i: int, d: RequestDelta) -> list[dict[str, Any]]:
        """Take one delta of prompt i; what it adds, as stream choices (the fields of
        `CompletionStreamChoice`, as a dict: see sse.py)."""
        self.num_prompt[i] = d.num_prompt_tokens
        self.prompt_logprobs.setdefault(i, []).extend(d.prompt_logprobs or [])
        out = []
        for s in d.samples:
            choice = self.choices.setdefault(i * self.req.n + s.index, _Choice(prompt=i))
            text, ids, lps = await self._new_part(i, d, s, choice)
            self.completion_tokens += len(s.token_ids)
            if s.finish_reason is not None:
                choice.finish_reason, choice.stop_reason = s.finish_reason, s.stop_reason
            if self.req.stream:
                if not text and not ids and s.finish_reason is None:
                    continue
                out.append(self._stream_choice(i * self.req.n + s.index, choice, text, ids, lps, s))
            else:
                choice.text.append(text)
                choice.token_ids.extend(ids)
                choice.logprobs.extend(lps)
        return out

    def _stream_choice(
        self,
        idx: int,
        choice: _Choice,
        text: str,
        ids: list[int],
        lps: list[dict[int, float] | None],
        s: SampleDelta,
    ) -> dict[str, Any]:
        logprobs = None
        if self.req.logprobs is not None:
            tok = self.serving.tokenizer
            logprobs = completion_logprobs(tok, ids, lps, choice.sent_chars).model_dump()
        choice.sent_chars += len(text)
        out = {
            "index": idx,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": s.finish_reason,
            "stop_reason": s.stop_reason,
        }
        if self.req.return_token_ids:
            if not choice.sent_prompt_ids:
                out["prompt_token_ids"] = self.prep.prompts[choice.prompt]
                choice.sent_prompt_ids = True
            out["token_ids"] = list(s.token_ids)
        return out

    def extra_fields(self) -> dict[str, Any]:
        return {"usage": self.usage().model_dump()} if self.continuous_usage else {}

    def _extras(self, c: _Choice) -> dict[str, Any]:
        """vLLM's fields of a whole choice: prompt logprobs and token ids, when asked."""
        out: dict[str, Any] = {}
        k = self.req.prompt_logprobs
        if k is not None:
            prompt = self.prep.prompts[c.prompt]
            out["prompt_logprobs"] = prompt_logprobs_table(
                self.serving.tokenizer, prompt, self.prompt_logprobs.get(c.prompt, []), k
            )
        if self.req.return_token_ids:
            prompt = self.prep.prompts[c.prompt]
            out["prompt_token_ids"] = prompt
            out["token_ids"] = c.token_ids[len(prompt) :] if self.req.echo else c.token_ids
        return out

    def chunk(self, choices: list[CompletionStreamChoice]) -> CompletionStreamResponse:
        return CompletionStreamResponse(
            id=self.rid, created=self.created, model=self.serving.model_name, choices=choices
        )

    def usage(self) -> UsageInfo:
        return UsageInfo.of(sum(self.num_prompt.values()), self.completion_tokens)

    def response(self) -> CompletionResponse:
        out = []
        for idx in sorted(self.choices):
            c = self.choices[idx]
            logprobs = None
            if self.req.logprobs is not None:
                logprobs = completion_logprobs(self.serving.tokenizer, c.token_ids, c.logprobs, 0)
            out.append(
                CompletionChoice(
                    index=idx,
                    text="".join(c.text),
                    logprobs=logprobs,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    **self._extras(c),
                )
            )
        return CompletionResponse(
            id=self.rid,
            created=self.created,
            model=self.serving.model_name,
            choices=out,
            usage=self.usage(),
        )


@router.post("/v1/completions", response_model=CompletionResponse)
async def completions(req: CompletionRequest, serving: ServingDep, request: Request) -> Any:
    arrived = arrival(request.scope)
    prep = await serving.in_time(arrived, serving.prepare_completion(req))
    # The response's id, made here whatever the client sent; the engine request's id is
    # the client's X-Request-Id while unique on this ingress (`Serving.start`).
    rid = f"cmpl-{uuid.uuid4().hex}"
    if req.use_beam_search:
        return await beam_completion(serving, req, prep, rid, arrived)
    builder = CompletionBuilder(serving, req, prep, rid, int(time.time()))
    deltas = serving.start(prep, rid, arrived)
    await deltas.admit()
    return await answer(builder, deltas, req.stream)
