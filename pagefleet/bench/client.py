"""The one benchmark client: OpenAI streaming over httpx, timed as a user sees it.

- `sse_lines` / `read_stream`: an event stream's lines and what they carry. TTFT is
  the time to the first chunk that carries tokens, inter-token latency the gaps
  between such chunks (vLLM's `benchmark_serving` definitions): a completion's
  choice, or a chat delta other than the opening `{"role": "assistant"}`. pagefleet
  (and vLLM) send a choice only once a token is produced, even when its text is
  still empty (half of a multi-byte character).
- `stream_completion`: one streamed `/v1/completions` request (ignore_eos, temperature
  TEMPERATURE, the request's logprobs if it asks), ok when it made exactly max_tokens
  tokens.
- `closed_loop`: users each sending their own list of requests back to back.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

import httpx

from pagefleet.bench.workloads import BenchRequest

TEMPERATURE = 0.8  # every benchmark request samples (what a chat user gets)


@dataclass
class RequestResult:
    ok: bool
    kind: str = ""
    sent_at: float = 0.0  # seconds since the scenario began
    ttft: float = math.nan
    e2e: float = math.nan
    tokens: int = 0
    error: str = ""
    gaps: list[float] = field(default_factory=list)  # seconds between token chunks
    text: str | None = None  # a constrained request's output, to check it


@dataclass
class StreamStats:
    """What one event stream carried, timed from the request's send."""

    ttft: float = math.nan
    gaps: list[float] = field(default_factory=list)
    chunks: int = 0  # chunks that carried tokens
    tokens: int | None = None  # usage.completion_tokens, when the server sent usage
    done: bool = False  # `data: [DONE]` arrived
    error: str = ""  # an error event's message
    text: str = ""  # a completion's text (its first choice's), when asked to keep it


async def sse_lines(r: httpx.Response) -> AsyncIterator[str]:
    """The lines of an event stream. Only CR and LF end a line there: the data is JSON
    written with ensure_ascii=False, whose strings may hold U+2028, U+0085 and the like,
    at which httpx's `aiter_lines` (str.splitlines rules) would cut a chunk in two."""
    buf = ""
    async for text in r.aiter_text():
        buf += text
        *lines, buf = buf.split("\n")
        for line in lines:
            yield line.rstrip("\r")
    if buf:
        yield buf.rstrip("\r")


def carries_tokens(chunk: dict) -> bool:
    """A chunk with a choice the engine produced: a completion's choice, or a chat delta
    other than the opening role announcement."""
    return any("role" not in (c.get("delta") or {}) for c in chunk.get("choices") or [])


def error_message(body: bytes | str, limit: int = 200) -> str:
    """An OpenAI error body's message (or the body itself), cut to `limit` characters."""
    text = body.decode(errors="replace") if isinstance(body, bytes) else body
    with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
        return str(json.loads(text)["error"]["message"])[:limit]
    return text[:limit]


def http_error(status: int, body: bytes | str) -> str:
    return f"HTTP {status}: {error_message(body)}"


async def read_stream(
    r: httpx.Response,
    start: float,
    on_chunk: Callable[[StreamStats], None] | None = None,
    keep_text: bool = False,
) -> StreamStats:
    """Read an event stream to `[DONE]` or an error event. `start`: time.perf_counter()
    when the request was sent. `on_chunk` runs after each chunk that carried tokens (it
    may raise to leave the stream early). `keep_text`: gather a completion's text."""
    s = StreamStats()
    last: float | None = None
    async for line in sse_lines(r):
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            s.done = True
            break
        chunk = json.loads(line[6:])
        if "error" in chunk:
            err = chunk["error"]
            s.error = str(err.get("message", err) if isinstance(err, dict) else err)[:200]
            break
        if chunk.get("usage"):
            s.tokens = chunk["usage"]["completion_tokens"]
        if keep_text:
            s.text += "".join(c.get("text") or "" for c in chunk.get("choices") or [])
        if carries_tokens(chunk):
            now = time.perf_counter()
            if last is None:
                s.ttft = now - start
            else:
                s.gaps.append(now - last)
            last = now
            s.chunks += 1
            if on_chunk is not None:
                on_chunk(s)
    return s


async def stream_completion(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    req: BenchRequest,
    t0: float,
) -> RequestResult:
    """One streamed completion (ignore_eos: it makes exactly max_tokens tokens).

    `t0`: time.perf_counter() when the scenario began. A request is ok when it ended
    with usage.completion_tokens == max_tokens and no error event. One with
    `structured_outputs` ends where its grammar does: it is ok when it ended with
    [DONE] and at least one token, and its text is kept for checking.
    """
    body = {
        "model": model,
        "prompt": req.prompt if isinstance(req.prompt, str) else list(req.prompt),
        "max_tokens": req.max_tokens,
        "temperature": TEMPERATURE,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if req.logprobs is not None:
        body["logprobs"] = req.logprobs
    constrained = req.structured_outputs is not None
    if constrained:
        body["structured_outputs"] = req.structured_outputs
        body["ignore_eos"] = False
    start = time.perf_counter()
    res = RequestResult(ok=False, kind=req.kind, sent_at=start - t0)
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = http_error(r.status_code, await r.aread())
                return res
            s = await read_stream(r, start, keep_text=constrained)
        res.ttft, res.gaps, res.tokens = s.ttft, s.gaps, s.tokens or 0
        if s.error:
            res.error = s.error
            return res
        res.e2e = time.perf_counter() - start
        if constrained:
            res.text = s.text
            res.ok = s.done and 0 < res.tokens <= req.max_tokens
        else:
            res.ok = res.tokens == req.max_tokens
        if not res.ok:
            res.error = f"{res.tokens} of {req.max_tokens} tokens"
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"[:200]
    return res


async def closed_loop(
    url: str,
    model: str,
    per_user: Sequence[Sequence[BenchRequest]],
    start_offsets: Sequence[float],
    on_done: Callable[[RequestResult], None] | None = None,
    timeout_s: float = 900.0,
) -> tuple[list[RequestResult], float]:
    """Each user starts at its offset and sends its requests back to back.

    Returns every result and the wall time from the first send to the last
    answer. A fixed number of users keeps the number of requests in flight
    (hence the KV pressure) the same on fast and slow machines.
    """
    n = len(per_user)
    limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:
        t0 = time.perf_counter()

        async def user(u: int) -> list[RequestResult]:
            await asyncio.sleep(start_offsets[u])
            out = []
            for req in per_user[u]:
                res = await stream_completion(client, url, model, req, t0)
                if on_done is not None:
                    on_done(res)
                out.append(res)
            return out

        per = await asyncio.gather(*(user(u) for u in range(n)))
        return [r for rs in per for r in rs], time.perf_counter() - t0


def model_id(url: str, api_key: str | None = None) -> str:
    """The first model a server lists at /v1/models."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(f"{url}/v1/models", headers=headers, timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]
