"""The OpenAI-compatible HTTP API (FastAPI): validation, chat template, tokenization.

`create_app(backend, ...)` builds the app over any `EngineBackend`: the Ray
Serve ingress passes one that calls the replica deployment through a
streaming handle (`app.py`); the in-process tests pass one over a local
`LLMReplica`. Bad input is answered here, with OpenAI's error body, and never
reaches an engine: model name (404), limits, prompt length against
max_model_len (both numbers in the message), sampling values (400),
malformed JSON and wrong types (400).

A streamed request whose client goes away is cancelled: Starlette stops the
SSE generator, which closes the replica stream, which aborts the engine
request and frees its blocks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

import pagefleet
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
    TokenizeRequest,
    TokenizeResponse,
    TopLogprob,
    UsageInfo,
)
from .replica import EngineInfo

logger = logging.getLogger("pagefleet.cluster")


class EngineBackend(Protocol):
    async def info(self) -> EngineInfo: ...

    def generate(self, request: EngineRequest) -> AsyncIterator[RequestDelta]: ...

    async def metric_snapshots(self) -> list[list[Any]]: ...

    async def healthy(self) -> bool: ...


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
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


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(_error_body(APIError(status, message, param)), status_code=status)


def _classify(exc: BaseException) -> APIError:
    """A failure from the backend as an HTTP error (Ray re-raises replica errors as subclasses)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ValueError):
        return APIError(400, str(exc).splitlines()[-1] if str(exc) else "invalid request")
    name = type(exc).__name__
    if "EngineDead" in name or "ActorDied" in name or "Unavailable" in name:
        return APIError(503, f"the engine replica is unavailable: {exc}")
    return APIError(500, f"internal error: {name}: {exc}")


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
        self, backend: EngineBackend, tokenizer: Any, model_name: str, limits: Limits
    ) -> None:
        self.backend = backend
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.limits = limits
        self._info: EngineInfo | None = None

    async def info(self) -> EngineInfo:
        if self._info is None:
            self._info = await self.backend.info()
        return self._info

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"The model `{name}` does not exist.", "model")

    # -- validation --------------------------------------------------------------

    def _check_limits(self, req: SamplingFields, logprobs: int | None, best_of: int | None) -> None:
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
                400, f"logprobs ({logprobs}) exceeds the limit of {lim.max_logprobs}", "logprobs"
            )
        stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
        if len(stops) > lim.max_stop:
            raise APIError(
                400, f"{len(stops)} stop strings exceed the limit of {lim.max_stop}", "stop"
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
        room = info.max_model_len - len(ids)
        if max_tokens is None:
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

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def chat_prompt(self, messages: list[ChatMessage], add_generation_prompt: bool) -> str:
        if not messages:
            raise APIError(400, "messages must not be empty", "messages")
        convo = [{"role": m.role, "content": m.text()} for m in messages]
        try:
            return self.tokenizer.apply_chat_template(
                convo, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except Exception as e:  # a template that rejects the conversation (e.g. roles)
            raise APIError(400, f"chat template failed: {e}", "messages") from None

    async def prepare_completion(self, req: CompletionRequest) -> _Prepared:
        self.check_model(req.model)
        self._check_limits(req, req.logprobs, req.best_of)
        p = req.prompt
        if isinstance(p, str):
            texts: list[str | None] = [p]
            prompts = [self.encode(p)]
        elif p and all(isinstance(x, str) for x in p):
            texts = list(p)  # type: ignore[arg-type]
            prompts = [self.encode(x) for x in p]  # type: ignore[arg-type]
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
            max_tokens = await self._check_prompt(ids, req.max_tokens)
            params.append(
                self._sampling(req, max_tokens, req.logprobs, req.best_of, want_prompt_lps)
            )
        return _Prepared(prompts, texts, params)

    async def prepare_chat(self, req: ChatCompletionRequest) -> _Prepared:
        self.check_model(req.model)
        top = req.top_logprobs if req.logprobs else None
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        self._check_limits(req, top, None)
        text = self.chat_prompt(req.messages, req.add_generation_prompt)
        ids = self.encode(text, add_special_tokens=False)
        asked = (
            req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        )
        max_tokens = await self._check_prompt(ids, asked)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = self._sampling(req, max_tokens, logprobs, None, None)
        return _Prepared([ids], [text], [params])

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
            async for d in self.backend.generate(reqs[0]):
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


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


# -- the app -------------------------------------------------------------------------


def create_app(
    backend: EngineBackend,
    tokenizer: Any,
    model_name: str,
    limits: Limits | None = None,
    on_shutdown: Callable[[], Awaitable[None]] | None = None,
    api_key: str | None = None,
) -> FastAPI:
    server = OpenAIServer(backend, tokenizer, model_name, limits or Limits())
    app = FastAPI(
        title="pagefleet",
        version=pagefleet.__version__,
        description="OpenAI-compatible LLM serving on Ray Serve",
    )
    app.state.server = server
    if on_shutdown is not None:
        app.router.on_shutdown.append(on_shutdown)
    add_dashboard(app, backend, api_key=api_key)  # /dashboard, /dashboard/data (dashboard.py)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        first = errs[0] if errs else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        where = ".".join(loc)
        msg = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            return error_response(400, f"the request body is not valid JSON: {msg}")
        return error_response(400, f"{where}: {msg}" if where else msg, where or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        err = _classify(exc)
        if err.status >= 500:
            logger.error("request failed: %s", err.message)
        return error_response(err.status, err.message, err.param)

    errors: dict[int | str, dict[str, Any]] = {
        400: {"model": ErrorResponse},
        404: {"model": ErrorResponse},
        500: {"model": ErrorResponse},
    }

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

    @app.post("/tokenize", response_model=TokenizeResponse, responses=errors)
    async def tokenize(req: TokenizeRequest) -> TokenizeResponse:
        server.check_model(req.model)
        if req.messages is not None:
            text = server.chat_prompt(req.messages, req.add_generation_prompt)
            ids = server.encode(text, add_special_tokens=False)
        elif req.prompt is not None:
            ids = server.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            raise APIError(400, "give `prompt` or `messages`", "prompt")
        info = await server.info()
        return TokenizeResponse(count=len(ids), max_model_len=info.max_model_len, tokens=ids)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=errors)
    async def detokenize(req: DetokenizeRequest) -> DetokenizeResponse:
        server.check_model(req.model)
        info = await server.info()
        if any(t >= info.vocab_size for t in req.tokens):
            raise APIError(400, f"tokens must be integers in [0, {info.vocab_size})", "tokens")
        return DetokenizeResponse(prompt=tokenizer.decode(req.tokens))

    @app.post("/v1/completions", response_model=CompletionResponse, responses=errors)
    async def completions(req: CompletionRequest, raw: Request) -> Any:
        prep = await server.prepare_completion(req)
        rid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        n = req.n
        if req.stream:
            return StreamingResponse(
                _stream_completion(server, req, prep, rid, created, n),
                media_type="text/event-stream",
            )
        choices: dict[int, _Choice] = {}
        prompt_lps: dict[int, list[dict[int, float] | None]] = {}
        num_prompt = dict.fromkeys(range(len(prep.prompts)), 0)
        try:
            async for i, d in server.run(prep, req, rid):
                num_prompt[i] = d.num_prompt_tokens
                if d.prompt_logprobs is not None:
                    prompt_lps[i] = d.prompt_logprobs
                for s in d.samples:
                    _accumulate(choices.setdefault(i * n + s.index, _Choice()), s)
        except Exception as e:
            raise _classify(e) from None
        out = []
        for idx in sorted(choices):
            c = choices[idx]
            i = idx // n
            text = "".join(c.text)
            ids, lps = c.token_ids, c.logprobs
            prefix_ids: list[int] = []
            prefix_lps: list[dict[int, float] | None] = []
            if req.echo:
                prompt_text = prep.prompt_texts[i] or tokenizer.decode(prep.prompts[i])
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

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=errors)
    async def chat(req: ChatCompletionRequest) -> Any:
        prep = await server.prepare_chat(req)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        if req.stream:
            return StreamingResponse(
                _stream_chat(server, req, prep, rid, created), media_type="text/event-stream"
            )
        choices: dict[int, _Choice] = {}
        num_prompt = 0
        try:
            async for _, d in server.run(prep, req, rid):
                num_prompt = d.num_prompt_tokens
                for s in d.samples:
                    _accumulate(choices.setdefault(s.index, _Choice()), s)
        except Exception as e:
            raise _classify(e) from None
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
    server: OpenAIServer, req: CompletionRequest, prep: _Prepared, rid: str, created: int, n: int
) -> AsyncIterator[str]:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    base = {"id": rid, "object": "text_completion", "created": created, "model": server.model_name}
    offsets: dict[int, int] = {}
    num_prompt: dict[int, int] = {}
    completion_tokens = 0
    echoed: set[int] = set()
    try:
        async for i, d in server.run(prep, req, rid):
            num_prompt[i] = d.num_prompt_tokens
            for s in d.samples:
                idx = i * n + s.index
                text, ids = s.text, s.token_ids
                lps: list[dict[int, float] | None] = list(s.logprobs or [])
                if req.echo and idx not in echoed:
                    echoed.add(idx)
                    prompt_text = prep.prompt_texts[i] or server.tokenizer.decode(prep.prompts[i])
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
    if include_usage:
        prompt_tokens = sum(num_prompt.values())
        yield _sse(
            {**base, "choices": [], "usage": _usage(prompt_tokens, completion_tokens).model_dump()}
        )
    yield "data: [DONE]\n\n"


async def _stream_chat(
    server: OpenAIServer, req: ChatCompletionRequest, prep: _Prepared, rid: str, created: int
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
        async for _, d in server.run(prep, req, rid):
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
    if include_usage:
        yield _sse(
            {**base, "choices": [], "usage": _usage(num_prompt, completion_tokens).model_dump()}
        )
    yield "data: [DONE]\n\n"
