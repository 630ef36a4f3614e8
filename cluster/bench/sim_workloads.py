"""The simulator's workloads: seeded generators of timed requests, and a trace reader.

A `SimRequest` is an arrival time, a prompt and an output length. Prompts are token
ids built from named pieces (`prefix_key`: a tenant's system prompt, a trace's hash
id) so that equal pieces are equal tokens, and the same seed gives the same requests
to every policy. A fleet-sized run has too many prompts to keep as token lists, so a
request holds only what rebuilds its tokens (`Prompts.tokens`), and the fleet builds
them when the request arrives and drops them when it ends.

- `multi_tenant`: llm-d's shared-prefix benchmark. `tenants` system prompts of
  `system_tokens` each, every request one tenant's (uniform) plus its own
  `query_tokens`-token question, `output_tokens` out; Poisson arrivals at `qps`.
- `skewed`: random prompts (no shared prefix), a `long_fraction` of them long
  (prompt and output uniform in the long ranges), the rest short; Poisson at `qps`.
- `sinusoidal`: the arrivals of either, thinned to a rate swinging between `low_qps`
  and `high_qps` over `period_s` (Dynamo planner's load shape):
  rate(t) = low + (high - low) * (1 - cos(2 pi t / period)) / 2.
- `read_trace`: Mooncake's JSONL (one object a line: `timestamp` in ms,
  `input_length`, `output_length`, `hash_ids`: one id per `trace_block_tokens`-token
  block of the prompt, equal ids meaning equal blocks).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .workloads import FIRST_PLAIN_TOKEN

VOCAB = 32_000
MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True, slots=True)
class SimRequest:
    """One request: its prompt is `pieces` (key, tokens) concatenated, then `tail_tokens`
    tokens of its own (seeded by `tail_seed`)."""

    request_id: int
    arrival_s: float
    pieces: tuple[tuple[int, int], ...]  # (key, token count): equal keys, equal tokens
    tail_tokens: int
    tail_seed: int
    output_tokens: int
    kind: str = ""  # for reports: the tenant, "long"/"short"

    @property
    def prompt_tokens(self) -> int:
        return sum(n for _, n in self.pieces) + self.tail_tokens


def piece_tokens(key: int, n: int, salt: int = 0) -> list[int]:
    """The `n` tokens of piece `key` (a pure function: equal keys give equal tokens)."""
    raw = random.Random(key * 1_000_003 + salt).randbytes(2 * n)  # C speed: prompts are long
    span = VOCAB - FIRST_PLAIN_TOKEN
    ids = np.frombuffer(raw, dtype="<u2").astype(np.int64) % span + FIRST_PLAIN_TOKEN
    return ids.tolist()


class Prompts:
    """Builds prompts' token ids, keeping each piece's tokens once (tenants repeat)."""

    def __init__(self) -> None:
        self._pieces: dict[tuple[int, int], list[int]] = {}

    def tokens(self, req: SimRequest) -> list[int]:
        out: list[int] = []
        for key, n in req.pieces:
            piece = self._pieces.get((key, n))
            if piece is None:
                piece = self._pieces[(key, n)] = piece_tokens(key, n)
            out += piece
        if req.tail_tokens:
            out += piece_tokens(req.tail_seed, req.tail_tokens, salt=1)
        return out


def poisson_times(qps: float, duration_s: float, rng: random.Random) -> Iterator[float]:
    t = 0.0
    while True:
        t += rng.expovariate(qps)
        if t >= duration_s:
            return
        yield t


def multi_tenant(
    qps: float,
    duration_s: float,
    tenants: int,
    system_tokens: int,
    query_tokens: int,
    output_tokens: int,
    seed: int,
) -> Iterator[SimRequest]:
    """llm-d's shared-prefix workload (module docstring), in arrival order."""
    rng = random.Random(seed)
    for i, t in enumerate(poisson_times(qps, duration_s, rng)):
        tenant = rng.randrange(tenants)
        yield SimRequest(
            i,
            t,
            ((tenant, system_tokens),),
            query_tokens,
            seed * 10_000_019 + i,
            output_tokens,
            f"tenant{tenant}",
        )


def skewed(
    qps: float,
    duration_s: float,
    long_fraction: float,
    long_prompt: tuple[int, int],
    long_output: tuple[int, int],
    short_prompt: tuple[int, int],
    short_output: tuple[int, int],
    seed: int,
) -> Iterator[SimRequest]:
    """Random prompts, a few long among many short (module docstring)."""
    rng = random.Random(seed)
    for i, t in enumerate(poisson_times(qps, duration_s, rng)):
        long = rng.random() < long_fraction
        p, o = (long_prompt, long_output) if long else (short_prompt, short_output)
        yield SimRequest(
            i,
            t,
            (),
            rng.randint(*p),
            seed * 10_000_019 + i,
            rng.randint(*o),
            "long" if long else "short",
        )


def sinusoidal_rate(low_qps: float, high_qps: float, period_s: float, t: float) -> float:
    return low_qps + (high_qps - low_qps) * (1 - math.cos(2 * math.pi * t / period_s)) / 2


def sinusoidal(
    base: Iterator[SimRequest], low_qps: float, high_qps: float, period_s: float, seed: int
) -> Iterator[SimRequest]:
    """`base` (generated at `high_qps`) thinned to the sinusoidal rate (module docstring)."""
    rng = random.Random(seed ^ 0x5EED)
    for req in base:
        if rng.random() * high_qps < sinusoidal_rate(low_qps, high_qps, period_s, req.arrival_s):
            yield req


def read_trace(
    path: str | Path,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
    time_scale: float = 1.0,
    limit: int | None = None,
) -> Iterator[SimRequest]:
    """Mooncake-style JSONL (module docstring), arrivals from the first one's timestamp,
    divided by `time_scale` (2: twice the rate). A prompt is its hash ids' blocks (the
    last one cut to `input_length`); ids past `input_length` are ignored."""
    start: float | None = None
    with Path(path).open() as f:
        i = 0
        for line in f:
            if not line.strip():
                continue
            if limit is not None and i >= limit:
                return
            row = json.loads(line)
            ts = float(row["timestamp"]) / 1000.0
            start = ts if start is None else start
            n = int(row["input_length"])
            pieces: list[tuple[int, int]] = []
            left = n
            for h in row.get("hash_ids", []):
                if left <= 0:
                    break
                take = min(block_tokens, left)
                pieces.append((int(h), take))
                left -= take
            yield SimRequest(
                i,
                (ts - start) / time_scale,
                tuple(pieces),
                left,
                i,
                max(1, int(row["output_length"])),
                "trace",
            )
            i += 1
