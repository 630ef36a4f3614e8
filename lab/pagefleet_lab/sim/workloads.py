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
- `ClosedLoop`: not arrivals fixed in advance but users, each sending its next request
  when its previous one has finished (`pagefleet-lab router`'s client), in phases
  (warm-ups, then the measured requests). Its requests carry their prompts' token ids
  whole (`SimRequest.tokens`): they are another benchmark's exact requests.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pagefleet.bench.workloads import FIRST_PLAIN_TOKEN, poisson_times

VOCAB = 32_000
MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True, slots=True)
class SimRequest:
    """One request: its prompt is `pieces` (key, tokens) concatenated, then `tail_tokens`
    tokens of its own (seeded by `tail_seed`); or, when `tokens` is given, exactly those
    token ids (another benchmark's request, `ClosedLoop`)."""

    request_id: int
    arrival_s: float
    pieces: tuple[tuple[int, int], ...]  # (key, token count): equal keys, equal tokens
    tail_tokens: int
    tail_seed: int
    output_tokens: int
    kind: str = ""  # for reports: the tenant, "long"/"short"
    tokens: tuple[int, ...] | None = None  # the prompt itself (then pieces are empty)

    @property
    def prompt_tokens(self) -> int:
        if self.tokens is not None:
            return len(self.tokens)
        return sum(n for _, n in self.pieces) + self.tail_tokens


# One int object per token id, shared by every prompt: the fleet's caches keep every
# cached block's tokens (millions of blocks at 64 replicas), and fresh ints per prompt
# were most of the run's memory and the page faults of growing it.
_TOKEN_IDS = tuple(range(VOCAB))
# The same objects in an array: a fancy index and `tolist` reach them without making an
# int per token first (a third faster on a large heap).
_TOKEN_OBJECTS = np.array(_TOKEN_IDS, dtype=object)


def piece_tokens(key: int, n: int, salt: int = 0) -> list[int]:
    """The `n` tokens of piece `key` (a pure function: equal keys give equal tokens)."""
    if n <= 0:
        return []
    raw = random.Random(key * 1_000_003 + salt).randbytes(2 * n)  # C speed: prompts are long
    span = VOCAB - FIRST_PLAIN_TOKEN
    ids = np.frombuffer(raw, dtype="<u2").astype(np.intp) % span + FIRST_PLAIN_TOKEN
    return _TOKEN_OBJECTS[ids].tolist()


class Prompts:
    """Builds prompts' token ids, keeping each piece's tokens once (tenants repeat)."""

    def __init__(self) -> None:
        self._pieces: dict[tuple[int, int], list[int]] = {}

    def tokens(self, req: SimRequest) -> list[int]:
        if req.tokens is not None:
            return list(req.tokens)
        out: list[int] = []
        for key, n in req.pieces:
            out += self.piece(key, n)
        if req.tail_tokens:
            out += piece_tokens(req.tail_seed, req.tail_tokens, salt=1)
        return out

    def piece(self, key: int, n: int) -> list[int]:
        """`piece_tokens(key, n)`, kept (the same list every time: do not change it)."""
        piece = self._pieces.get((key, n))
        if piece is None:
            piece = self._pieces[(key, n)] = piece_tokens(key, n)
        return piece


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


# -- closed loop ------------------------------------------------------------------------


@dataclass(frozen=True)
class Phase:
    """One run of a closed-loop client: user u waits `offsets[u]` from the phase's start,
    then sends `per_user[u]` one after another (their `arrival_s` is set when sent). The
    phase starts `pause_before_s` after the previous one's last request finished (the
    benchmark waiting for an idle fleet); only a `measured` phase's requests count."""

    per_user: tuple[tuple[SimRequest, ...], ...]
    offsets: tuple[float, ...]
    measured: bool = False
    pause_before_s: float = 0.0

    def __post_init__(self) -> None:
        if len(self.per_user) != len(self.offsets):
            raise ValueError("one offset per user")


class ClosedLoop:
    """Users who each have one request in flight at most: the simulator's `bench router`
    client (`client.closed_loop`), phase after phase.

    The fleet calls `begin` once, then `finished` whenever a request ends; both return
    the requests sent as a result, with their send times as `arrival_s` (a user's next
    request goes `think_s` after its previous one ended: 0 for bench router, whose users
    send again as soon as the stream ends). When a phase's last request ends, the next
    phase starts `pause_before_s` later. `measured_start_s` is when the measured phase
    began (None before): its first send, like the client's clock. `log` keeps (time,
    user, request id, "sent" / "done") for every event, to check that no user ever had
    two requests in flight.
    """

    def __init__(self, phases: Sequence[Phase], think_s: float = 0.0) -> None:
        if sum(p.measured for p in phases) > 1:
            raise ValueError("at most one measured phase")
        ids = [r.request_id for p in phases for u in p.per_user for r in u]
        if len(set(ids)) != len(ids):
            raise ValueError("request ids must be unique across phases")
        self.phases = list(phases)
        self.think_s = think_s
        self.phase = -1
        self.measured_start_s: float | None = None
        self.log: list[tuple[float, int, int, str]] = []
        self._next: list[int] = []  # per user of the current phase: its next request
        self._user: dict[int, int] = {}  # request in flight -> its user
        self._left = 0  # requests of the current phase not finished

    @property
    def done(self) -> bool:
        """Every request has been sent (the fleet may still be serving the last)."""
        return self.phase >= len(self.phases) or (
            self.phase == len(self.phases) - 1
            and all(
                i >= len(reqs)
                for i, reqs in zip(self._next, self.phases[self.phase].per_user, strict=True)
            )
        )

    def begin(self) -> list[SimRequest]:
        if self.phase != -1:
            raise RuntimeError("begin once")
        return self._start_phase(0.0)

    def finished(self, request_id: int, now: float) -> list[SimRequest]:
        """The request ended at `now`: its user's next one, or the next phase's first."""
        user = self._user.pop(request_id)
        self.log.append((now, user, request_id, "done"))
        self._left -= 1
        sent = self._send(user, now + self.think_s)
        if self._left == 0 and self.phase + 1 < len(self.phases):
            sent += self._start_phase(now)
        elif self._left == 0:
            self.phase = len(self.phases)
        return sent

    def _start_phase(self, after: float) -> list[SimRequest]:
        """Skips empty phases; a phase with requests sends each user's first one."""
        while True:
            self.phase += 1
            if self.phase >= len(self.phases):
                return []
            phase = self.phases[self.phase]
            start = after + phase.pause_before_s
            self._next = [0] * len(phase.per_user)
            self._left = sum(len(u) for u in phase.per_user)
            if phase.measured:
                self.measured_start_s = start
            if self._left:
                break
            after = start
        out: list[SimRequest] = []
        for user, offset in enumerate(phase.offsets):
            out += self._send(user, start + offset)
        return out

    def _send(self, user: int, at: float) -> list[SimRequest]:
        reqs = self.phases[self.phase].per_user[user]
        i = self._next[user]
        if i >= len(reqs):
            return []
        self._next[user] = i + 1
        req = dataclasses.replace(reqs[i], arrival_s=at)
        self._user[req.request_id] = user
        self.log.append((at, user, req.request_id, "sent"))
        return [req]
