"""`bench soak`'s load: the request mix, and each client's behaviour (finish, cancel
mid-stream, disconnect before the first token), recorded per request."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass

import httpx

from pagefleet.bench.client import StreamStats, http_error, read_stream

# Completion prompts of different lengths (so requests take 1 to several KV blocks).
PROMPTS = [
    "def quicksort(items):",
    "The three most important ideas in distributed systems are",
    "import numpy as np\n\n# compute the moving average of a signal\n",
    "Once upon a time in a small village, there lived an old clockmaker who",
    "class LRUCache:\n    def __init__(self, capacity):\n        self.capacity = capacity\n",
    "Summarize the plot of a detective novel in which the butler did not do it.",
    "SELECT name, count(*) FROM orders JOIN users ON orders.user_id = users.id GROUP BY",
    "List five uses for a paperclip:",
]
# Chat system prompts shared by every user: long enough to fill whole blocks, so requests
# hit the prefix cache and share blocks by reference count, which a leak would unbalance.
SYSTEMS = [
    "You are a careful assistant. Answer in plain English, cite no sources, keep every "
    "answer short and concrete, and say so when you do not know something. " * 3,
    "You are a senior Python reviewer. Point out bugs first, then style, then naming; "
    "quote the line you mean and suggest the fix in one sentence. " * 3,
]
QUESTIONS = [
    "How do I reverse a linked list?",
    "What is a paged KV cache?",
    "Explain backpressure in one paragraph.",
    "Why is my for loop slow?",
    "What does continuous batching do?",
    "Give me a haiku about schedulers.",
]


@dataclass(frozen=True)
class Plan:
    """One request a user will send, and how its client will behave."""

    chat: bool
    stream: bool
    max_tokens: int
    n: int
    prompt: int  # index into PROMPTS (completions) or QUESTIONS (chat)
    system: int  # index into SYSTEMS (chat)
    action: str  # "finish", "cancel" (close the stream after `after` chunks), "disconnect"
    after: int = 0  # chunks with tokens before a cancel
    delay_s: float = 0.0  # a disconnect leaves this long after sending, unless answered


def make_plan(rng: random.Random, cancel_rate: float, disconnect_rate: float) -> Plan:
    """The mix: 70 % short (8-32 tokens), 30 % long (128-384); half chat; 70 % streamed."""
    long = rng.random() < 0.3
    max_tokens = rng.randint(128, 384) if long else rng.randint(8, 32)
    chat = rng.random() < 0.5
    stream = rng.random() < 0.7
    n = 2 if rng.random() < 0.1 else 1
    prompt, system = rng.randrange(len(PROMPTS)), rng.randrange(len(SYSTEMS))
    roll = rng.random()
    if roll < cancel_rate and stream:
        after = rng.randint(1, max(1, max_tokens // 2))
        return Plan(chat, stream, max_tokens, n, prompt, system, "cancel", after=after)
    if roll < cancel_rate:
        # Not streamed: the client gives up while its answer is being generated.
        delay = rng.uniform(0.3, 1.5)
        return Plan(chat, stream, max_tokens, n, prompt, system, "disconnect", delay_s=delay)
    if roll < cancel_rate + disconnect_rate:
        # Gone before its first token: queued, or still being prefilled.
        delay = rng.uniform(0.02, 0.3)
        return Plan(chat, stream, max_tokens, n, prompt, system, "disconnect", delay_s=delay)
    return Plan(chat, stream, max_tokens, n, prompt, system, "finish")


@dataclass
class Record:
    """What happened to one request (times in seconds since the load started)."""

    start: float
    end: float
    outcome: str  # ok | cancelled | disconnected | rejected (429) | error
    plan: Plan
    ttft: float | None = None
    tokens: int = 0
    reason: str = ""


def request_body(plan: Plan, model: str, seed: int) -> tuple[str, dict]:
    """(path, JSON body) of the request `plan` describes."""
    common = {
        "model": model,
        "max_tokens": plan.max_tokens,
        "n": plan.n,
        "temperature": 0.8,
        "seed": seed,
        # Every request makes exactly max_tokens tokens: their count checks the answer.
        "ignore_eos": True,
        "stream": plan.stream,
    }
    if plan.stream:
        common["stream_options"] = {"include_usage": True}
    if plan.chat:
        messages = [
            {"role": "system", "content": SYSTEMS[plan.system]},
            {"role": "user", "content": QUESTIONS[plan.prompt % len(QUESTIONS)]},
        ]
        return "/v1/chat/completions", {**common, "messages": messages}
    return "/v1/completions", {**common, "prompt": PROMPTS[plan.prompt]}


class _Left(Exception):
    """The client closed the request on purpose (a planned cancel)."""


async def _exchange(
    client: httpx.AsyncClient, url: str, plan: Plan, body: tuple[str, dict], rec: Record
) -> None:
    """One request, its outcome written into `rec` as it goes (a disconnect cancels it)."""
    path, payload = body
    expected = plan.max_tokens * plan.n
    sent = time.perf_counter()
    async with client.stream("POST", url + path, json=payload) as r:
        if r.status_code != 200:
            rec.outcome = "rejected" if r.status_code == 429 else "error"
            rec.reason = http_error(r.status_code, await r.aread())
            return
        if not plan.stream:
            data = json.loads(await r.aread())
            rec.tokens = data["usage"]["completion_tokens"]
            rec.outcome = "ok" if rec.tokens == expected else "error"
            if rec.outcome == "error":
                rec.reason = f"{rec.tokens} of {expected} tokens"
            return

        def on_chunk(s: StreamStats) -> None:
            if rec.ttft is None:
                rec.ttft = s.ttft
            if plan.action == "cancel" and s.chunks >= plan.after:
                raise _Left  # leaving the `async with` closes the connection

        s = await read_stream(r, sent, on_chunk)
        rec.tokens = s.tokens or 0
        if s.error:
            rec.reason = f"error event: {s.error}"
        elif not s.done:
            rec.reason = "stream ended without [DONE]"
        elif rec.tokens != expected:
            rec.reason = f"{rec.tokens} of {expected} tokens"
        else:
            rec.outcome = "ok"


async def send(
    client: httpx.AsyncClient, url: str, model: str, plan: Plan, seed: int, t0: float
) -> Record:
    """Send `plan`'s request and behave as it says; `t0`: time.monotonic() at the start."""
    rec = Record(time.monotonic() - t0, 0.0, "error", plan)
    exchange = _exchange(client, url, plan, request_body(plan, model, seed), rec)
    try:
        if plan.action == "disconnect":
            # Cancelling the task closes the socket: the server sees the client leave.
            await asyncio.wait_for(exchange, plan.delay_s)
        else:
            await exchange
    except _Left:
        rec.outcome = "cancelled"
    except TimeoutError:
        # Only a planned disconnect has a deadline: the client left before the answer ended.
        rec.outcome = "cancelled" if rec.ttft is not None else "disconnected"
    except (httpx.HTTPError, httpx.StreamError, json.JSONDecodeError, KeyError) as e:
        rec.outcome = "error"
        rec.reason = f"{type(e).__name__}: {str(e)[:80]}"
    rec.end = time.monotonic() - t0
    return rec
