"""The requests the serving benchmarks send: pure functions of a seed.

Lists of `BenchRequest` (a prompt and max_tokens), so that every server or policy in
one run gets exactly the same requests. The fleet workloads' prompts are token ids,
not text: their lengths are exact, which is what KV pressure and prefix sharing are
about (vLLM's `benchmark_serving` "random" dataset does the same).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

# Token ids from here up: the tiny and SmolLM tokenizers keep their special
# tokens below it, and a prompt of special tokens is not a realistic prompt.
FIRST_PLAIN_TOKEN = 16


@dataclass(frozen=True)
class BenchRequest:
    prompt: tuple[int, ...] | str  # token ids, or a text
    max_tokens: int
    kind: str = ""  # "long" / "short", or the system prompt's index: for reports only
    logprobs: int | None = None  # `logprobs: K` on the request (None: not asked)
    # vLLM's `structured_outputs` object (a JSON schema, say), which both servers take:
    # the output ends where its grammar does, so the request is not sent with ignore_eos.
    structured_outputs: dict | None = None


def random_tokens(rng: random.Random, n: int, vocab_size: int) -> tuple[int, ...]:
    return tuple(rng.randrange(FIRST_PLAIN_TOKEN, vocab_size) for _ in range(n))


def distinct_prompts(
    count: int, tokens: int, vocab_size: int, seed: int, exclude: Iterable[int] = ()
) -> list[tuple[int, ...]]:
    """`count` random prompts of exactly `tokens` token ids in [FIRST_PLAIN_TOKEN,
    vocab_size), none of `exclude` (a tokenizer's special ids), seeded. Each starts with
    a first token of its own, so no two share a prefix block: no prefix-cache hit
    between them, on any server."""
    if tokens < 1:
        raise ValueError("tokens must be >= 1")
    skip = set(exclude)
    plain = [t for t in range(FIRST_PLAIN_TOKEN, vocab_size) if t not in skip]
    if count > len(plain):
        raise ValueError(f"{count} prompts need {count} distinct first tokens: {len(plain)} exist")
    rng = random.Random(seed)
    firsts = rng.sample(plain, count)
    return [(first, *rng.choices(plain, k=tokens - 1)) for first in firsts]


def skewed_workload(
    num_requests: int,
    long_fraction: float,
    long_prompt: tuple[int, int],
    long_output: tuple[int, int],
    short_prompt: tuple[int, int],
    short_output: tuple[int, int],
    vocab_size: int,
    seed: int,
) -> list[BenchRequest]:
    """A few long requests among many short ones, in a seeded random order.

    Exactly round(num_requests * long_fraction) are long (a fixed count, so
    runs differ only in order when the seed changes); lengths are uniform in
    the inclusive (lo, hi) ranges. Prompts are random tokens: no two share a
    prefix block, so this workload measures KV capacity, not caching.
    """
    if not 0.0 <= long_fraction <= 1.0:
        raise ValueError("long_fraction must be in [0, 1]")
    rng = random.Random(seed)
    num_long = round(num_requests * long_fraction)
    kinds = ["long"] * num_long + ["short"] * (num_requests - num_long)
    rng.shuffle(kinds)
    out = []
    for kind in kinds:
        p, o = (long_prompt, long_output) if kind == "long" else (short_prompt, short_output)
        prompt = random_tokens(rng, rng.randint(*p), vocab_size)
        out.append(BenchRequest(prompt, rng.randint(*o), kind))
    return out


def shared_prefix_workload(
    num_requests: int,
    num_system_prompts: int,
    system_tokens: int,
    question_tokens: tuple[int, int],
    output_tokens: tuple[int, int],
    vocab_size: int,
    seed: int,
) -> list[BenchRequest]:
    """Many users, a few long system prompts: each request is one of
    `num_system_prompts` fixed prefixes followed by its own random question.
    Every system prompt serves an equal share (up to one request), in a seeded
    random order: no run is luckier in its popularity mix than another."""
    rng = random.Random(seed)
    systems = [random_tokens(rng, system_tokens, vocab_size) for _ in range(num_system_prompts)]
    which = [i % num_system_prompts for i in range(num_requests)]
    rng.shuffle(which)
    out = []
    for s in which:
        question = random_tokens(rng, rng.randint(*question_tokens), vocab_size)
        out.append(BenchRequest(systems[s] + question, rng.randint(*output_tokens), f"system{s}"))
    return out


def deal(requests: Sequence[BenchRequest], users: int) -> list[list[BenchRequest]]:
    """User u sends requests u, u + users, u + 2 * users, ... in that order."""
    if users < 1:
        raise ValueError("users must be >= 1")
    return [list(requests[u::users]) for u in range(users)]


def token_range(text: str) -> list[int]:
    """A command line's LO-HI (or N: N-N) as [lo, hi]."""
    lo, _, hi = text.partition("-")
    return [int(lo), int(hi or lo)]


def poisson_times(qps: float, duration_s: float, rng: random.Random) -> Iterator[float]:
    """Arrival times of a Poisson process at `qps`, from 0 up to `duration_s`."""
    t = 0.0
    while True:
        t += rng.expovariate(qps)
        if t >= duration_s:
            return
        yield t
