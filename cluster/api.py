"""The OpenAI-compatible HTTP API (FastAPI): validation, chat template, tokenization.

`create_app(backend, ...)` builds the app over any `EngineBackend`: the Ray
Serve ingress passes one that calls the replica deployment through a
streaming handle (`app.py`); the in-process tests pass one over a local
`LLMReplica`. Bad input is answered here, with OpenAI's error body, and never
reaches an engine: model name (404), limits (400 naming the limit; 413 for
the body size), prompt length against max_model_len (both numbers in the
message), sampling values (400), malformed JSON and wrong types (400). The
OpenAPI document says the same: every range, the configured limits, the one
model name, the bearer key, and each status an operation can answer.

Every answer is bounded: a request is answered only once an engine has
queued it (so a full queue is a 429 with Retry-After, never a 200 followed by
an error), and `request_timeout_s` ends one that takes too long (408, or an
error event in a stream that already started).

A request whose client goes away, queued or streaming, is cancelled: the
request's deltas are closed, which closes the replica stream, which aborts
the engine request and frees its blocks.

With an API key (vLLM's `--api-key` semantics), /v1/*, /tokenize and
/detokenize need `Authorization: Bearer <key>` (compared in constant time);
/health, /version and the docs stay open, /metrics unless `protect_metrics`.
Request ids are always made here: nothing a client sends names an engine
request.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import hashlib
import hmac
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette._utils import get_route_path  # what Starlette's router matches on
from starlette.exceptions import HTTPException as StarletteHTTPException

import pagefleet
from pagefleet.engine.errors import EngineOverloadedError
from pagefleet.engine.sampling import SamplingParams

from .config import Limits
from .dashboard import add_dashboard
from .messages import EngineRequest, RequestDelta
from .metrics import exposition
from .protocol import (
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    SamplingFields,
    StructuredOutputFields,
    TokenizeRequest,
    TokenizeResponse,
    TopLogprob,
    UsageInfo,
)
from .replica import EngineInfo
from .response_size import TokenWidths, response_bytes

logger = logging.getLogger("pagefleet.cluster")
_T = TypeVar("_T")


class EngineBackend(Protocol):
    async def info(self) -> EngineInfo: ...

    def generate(self, request: EngineRequest) -> AsyncIterator[RequestDelta]: ...

    async def metric_snapshots(self) -> list[list[Any]]: ...

    async def healthy(self) -> bool: ...


# What a 429 tells clients to wait (seconds): a queue slot frees when a request
# finishes, which at any load is well within a second or two.
RETRY_AFTER_S = 1


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers


_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    408: "TimeoutError",
    413: "RequestTooLarge",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


def _error_body(err: APIError) -> dict[str, Any]:
    """OpenAI's error body; also the last event of a stream that fails midway."""
    info = ErrorInfo(
        message=err.message, type=_TYPES.get(err.status, "Error"), param=err.param, code=err.status
    )
    return ErrorResponse(error=info).model_dump()


def error_response(
    status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(
        _error_body(APIError(status, message, param)), status_code=status, headers=headers
    )


def overloaded() -> APIError:
    return APIError(
        429,
        "The server is at capacity: every engine replica's queue is full. "
        f"Retry after {RETRY_AFTER_S} s.",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _reason(exc: BaseException) -> str:
    """What went wrong, in one line: the replica's own exception where Ray wrapped it (a
    RayTaskError's `cause`), else the first line of Ray's message (the rest is a remote
    traceback, actor ids and addresses)."""
    cause = getattr(exc, "cause", None)
    text = str(cause) if isinstance(cause, BaseException) and str(cause) else str(exc)
    lines = _ANSI.sub("", text).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def _classify(exc: BaseException) -> APIError:
    """A failure from the backend as an HTTP error (Ray re-raises replica errors as subclasses
    named after them, e.g. `RayTaskError(EngineOverloadedError)`)."""
    if isinstance(exc, APIError):
        return exc
    name = type(exc).__name__
    # Serve's BackPressureError: every replica is full and so is this caller's queue.
    if (
        isinstance(exc, EngineOverloadedError)
        or "EngineOverloaded" in name
        or "BackPressure" in name
    ):
        return overloaded()
    if isinstance(exc, ValueError):
        return APIError(400, str(exc).splitlines()[-1] if str(exc) else "invalid request")
    if "EngineDead" in name or "ActorDied" in name or "Unavailable" in name:
        return APIError(503, f"the engine replica is unavailable: {_reason(exc)}")
    return APIError(500, f"internal error: {name}: {exc}")


_UNSUPPORTED = "{} is not supported by this server"


def _refuse_structured_output(req: StructuredOutputFields) -> None:
    """A client that asked for JSON, a schema or a grammar must never get 200 and free
    text: until guided decoding exists, such a request is a 400 naming the field."""
    fmt = req.response_format
    if fmt is not None and fmt.get("type") != "text":
        kind = fmt.get("type")
        what = f"response_format of type {kind!r}" if isinstance(kind, str) else "response_format"
        raise APIError(400, _UNSUPPORTED.format(what + " (structured output)"), "response_format")
    for name in (
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "structured_outputs",
    ):
        if getattr(req, name) is not None:
            raise APIError(400, _UNSUPPORTED.format(f"{name} (structured output)"), name)


# -- request -> engine ---------------------------------------------------------------


@dataclass
class _Prepared:
    """A validated request: one prompt's token ids per engine request."""

    prompts: list[list[int]]
    prompt_texts: list[str | None]
    params: list[SamplingParams]  # one per prompt


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class OpenAIServer:
    """The request handling behind the routes; one per ingress replica."""

    def __init__(
        self,
        backend: EngineBackend,
        tokenizer: Any,
        model_name: str,
        limits: Limits,
        request_timeout_s: float | None = None,
    ) -> None:
        self.backend = backend
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.limits = limits
        self.request_timeout_s = request_timeout_s
        self._info: EngineInfo | None = None
        self._widths: TokenWidths | None = None
        self._tokenizer_thread = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="pagefleet-tokenizer"
        )

    async def info(self) -> EngineInfo:
        if self._info is None:
            self._info = await self.backend.info()
        return self._info

    async def _token_widths(self) -> TokenWidths:
        if self._widths is None:  # the whole vocabulary once, off the event loop
            info = await self.info()
            self._widths = await self.off_loop(TokenWidths.of, self.tokenizer, info.vocab_size)
        return self._widths

    async def _check_response_size(
        self, prep: _Prepared, samples: int, logprobs: int | None, echo: bool, chat: bool
    ) -> None:
        """Refuse a non-streamed request whose response could exceed max_response_bytes
        (response_size.py): the ingress builds that response whole in memory."""
        tokens = [
            (p.max_tokens or 0) + (len(ids) if echo else 0)
            for ids, p in zip(prep.prompts, prep.params, strict=True)
        ]
        bound = response_bytes(await self._token_widths(), tokens, samples, logprobs, chat)
        limit = self.limits.max_response_bytes
        if bound > limit:
            param = (
                ("top_logprobs" if chat else "logprobs") if logprobs is not None else "max_tokens"
            )
            raise APIError(
                400,
                f"the response could reach {bound} bytes, more than the limit of {limit} "
                "(max_response_bytes): ask for fewer prompts, samples, tokens or logprobs, "
                "or stream it",
                param,
            )

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"The model `{name}` does not exist.", "model")

    # -- validation --------------------------------------------------------------

    def _check_limits(
        self,
        req: SamplingFields,
        logprobs: int | None,
        best_of: int | None,
        logprobs_param: str = "logprobs",
    ) -> None:
        lim = self.limits
        if req.n > lim.max_n:
            raise APIError(400, f"n ({req.n}) exceeds the limit of {lim.max_n} samples", "n")
        if best_of is not None:
            if best_of > lim.max_n:
                raise APIError(
                    400, f"best_of ({best_of}) exceeds the limit of {lim.max_n}", "best_of"
                )
            if best_of < req.n:
                raise APIError(400, f"best_of ({best_of}) must be >= n ({req.n})", "best_of")
            if req.stream and best_of > req.n:
                raise APIError(400, "best_of > n cannot be streamed", "best_of")
        if logprobs is not None and logprobs > lim.max_logprobs:
            raise APIError(
                400,
                f"{logprobs_param} ({logprobs}) exceeds the limit of {lim.max_logprobs}",
                logprobs_param,
            )
        stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
        if len(stops) > lim.max_stop:
            raise APIError(
                400, f"{len(stops)} stop strings exceed the limit of {lim.max_stop}", "stop"
            )
        stop_ids = req.stop_token_ids or []
        if len(stop_ids) > lim.max_stop:
            raise APIError(
                400,
                f"{len(stop_ids)} stop token ids exceed the limit of {lim.max_stop}",
                "stop_token_ids",
            )

    def _sampling(
        self,
        req: SamplingFields,
        max_tokens: int | None,
        logprobs: int | None,
        best_of: int | None,
        prompt_logprobs: int | None,
    ) -> SamplingParams:
        if max_tokens is not None and max_tokens < 1:
            raise APIError(400, f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
        if max_tokens is not None and req.min_tokens > max_tokens:
            raise APIError(
                400,
                f"min_tokens ({req.min_tokens}) must be <= max_tokens ({max_tokens})",
                "min_tokens",
            )
        if (
            self.limits.max_tokens is not None
            and max_tokens is not None
            and max_tokens > self.limits.max_tokens
        ):
            raise APIError(
                400,
                f"max_tokens ({max_tokens}) exceeds the limit of {self.limits.max_tokens}",
                "max_tokens",
            )
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=0 if req.top_k is None else req.top_k,
                min_p=0.0 if req.min_p is None else req.min_p,
                seed=req.seed,
                min_tokens=req.min_tokens,
                stop=req.stop,
                stop_token_ids=req.stop_token_ids,
                ignore_eos=req.ignore_eos,
                presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty,
                repetition_penalty=1.0
                if req.repetition_penalty is None
                else req.repetition_penalty,
                skip_special_tokens=req.skip_special_tokens,
                include_stop_str_in_output=req.include_stop_str_in_output,
                n=req.n,
                best_of=best_of,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
            )
        except ValueError as e:
            raise APIError(400, str(e)) from None

    async def _check_prompt(self, ids: list[int], max_tokens: int | None) -> int | None:
        """Validate one prompt; returns max_tokens (filled in when not given)."""
        info = await self.info()
        if not ids:
            raise APIError(400, "the prompt is empty", "prompt")
        if any(t >= info.vocab_size for t in ids):
            raise APIError(
                400, f"prompt token ids must be integers in [0, {info.vocab_size})", "prompt"
            )
        limit = self.limits.max_prompt_tokens
        if limit is not None and len(ids) > limit:
            raise APIError(
                400,
                f"the prompt has {len(ids)} tokens, more than the limit of {limit} "
                "(max_prompt_tokens)",
                "prompt",
            )
        room = info.max_model_len - len(ids)
        if max_tokens is None:  # what the context leaves, within the configured limit
            if self.limits.max_tokens is not None:
                room = min(room, self.limits.max_tokens)
            if room < 1:
                raise APIError(
                    400,
                    f"This model's maximum context length is {info.max_model_len} tokens. "
                    f"However, your prompt has {len(ids)} tokens, which leaves no room for "
                    "the completion. Please reduce the length of the prompt.",
                    "prompt",
                )
            return room
        if len(ids) + max_tokens > info.max_model_len:
            raise APIError(
                400,
                f"This model's maximum context length is {info.max_model_len} tokens. "
                f"However, you requested {len(ids) + max_tokens} tokens ({len(ids)} in the "
                f"prompt, {max_tokens} in the completion). Please reduce the length of the "
                "prompt or completion.",
                "max_tokens",
            )
        return max_tokens

    async def off_loop(self, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        """Run tokenizer work on this server's tokenizer thread.

        Tokenizing a 2 MiB body takes a good part of a second: on the event loop it would
        stall every other stream of this ingress. One thread, because a Hugging Face fast
        tokenizer is not safe to call from several threads at once ("Already borrowed").
        """
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenizer_thread, lambda: fn(*args, **kwargs))

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return (await self.encode_all([text], add_special_tokens))[0]

    async def encode_all(
        self, texts: list[str], add_special_tokens: bool = True
    ) -> list[list[int]]:
        def run() -> list[list[int]]:
            # One batch call: the tokenizer's Rust side works without the GIL meanwhile.
            return self.tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]

        try:
            return await self.off_loop(run)
        except Exception as e:  # e.g. lone surrogates, which JSON allows and UTF-8 does not
            raise APIError(400, f"the text cannot be tokenized: {e}", "prompt") from None

    async def decode(self, ids: list[int]) -> str:
        return await self.off_loop(self.tokenizer.decode, ids)

    async def chat_prompt(self, messages: list[ChatMessage], add_generation_prompt: bool) -> str:
        return await self.off_loop(self._chat_prompt, messages, add_generation_prompt)

    def _chat_prompt(self, messages: list[ChatMessage], add_generation_prompt: bool) -> str:
        if not messages:
            raise APIError(400, "messages must not be empty", "messages")
        for i, m in enumerate(messages):
            if m.role == "tool" or m.tool_call_id is not None:
                raise APIError(
                    400, _UNSUPPORTED.format(f"tool messages (messages[{i}])"), f"messages.{i}.role"
                )
            if m.tool_calls:
                raise APIError(
                    400,
                    _UNSUPPORTED.format(f"assistant tool_calls (messages[{i}])"),
                    f"messages.{i}.tool_calls",
                )
        convo = [{"role": m.role, "content": m.text()} for m in messages]
        try:
            return self.tokenizer.apply_chat_template(
                convo, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except Exception as e:  # a template that rejects the conversation (e.g. roles)
            raise APIError(400, f"chat template failed: {e}", "messages") from None

    def _requested_max_tokens(self, req: CompletionRequest) -> int | None:
        """max_tokens as asked; OpenAI's default of 16 when left out, within the limit
        (a limit below 16 must not turn a request that did not ask into a 400)."""
        if "max_tokens" in req.model_fields_set or self.limits.max_tokens is None:
            return req.max_tokens
        return min(req.max_tokens or 16, self.limits.max_tokens)

    async def prepare_completion(self, req: CompletionRequest) -> _Prepared:
        self.check_model(req.model)
        _refuse_structured_output(req)
        self._check_limits(req, req.logprobs, req.best_of)
        p = req.prompt
        num_prompts = 1 if isinstance(p, str) or (p and isinstance(p[0], int)) else len(p)
        if num_prompts > self.limits.max_prompts:
            raise APIError(
                400,
                f"{num_prompts} prompts exceed the limit of {self.limits.max_prompts} per request",
                "prompt",
            )
        if isinstance(p, str):
            texts: list[str | None] = [p]
            prompts = await self.encode_all([p])
        elif p and all(isinstance(x, str) for x in p):
            texts = list(p)  # type: ignore[arg-type]
            prompts = await self.encode_all(texts)  # type: ignore[arg-type]
        elif p and all(isinstance(x, int) for x in p):
            texts, prompts = [None], [list(p)]  # type: ignore[arg-type]
        elif p and all(isinstance(x, list) for x in p):
            prompts = [list(x) for x in p]  # type: ignore[union-attr]
            texts = [None] * len(prompts)
        else:
            raise APIError(
                400,
                "prompt must be a non-empty string, list of strings, "
                "list of token ids or list of token-id lists",
                "prompt",
            )
        want_prompt_lps = req.logprobs if req.echo and req.logprobs is not None else None
        params = []
        for ids in prompts:  # without max_tokens, each prompt gets the room it leaves
            max_tokens = await self._check_prompt(ids, self._requested_max_tokens(req))
            params.append(
                self._sampling(req, max_tokens, req.logprobs, req.best_of, want_prompt_lps)
            )
        prep = _Prepared(prompts, texts, params)
        if not req.stream:
            await self._check_response_size(prep, req.n, req.logprobs, req.echo, chat=False)
        return prep

    async def prepare_chat(self, req: ChatCompletionRequest) -> _Prepared:
        self.check_model(req.model)
        _refuse_structured_output(req)
        for name in ("tools", "functions"):
            if getattr(req, name):
                raise APIError(400, _UNSUPPORTED.format(name), name)
        for name in ("tool_choice", "function_call"):
            if getattr(req, name) not in (None, "none"):
                raise APIError(400, _UNSUPPORTED.format(f'{name} other than "none"'), name)
        top = req.top_logprobs if req.logprobs else None
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        self._check_limits(req, top, None, "top_logprobs")
        text = await self.chat_prompt(req.messages, req.add_generation_prompt)
        ids = await self.encode(text, add_special_tokens=False)
        asked = (
            req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        )
        max_tokens = await self._check_prompt(ids, asked)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = self._sampling(req, max_tokens, logprobs, None, None)
        prep = _Prepared([ids], [text], [params])
        if not req.stream:
            await self._check_response_size(prep, req.n, logprobs, echo=False, chat=True)
        return prep

    # -- running -------------------------------------------------------------------

    async def run(
        self, prep: _Prepared, req: SamplingFields, request_id: str
    ) -> AsyncIterator[tuple[int, RequestDelta]]:
        """Every prompt's deltas, merged as they come: (prompt index, delta)."""
        reqs = [
            EngineRequest(
                f"{request_id}-{i}" if len(prep.prompts) > 1 else request_id,
                ids,
                params,
                stream=req.stream,
            )
            for i, (ids, params) in enumerate(zip(prep.prompts, prep.params, strict=True))
        ]
        if len(reqs) == 1:
            # aclosing: closing this generator closes the backend's at once (an abort).
            async with contextlib.aclosing(self.backend.generate(reqs[0])) as deltas:
                async for d in deltas:
                    yield 0, d
            return
        queue: asyncio.Queue[tuple[int, RequestDelta | BaseException | None]] = asyncio.Queue()

        async def pump(i: int, r: EngineRequest) -> None:
            try:
                async for d in self.backend.generate(r):
                    queue.put_nowait((i, d))
            except BaseException as e:
                queue.put_nowait((i, e))
                raise
            queue.put_nowait((i, None))

        tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(reqs)]
        try:
            remaining = len(tasks)
            while remaining:
                i, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def start(
        self, prep: _Prepared, req: SamplingFields, request_id: str, arrived: float
    ) -> _Deltas:
        """The request's deltas under its deadline (`request_timeout_s` from `arrived`)."""
        deadline = None if self.request_timeout_s is None else arrived + self.request_timeout_s
        return _Deltas(self.run(prep, req, request_id), len(prep.prompts), deadline, self)

    # -- output shaping ---------------------------------------------------------------

    def token_str(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def completion_logprobs(
        self, ids: list[int], lps: list[dict[int, float] | None], offset: int
    ) -> CompletionLogprobs:
        out = CompletionLogprobs()
        pos = offset
        for tid, top in zip(ids, lps, strict=True):
            tok = self.token_str(tid)
            out.tokens.append(tok)
            out.text_offset.append(pos)
            pos += len(tok)
            if top is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
            else:
                out.token_logprobs.append(top.get(tid))
                out.top_logprobs.append({self.token_str(t): v for t, v in top.items()})
        return out

    def chat_logprobs(self, ids: list[int], lps: list[dict[int, float]], k: int) -> ChatLogprobs:
        content = []
        for tid, top in zip(ids, lps, strict=True):
            tok = self.token_str(tid)
            ranked = sorted(top.items(), key=lambda kv: -kv[1])[:k]
            content.append(
                ChatTokenLogprob(
                    token=tok,
                    logprob=top.get(tid, float("-inf")),
                    bytes=list(tok.encode()),
                    top_logprobs=[
                        TopLogprob(
                            token=(s := self.token_str(t)), logprob=v, bytes=list(s.encode())
                        )
                        for t, v in ranked
                    ],
                )
            )
        return ChatLogprobs(content=content)


class _Deltas:
    """One request's merged (prompt index, delta) stream, bounded by its deadline.

    `admit()` waits until an engine has queued every prompt (each replica stream starts
    with an empty delta saying so); only then does the endpoint answer 200. A deadline
    that passes, at any point, is an APIError 408. `aclose()` aborts what is left, even
    from a cancelled task (Starlette cancels a stream whose client went away).
    """

    def __init__(
        self,
        gen: AsyncIterator[tuple[int, RequestDelta]],
        num_prompts: int,
        deadline: float | None,
        server: OpenAIServer,
    ) -> None:
        self._gen = gen
        self._num_prompts = num_prompts
        self._deadline = deadline
        self._server = server
        self._buffer: collections.deque[tuple[int, RequestDelta]] = collections.deque()

    async def _next(self) -> tuple[int, RequestDelta]:
        try:
            async with asyncio.timeout_at(self._deadline):
                return await anext(self._gen)
        except TimeoutError:
            raise APIError(
                408,
                "the request did not finish within the server's request_timeout_s "
                f"({self._server.request_timeout_s:g} s) and was cancelled",
            ) from None

    async def admit(self) -> None:
        """Return once every prompt is queued; raises why one was not (as an APIError)."""
        admitted: set[int] = set()
        try:
            while len(admitted) < self._num_prompts:
                i, d = await self._next()
                if i in admitted or d.samples or d.finished:
                    self._buffer.append((i, d))
                admitted.add(i)
        except StopAsyncIteration:
            await self.aclose()
            raise APIError(503, "the engine replica ended the request before queueing it") from None
        except BaseException as e:
            await self.aclose()
            if isinstance(e, Exception):
                raise _classify(e) from None
            raise

    def __aiter__(self) -> _Deltas:
        return self

    async def __anext__(self) -> tuple[int, RequestDelta]:
        if self._buffer:
            return self._buffer.popleft()
        return await self._next()

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            await self._gen.aclose()  # type: ignore[attr-defined]


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


# -- the app -------------------------------------------------------------------------


_KEYED_PREFIXES = ("/v1", "/tokenize", "/detokenize", "/dashboard/data")


def _is_keyed(path: str, protect_metrics: bool) -> bool:
    """Whether `path` needs the API key (prefix match on whole segments, as routes match)."""
    prefixes = (*_KEYED_PREFIXES, "/metrics") if protect_metrics else _KEYED_PREFIXES
    return any(path == p or path.startswith(p + "/") for p in prefixes)


def _scope_is_keyed(scope: dict[str, Any], protect_metrics: bool) -> bool:
    """Whether the route this request reaches needs the key.

    Under a prefix (Serve's `route_prefix`, `http_options.root_path`) the scope's path
    keeps the prefix and `root_path` names it; Starlette routes on the path without it.
    The gate asks Starlette's own function, so it judges exactly the path the router
    will match, and also the full path, so that neither reading can open a keyed route.
    """
    return _is_keyed(get_route_path(scope), protect_metrics) or _is_keyed(
        scope["path"], protect_metrics
    )


def _digest(key: str) -> bytes:
    # Comparing fixed-length digests keeps even the key's length out of the timing.
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


class _Gate:
    """Pure ASGI middleware in front of every route: the API key, then the body size.

    Both run before FastAPI reads or parses anything, so an unauthenticated or oversized
    request costs no JSON parsing. The body is read here (bounded) and replayed to the app;
    later `receive` calls (a stream's disconnect watch) go to the server as before.
    """

    def __init__(
        self, app: Any, api_key: str | None, protect_metrics: bool, max_body_bytes: int
    ) -> None:
        self.app = app
        self._key = _digest(api_key) if api_key else None
        self._protect_metrics = protect_metrics
        self._max_body = max_body_bytes

    def _authorized(self, scope: dict[str, Any]) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                if scheme.lower() == "bearer" and self._key is not None:
                    return hmac.compare_digest(_digest(token.strip()), self._key)
        return False

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if (
            self._key is not None
            and scope["method"] != "OPTIONS"
            and _scope_is_keyed(scope, self._protect_metrics)
            and not self._authorized(scope)
        ):
            # Never echo what was sent: a wrong key may be a real one for something else.
            response = error_response(
                401,
                "Missing or invalid API key: send `Authorization: Bearer <key>`.",
                headers={"WWW-Authenticate": "Bearer"},
            )
            await response(scope, receive, send)
            return
        too_large = error_response(
            413,
            f"the request body exceeds the limit of {self._max_body} bytes (max_body_bytes)",
        )
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > self._max_body:
                    await too_large(scope, receive, send)
                    return
        if scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        # Read the whole body (chunked bodies declare no length), counting as it comes.
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending it all
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self._max_body:
                await too_large(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replaying_receive() -> dict[str, Any]:
            return replay.pop(0) if replay else await receive()

        await self.app(scope, replaying_receive, send)


def _field_path(loc: Any) -> str:
    """A pydantic error location as the client wrote it: where it was (`body`, `query`)
    and union-branch tags (`str`, `list[int]`, `constrained-str`) left out, list indices
    kept."""
    parts = []
    for i, p in enumerate(loc):
        if (i == 0 and p in _PLACES) or (
            isinstance(p, str) and ("[" in p or "-" in p or p in _TAGS)
        ):
            continue
        parts.append(str(p))
    return ".".join(parts)


_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}
_PLACES = {"body", "query", "path", "header", "cookie"}


def _validation_message(errs: list[Any]) -> tuple[str, str | None]:
    """(message, param) for FastAPI's validation errors: the first field's, with every
    reason a union gave for it (a prompt is a string or one of three list forms)."""
    if not errs:
        return "invalid request", None
    where = _field_path(errs[0].get("loc", ()))
    top = where.split(".")[0]
    reasons = []
    for e in errs:
        path = _field_path(e.get("loc", ()))
        if path.split(".")[0] == top and e.get("msg") not in reasons:
            reasons.append(e.get("msg", "invalid"))
    msg = "; or ".join(reasons[:4])
    return (f"{where}: {msg}" if where else msg), top or None


# What each operation can answer besides 200, for the OpenAPI document.
_ERROR_DOCS = {
    400: "invalid request: a value, a limit (named in the message), the context length",
    401: "missing or invalid API key",
    404: "unknown model",
    408: "request_timeout_s passed before the request finished; it was cancelled",
    413: "request body larger than limits.max_body_bytes",
    429: "every engine replica's queue is full; retry after Retry-After seconds",
    503: "no engine replica is available",
}
_GENERATE_ERRORS = (400, 404, 408, 413, 429, 503)


def _nonnull(prop: dict[str, Any]) -> list[dict[str, Any]]:
    """The non-null branches of a (possibly Optional / union) property schema."""
    branches = prop.get("anyOf", [prop])
    return [b for b in branches if b.get("type") != "null"]


def _token_id_arrays(prop: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every array-of-integers schema within `prop` (token-id lists, nested or not)."""
    for b in _nonnull(prop):
        if b.get("type") == "array":
            items = b.get("items", {})
            if items.get("type") == "integer":
                yield b
            else:
                yield from _token_id_arrays(items)


def _document(
    schema: dict[str, Any],
    limits: Limits,
    model_name: str,
    keyed: bool,
    protect_metrics: bool,
    info: EngineInfo | None,
) -> None:
    """Make the generated OpenAPI document say what this server enforces.

    FastAPI knows the models' static ranges; this adds the configured limits, the
    engine's numbers (token ids below its vocabulary size, new tokens below its context
    length), the one model name, the bearer key, the statuses each operation answers
    (our 400s, never FastAPI's 422), the SSE alternative of the generating endpoints,
    and the bodies of /metrics and /health.
    """
    comps = schema.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        comps.pop(name, None)
    max_new = limits.max_tokens
    if info is not None:
        max_new = min(max_new or info.max_model_len, info.max_model_len - 1)
        token_lists = [
            comps.get("CompletionRequest", {}).get("properties", {}).get("prompt", {}),
            comps.get("DetokenizeRequest", {}).get("properties", {}).get("tokens", {}),
        ] + [
            comps.get(n, {}).get("properties", {}).get("stop_token_ids", {})
            for n in ("CompletionRequest", "ChatCompletionRequest")
        ]
        for prop in token_lists:
            for arr in _token_id_arrays(prop):
                arr["items"]["maximum"] = info.vocab_size - 1
    requests = [comps[n] for n in ("CompletionRequest", "ChatCompletionRequest") if n in comps]
    for model in requests:
        props = model["properties"]
        for b in _nonnull(props["n"]):
            b["maximum"] = limits.max_n
        # min_tokens > max_tokens is refused, so min_tokens is bounded as max_tokens is.
        for key in ("max_tokens", "max_completion_tokens", "min_tokens"):
            if key in props and max_new is not None:
                for b in _nonnull(props[key]):
                    b["maximum"] = max_new
        for b in _nonnull(props["stop"]):
            if b.get("type") == "array":
                b["maxItems"] = limits.max_stop
        for b in _nonnull(props["stop_token_ids"]):
            b["maxItems"] = limits.max_stop
        for key in ("best_of",):
            if key in props:
                for b in _nonnull(props[key]):
                    b["maximum"] = limits.max_n
        for key in ("logprobs", "top_logprobs"):
            if key in props:
                for b in _nonnull(props[key]):
                    if b.get("type") == "integer":
                        b["maximum"] = limits.max_logprobs
    if "CompletionRequest" in comps:
        for b in _nonnull(comps["CompletionRequest"]["properties"]["prompt"]):
            if b.get("type") == "array" and b.get("items", {}).get("type") != "integer":
                b["maxItems"] = limits.max_prompts
    for model in comps.values():  # every request's `model`: only the served name exists
        props = model.get("properties", {})
        if "model" in props and model.get("title", "").endswith("Request"):
            props["model"]["anyOf"] = [{"type": "string", "enum": [model_name]}, {"type": "null"}]
    if keyed:
        schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    error_ref = {"$ref": "#/components/schemas/ErrorResponse"}

    def error(status: int) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "description": _ERROR_DOCS[status],
            "content": {"application/json": {"schema": error_ref}},
        }
        if status == 429:
            doc["headers"] = {"Retry-After": {"schema": {"type": "integer"}}}
        return doc

    for path, item in schema["paths"].items():
        for method, op in item.items():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            if method == "post":
                statuses = _GENERATE_ERRORS if path.startswith("/v1/") else (400, 404, 413)
                for status in statuses:
                    responses[str(status)] = error(status)
                if path in ("/v1/completions", "/v1/chat/completions"):
                    # Before OpenAPI 3.2 (no itemSchema) `schema` describes one event.
                    responses["200"]["content"]["text/event-stream"] = {
                        "schema": {
                            "type": "object",
                            "description": "with stream: true, one server-sent event per chunk",
                            "properties": {
                                "data": {
                                    "type": "string",
                                    "description": "a JSON chunk (OpenAI's chunk object, or "
                                    "its error body), or [DONE] at the end",
                                }
                            },
                            "required": ["data"],
                        }
                    }
            if path == "/dashboard/data":
                responses["400"] = error(400)  # `minutes` out of range
            if keyed and _is_keyed(path, protect_metrics):
                op["security"] = [{"bearer": []}]
                responses["401"] = error(401)
    if "/metrics" in schema["paths"]:
        schema["paths"]["/metrics"]["get"]["responses"]["200"] = {
            "description": "Prometheus text exposition of every replica's series",
            "content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}},
        }
    if "/health" in schema["paths"]:
        schema["paths"]["/health"]["get"]["responses"] = {
            "200": {"description": "an engine replica answers (empty body)"},
            "503": error(503),
        }


def create_app(
    backend: EngineBackend,
    tokenizer: Any,
    model_name: str,
    limits: Limits | None = None,
    on_shutdown: Callable[[], Awaitable[None]] | None = None,
    *,
    api_key: str | None = None,
    protect_metrics: bool = False,
    request_timeout_s: float | None = None,
) -> FastAPI:
    """The app. api_key: what `Authorization: Bearer` must carry (None: no key);
    request_timeout_s: the most a request may take, queued or running (None: no bound)."""
    limits = limits or Limits()
    server = OpenAIServer(backend, tokenizer, model_name, limits, request_timeout_s)
    # /openapi.json and /docs are ours (below): the document needs the engine's numbers.
    app = FastAPI(
        title="pagefleet",
        version=pagefleet.__version__,
        description="OpenAI-compatible LLM serving on Ray Serve",
        openapi_url=None,
        docs_url=None,
        redoc_url=None,
    )
    app.state.server = server
    app.add_middleware(
        _Gate,  # type: ignore[arg-type]
        api_key=api_key,
        protect_metrics=protect_metrics,
        max_body_bytes=limits.max_body_bytes,
    )
    if on_shutdown is not None:
        app.router.on_shutdown.append(on_shutdown)
    add_dashboard(app, backend)  # /dashboard, /dashboard/data (dashboard.py)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        first = errs[0] if errs else {}
        if first.get("type") == "json_invalid":
            msg = first.get("msg", "invalid JSON")
            return error_response(400, f"the request body is not valid JSON: {msg}")
        return error_response(400, *_validation_message(errs))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        err = _classify(exc)
        if err.status >= 500:
            logger.error("request failed: %s", err.message)
        return error_response(err.status, err.message, err.param, err.headers)

    @app.get("/health")
    async def health() -> Response:
        if await backend.healthy():
            return Response(status_code=200)
        return error_response(503, "no healthy engine replica")

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": pagefleet.__version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(
            exposition(await backend.metric_snapshots()), media_type=CONTENT_TYPE_LATEST
        )

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        info = await server.info()
        return ModelList(
            data=[ModelCard(id=model_name, root=model_name, max_model_len=info.max_model_len)]
        )

    @app.post("/tokenize", response_model=TokenizeResponse)
    async def tokenize(req: TokenizeRequest) -> TokenizeResponse:
        server.check_model(req.model)
        if req.messages is not None:
            text = await server.chat_prompt(req.messages, req.add_generation_prompt)
            ids = await server.encode(text, add_special_tokens=False)
        else:  # the model requires one of the two
            ids = await server.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        info = await server.info()
        return TokenizeResponse(count=len(ids), max_model_len=info.max_model_len, tokens=ids)

    @app.post("/detokenize", response_model=DetokenizeResponse)
    async def detokenize(req: DetokenizeRequest) -> DetokenizeResponse:
        server.check_model(req.model)
        info = await server.info()
        if any(t >= info.vocab_size for t in req.tokens):
            raise APIError(400, f"tokens must be integers in [0, {info.vocab_size})", "tokens")
        return DetokenizeResponse(prompt=await server.decode(req.tokens))

    @app.post("/v1/completions", response_model=CompletionResponse)
    async def completions(req: CompletionRequest) -> Any:
        arrived = asyncio.get_running_loop().time()
        prep = await server.prepare_completion(req)
        # Made here whatever the client sent (a `request_id` field, an X-Request-Id
        # header): ids name engine requests, so a client must never choose one.
        rid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        n = req.n
        deltas = server.start(prep, req, rid, arrived)
        await deltas.admit()
        if req.stream:
            return StreamingResponse(
                _stream_completion(server, req, prep, deltas, rid, created, n),
                media_type="text/event-stream",
            )
        choices: dict[int, _Choice] = {}
        prompt_lps: dict[int, list[dict[int, float] | None]] = {}
        num_prompt = dict.fromkeys(range(len(prep.prompts)), 0)
        try:
            async for i, d in deltas:
                num_prompt[i] = d.num_prompt_tokens
                if d.prompt_logprobs is not None:
                    prompt_lps[i] = d.prompt_logprobs
                for s in d.samples:
                    _accumulate(choices.setdefault(i * n + s.index, _Choice()), s)
        except Exception as e:
            raise _classify(e) from None
        finally:
            await deltas.aclose()
        out = []
        for idx in sorted(choices):
            c = choices[idx]
            i = idx // n
            text = "".join(c.text)
            ids, lps = c.token_ids, c.logprobs
            prefix_ids: list[int] = []
            prefix_lps: list[dict[int, float] | None] = []
            if req.echo:
                prompt_text = prep.prompt_texts[i] or await server.decode(prep.prompts[i])
                text = prompt_text + text
                prefix_ids = prep.prompts[i]
                prefix_lps = prompt_lps.get(i, [None] * len(prefix_ids))
            logprobs = None
            if req.logprobs is not None:
                logprobs = server.completion_logprobs(prefix_ids + ids, [*prefix_lps, *lps], 0)
            out.append(
                CompletionChoice(
                    index=idx,
                    text=text,
                    logprobs=logprobs,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
            )
        completion_tokens = sum(len(c.token_ids) for c in choices.values())
        prompt_tokens = sum(num_prompt.values())
        return CompletionResponse(
            id=rid,
            created=created,
            model=model_name,
            choices=out,
            usage=_usage(prompt_tokens, completion_tokens),
        )

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse)
    async def chat(req: ChatCompletionRequest) -> Any:
        arrived = asyncio.get_running_loop().time()
        prep = await server.prepare_chat(req)
        rid = f"chatcmpl-{uuid.uuid4().hex}"  # server-side, as for completions
        created = int(time.time())
        deltas = server.start(prep, req, rid, arrived)
        await deltas.admit()
        if req.stream:
            return StreamingResponse(
                _stream_chat(server, req, deltas, rid, created), media_type="text/event-stream"
            )
        choices: dict[int, _Choice] = {}
        num_prompt = 0
        try:
            async for _, d in deltas:
                num_prompt = d.num_prompt_tokens
                for s in d.samples:
                    _accumulate(choices.setdefault(s.index, _Choice()), s)
        except Exception as e:
            raise _classify(e) from None
        finally:
            await deltas.aclose()
        out = [
            ChatCompletionChoice(
                index=idx,
                message=ChatResponseMessage(content="".join(c.text)),
                logprobs=server.chat_logprobs(c.token_ids, c.logprobs, req.top_logprobs or 0)
                if req.logprobs
                else None,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
            for idx, c in sorted(choices.items())
        ]
        completion_tokens = sum(len(c.token_ids) for c in choices.values())
        return ChatCompletionResponse(
            id=rid,
            created=created,
            model=model_name,
            choices=out,
            usage=_usage(num_prompt, completion_tokens),
        )

    def openapi(info: EngineInfo | None = None) -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title,
                version=app.version,
                description=app.description,
                routes=app.routes,
            )
            _document(schema, limits, model_name, api_key is not None, protect_metrics, info)
            if info is None:
                return schema  # without the engine's numbers: not kept, asked again next time
            app.openapi_schema = schema
        return app.openapi_schema

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi_json() -> JSONResponse:
        try:  # bounded: with no engine replica up, the document goes without its numbers
            info: EngineInfo | None = await asyncio.wait_for(server.info(), 10)
        except Exception:
            info = None
        return JSONResponse(openapi(info))

    @app.get("/docs", include_in_schema=False)
    async def docs() -> Response:
        return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{app.title} - API")

    app.openapi = openapi  # type: ignore[method-assign]
    return app


def _accumulate(choice: _Choice, s: Any) -> None:
    choice.text.append(s.text)
    choice.token_ids.extend(s.token_ids)
    if s.logprobs:
        choice.logprobs.extend(s.logprobs)
    if s.finish_reason is not None:
        choice.finish_reason, choice.stop_reason = s.finish_reason, s.stop_reason


def _usage(prompt: int, completion: int) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )


async def _stream_completion(
    server: OpenAIServer,
    req: CompletionRequest,
    prep: _Prepared,
    deltas: _Deltas,
    rid: str,
    created: int,
    n: int,
) -> AsyncIterator[str]:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    base = {"id": rid, "object": "text_completion", "created": created, "model": server.model_name}
    offsets: dict[int, int] = {}
    num_prompt: dict[int, int] = {}
    completion_tokens = 0
    echoed: set[int] = set()
    try:
        async for i, d in deltas:
            num_prompt[i] = d.num_prompt_tokens
            for s in d.samples:
                idx = i * n + s.index
                text, ids = s.text, s.token_ids
                lps: list[dict[int, float] | None] = list(s.logprobs or [])
                if req.echo and idx not in echoed:
                    echoed.add(idx)
                    prompt_text = prep.prompt_texts[i] or await server.decode(prep.prompts[i])
                    text = prompt_text + text
                    ids = prep.prompts[i] + ids
                    lps = list(d.prompt_logprobs or [None] * len(prep.prompts[i])) + lps
                if not text and not ids and s.finish_reason is None:
                    continue
                completion_tokens += len(s.token_ids)
                logprobs = None
                if req.logprobs is not None:
                    logprobs = server.completion_logprobs(
                        ids, lps, offsets.get(idx, 0)
                    ).model_dump()
                offsets[idx] = offsets.get(idx, 0) + len(text)
                chunk = {
                    **base,
                    "choices": [
                        {
                            "index": idx,
                            "text": text,
                            "logprobs": logprobs,
                            "finish_reason": s.finish_reason,
                            "stop_reason": s.stop_reason,
                        }
                    ],
                }
                if include_usage:
                    chunk["usage"] = None
                yield _sse(chunk)
    except Exception as e:
        yield _sse(_error_body(_classify(e)))
        yield "data: [DONE]\n\n"
        return
    finally:
        await deltas.aclose()  # a no-op when finished; an abort when the client left
    if include_usage:
        prompt_tokens = sum(num_prompt.values())
        yield _sse(
            {**base, "choices": [], "usage": _usage(prompt_tokens, completion_tokens).model_dump()}
        )
    yield "data: [DONE]\n\n"


async def _stream_chat(
    server: OpenAIServer, req: ChatCompletionRequest, deltas: _Deltas, rid: str, created: int
) -> AsyncIterator[str]:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    base = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": server.model_name,
    }
    usage_field = {"usage": None} if include_usage else {}
    num_prompt = 0
    completion_tokens = 0
    started: set[int] = set()
    try:
        async for _, d in deltas:
            num_prompt = d.num_prompt_tokens
            for s in d.samples:
                if s.index not in started:
                    started.add(s.index)
                    yield _sse(
                        {
                            **base,
                            "choices": [
                                {
                                    "index": s.index,
                                    "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None,
                                    "finish_reason": None,
                                }
                            ],
                            **usage_field,
                        }
                    )
                if not s.text and not s.token_ids and s.finish_reason is None:
                    continue
                completion_tokens += len(s.token_ids)
                logprobs = None
                if req.logprobs and s.logprobs:
                    logprobs = server.chat_logprobs(
                        s.token_ids, s.logprobs, req.top_logprobs or 0
                    ).model_dump()
                delta = {"content": s.text} if s.text or s.finish_reason is None else {}
                yield _sse(
                    {
                        **base,
                        "choices": [
                            {
                                "index": s.index,
                                "delta": delta,
                                "logprobs": logprobs,
                                "finish_reason": s.finish_reason,
                                "stop_reason": s.stop_reason,
                            }
                        ],
                        **usage_field,
                    }
                )
    except Exception as e:
        yield _sse(_error_body(_classify(e)))
        yield "data: [DONE]\n\n"
        return
    finally:
        await deltas.aclose()  # a no-op when finished; an abort when the client left
    if include_usage:
        yield _sse(
            {**base, "choices": [], "usage": _usage(num_prompt, completion_tokens).model_dump()}
        )
    yield "data: [DONE]\n\n"
