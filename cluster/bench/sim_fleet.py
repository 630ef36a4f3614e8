"""The simulated fleet: replicas that are the real engine's scheduling with a step-time model.

Each replica is a `SimEngine`: the engine's own `TokenEngine` (so its real `Scheduler`
and `BlockManager`: admission, chunked prefill, the prefix cache with eviction,
preemption by recompute; its real stop checks, `stats()` and demand blocks) with the
model runner replaced by `StepRunner`, which samples an arbitrary non-EOS token for
every sequence that reaches the end of its known tokens and records the step's shape.
`TokenEngine.__init__` loads a model, so `SimEngine.__init__` sets the same attributes
without one (`tests/cluster/test_bench_simulate.py` checks it keeps up). Each request
ends at its output length (`max_tokens`, `ignore_eos`).

Time is simulated, one event at a time in time order (ties in the order scheduled),
so a run is a pure function of its seed:

- an arrival is routed at once by the policy and added to its replica's engine; an
  idle replica starts a step;
- a step is decided (`TokenEngine.step`: schedule, the runner, update) when it starts,
  and lasts `model.seconds(shape)`; its tokens and finishes are seen when it ends, and
  the replica's next step starts then. (A report taken during a step sees the engine
  as the step left it: blocks are taken and freed at the step's start.)
- every `stats_period_s` each replica's report is taken (`routing_stats_from_engine`
  of its `stats()`, what a Serve replica's `record_routing_stats` returns) and handed
  to the policy, as Serve hands the routers the latest poll; replicas' polls are
  spread evenly over the period.

`Fleet.run` returns `RunResult`: per request arrival, TTFT, mean inter-token latency
(its TPOT: (last token - first token) / (tokens - 1)), end, and per replica its
preemptions and prefix-cache counters from the end of the warm-up on.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from pagefleet.cluster.routing_policy import ReplicaLoad, RouteRequest, routing_stats_from_engine
from pagefleet.engine import SamplingParams, block_hashes, prefix_hash_salt
from pagefleet.engine.block_manager import BlockManager
from pagefleet.engine.config import ResolvedCapacity
from pagefleet.engine.handoffs import EngineRequest, TokenStepOutput
from pagefleet.engine.model_runner import ModelRunnerOutput
from pagefleet.engine.scheduler import Scheduler, SchedulerOutput
from pagefleet.engine.token_engine import TokenEngine

from .sim_step_model import StepModel, StepShape, step_shape
from .sim_workloads import VOCAB, Prompts, SimRequest

SAMPLED_TOKEN = 17  # any plain token: never EOS (there is none), ignore_eos anyway


@dataclass(frozen=True)
class ReplicaShape:
    """One replica's engine limits."""

    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 32768


class StepRunner:
    """Stands in for `ModelRunner.execute`: a token for each sampling sequence, no model."""

    def __init__(self) -> None:
        self.last_shape = StepShape(0, 0, 0, 0)

    def execute(self, out: SchedulerOutput, eos_ids: Any, send: Any = None) -> ModelRunnerOutput:
        self.last_shape = step_shape(out)  # before the update advances progress
        n = len(out.seqs)
        sampled: list[int | None] = [SAMPLED_TOKEN if s else None for s in out.sampling]
        return ModelRunnerOutput(sampled, [None] * n, [None] * n, [None] * n)


class SimEngine(TokenEngine):
    """A `TokenEngine` whose runner is `StepRunner` (module docstring)."""

    def __init__(self, shape: ReplicaShape, hash_salt: int) -> None:
        self.config = None  # type: ignore[assignment]
        self.eos_ids = frozenset()
        self.vocab_size = VOCAB
        self.executor = None
        self.runner = StepRunner()  # type: ignore[assignment]
        self.capacity = ResolvedCapacity(
            shape.num_blocks,
            shape.block_size,
            shape.max_model_len,
            shape.max_num_batched_tokens,
            kv_bytes_per_block=0,
        )
        self.block_manager = BlockManager(shape.num_blocks, shape.block_size, True, hash_salt)
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=shape.max_num_seqs,
            max_num_batched_tokens=shape.max_num_batched_tokens,
            enable_chunked_prefill=True,
        )
        self._groups = {}
        self._never_scheduled = set()
        self._awaiting_grammar = {}
        self.grammars = None  # simulated requests carry no constraint
        self._broken = None
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0


@dataclass
class InFlightRequest:
    req: SimRequest
    route: RouteRequest
    replica: int
    first_token_s: float | None = None
    last_token_s: float = 0.0
    tokens: int = 0


@dataclass
class SimReplica:
    index: int
    engine: SimEngine
    busy: bool = False
    # What a policy may read live (Serve's queue probe, Dynamo's KV events):
    unfinished: int = 0  # requests routed here and not finished
    active_tokens: int = 0  # tokens of those requests (prompt + generated so far)
    steps: int = 0
    hits_at_warmup: int = 0
    queries_at_warmup: int = 0
    preemptions_at_warmup: int = 0

    @property
    def id(self) -> str:
        return f"r{self.index}"


class Policy(Protocol):
    name: str

    def choose(self, request: InFlightRequest, now: float) -> int: ...

    def on_completed(self, request: InFlightRequest, now: float) -> None: ...

    def on_stats(self, replica: int, load: ReplicaLoad, now: float) -> None: ...


@dataclass
class RunResult:
    policy: str
    replicas: int
    duration_s: float
    warmup_s: float
    arrival_s: list[float] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)  # per request; NaN for one token
    end_s: list[float] = field(default_factory=list)
    output_tokens: list[int] = field(default_factory=list)
    finished: list[bool] = field(default_factory=list)
    unfinished: int = 0  # still running at the cut-off (their TTFT: censored there)
    preemptions: int = 0
    prefix_hits: int = 0
    prefix_queries: int = 0
    steps: int = 0
    wall_s: float = 0.0
    routing_wall_s: float = 0.0


class Fleet:
    """`n` replicas of `shape`, routed by `policy`, timed by `model` (module docstring)."""

    def __init__(
        self,
        n: int,
        shape: ReplicaShape,
        model: StepModel,
        stats_period_s: float = 2.0,
        model_name: str = "sim",
    ) -> None:
        self.shape = shape
        self.model = model
        self.stats_period_s = stats_period_s
        self.salt = prefix_hash_salt(model_name, shape.block_size)
        self.replicas = [SimReplica(i, SimEngine(shape, self.salt)) for i in range(n)]
        self.prompts = Prompts()
        self._prefix_hashes: dict[tuple[int, int], list[int]] = {}

    # -- requests --------------------------------------------------------------

    def _hashes(self, req: SimRequest, tokens: list[int]) -> list[int]:
        """The prompt's block hashes; a one-piece prefix (a tenant's) is hashed once."""
        bs = self.shape.block_size
        start: list[int] = []
        if len(req.pieces) == 1:
            key = req.pieces[0]
            start = self._prefix_hashes.get(key, [])
            if not start:
                start = block_hashes(tokens[: key[1]], bs, self.salt)
                self._prefix_hashes[key] = start
        return block_hashes(tokens, bs, self.salt, start)

    def run(
        self,
        requests: Iterable[SimRequest],
        policy_factory: Callable[[Fleet], Policy],
        duration_s: float,
        warmup_s: float = 0.0,
        max_drain_s: float | None = None,
        progress: Callable[[str], None] | None = None,
    ) -> RunResult:
        policy = policy_factory(self)
        result = RunResult(policy.name, len(self.replicas), duration_s, warmup_s)
        cutoff = duration_s + (duration_s if max_drain_s is None else max_drain_s)
        order = itertools.count()
        events: list[tuple[float, int, int, Any]] = []  # (time, order, kind, payload)
        arrivals: Iterator[SimRequest] = iter(requests)
        flying: dict[str, InFlightRequest] = {}
        wall0 = time.perf_counter()
        routing = 0.0

        def push(t: float, kind: int, payload: Any) -> None:
            heapq.heappush(events, (t, next(order), kind, payload))

        more = [True]  # arrivals left to come

        def next_arrival() -> None:
            req = next(arrivals, None)
            if req is not None:
                push(req.arrival_s, _ARRIVAL, req)
            more[0] = req is not None

        next_arrival()
        n = len(self.replicas)
        for r in self.replicas:
            push(self.stats_period_s * r.index / n, _STATS, r.index)
        push(warmup_s, _WARMUP, None)
        next_report = 0.0
        while events:
            now, _, kind, payload = heapq.heappop(events)
            if now > cutoff:
                break
            if kind == _ARRIVAL:
                next_arrival()
                req: SimRequest = payload
                tokens = self.prompts.tokens(req)
                rid = str(req.request_id)
                route = RouteRequest(
                    rid,
                    len(tokens),
                    req.output_tokens,
                    tuple(self._hashes(req, tokens)),
                    self.salt,
                )
                flight = InFlightRequest(req, route, -1)
                t0 = time.perf_counter()
                flight.replica = policy.choose(flight, now)
                routing += time.perf_counter() - t0
                replica = self.replicas[flight.replica]
                flying[rid] = flight
                replica.unfinished += 1
                replica.active_tokens += len(tokens)
                params = SamplingParams(max_tokens=req.output_tokens, ignore_eos=True)
                replica.engine.add(EngineRequest(rid, None, tokens, params, now))
                # The router already hashed it: the engine reuses the hashes.
                replica.engine.sequences(rid)[0].block_hashes[:] = route.prompt_block_hashes
                if not replica.busy:
                    self._start_step(replica, now, push)
            elif kind == _STEP:
                replica = self.replicas[payload[0]]
                self._end_step(replica, payload[1], now, flying, policy, result)
                self._start_step(replica, now, push)
            elif kind == _STATS:
                replica = self.replicas[payload]
                policy.on_stats(payload, self.report(replica, now), now)
                if more[0] or flying:
                    push(now + self.stats_period_s, _STATS, payload)
            elif kind == _WARMUP:
                for r in self.replicas:
                    bm = r.engine.block_manager
                    r.hits_at_warmup, r.queries_at_warmup = (
                        bm.prefix_cache_hits,
                        bm.prefix_cache_queries,
                    )
                    r.preemptions_at_warmup = r.engine.scheduler.num_preemptions
            if progress is not None and now >= next_report:
                progress(
                    f"  {policy.name}: simulated {now:.0f}/{duration_s:.0f} s, "
                    f"{len(result.ttft_s)} done, {len(flying)} in flight"
                )
                next_report += max(duration_s / 4, 1.0)
        for flight in flying.values():  # cut off: censored at the cut-off
            if flight.req.arrival_s >= warmup_s:
                first = flight.first_token_s
                result.unfinished += 1
                result.arrival_s.append(flight.req.arrival_s)
                result.ttft_s.append((cutoff if first is None else first) - flight.req.arrival_s)
                result.itl_s.append(float("nan"))
                result.end_s.append(cutoff)
                result.output_tokens.append(flight.tokens)
                result.finished.append(False)
        for r in self.replicas:
            bm = r.engine.block_manager
            result.preemptions += r.engine.scheduler.num_preemptions - r.preemptions_at_warmup
            result.prefix_hits += bm.prefix_cache_hits - r.hits_at_warmup
            result.prefix_queries += bm.prefix_cache_queries - r.queries_at_warmup
            result.steps += r.steps
        result.wall_s = time.perf_counter() - wall0
        result.routing_wall_s = routing
        return result

    def report(self, replica: SimReplica, now: float) -> ReplicaLoad:
        """What the replica's `record_routing_stats` returns now, as the router parses it."""
        engine = replica.engine
        stats = dataclasses.replace(
            engine.stats(with_prefix=False), prefix_digest=engine.block_manager.prefix_digest()
        )
        return ReplicaLoad.from_routing_stats(replica.id, routing_stats_from_engine(stats, now))

    # -- steps -----------------------------------------------------------------

    def _start_step(self, replica: SimReplica, now: float, push: Callable[..., None]) -> None:
        out = replica.engine.step() if replica.engine.has_unfinished_requests() else None
        replica.busy = out is not None
        if out is not None:
            replica.steps += 1
            seconds = self.model.seconds(replica.engine.runner.last_shape)  # type: ignore[attr-defined]
            push(now + seconds, _STEP, (replica.index, out))

    def _end_step(
        self,
        replica: SimReplica,
        out: TokenStepOutput,
        now: float,
        flying: dict[str, InFlightRequest],
        policy: Policy,
        result: RunResult,
    ) -> None:
        for update in out.updates:
            flight = flying[update.request_id]
            sample = update.samples[0]
            if sample.token is not None:
                if flight.first_token_s is None:
                    flight.first_token_s = now
                flight.last_token_s = now
                flight.tokens += 1
                replica.active_tokens += 1
            if sample.finish_reason is not None:
                del flying[update.request_id]
                replica.unfinished -= 1
                replica.active_tokens -= flight.route.prompt_tokens + flight.tokens
                policy.on_completed(flight, now)
                if flight.req.arrival_s >= result.warmup_s:
                    first = flight.first_token_s or now
                    result.arrival_s.append(flight.req.arrival_s)
                    result.ttft_s.append(first - flight.req.arrival_s)
                    result.itl_s.append(
                        (now - first) / (flight.tokens - 1) if flight.tokens > 1 else float("nan")
                    )
                    result.end_s.append(now)
                    result.output_tokens.append(flight.tokens)
                    result.finished.append(True)

    def check_accounting(self) -> None:
        """Every replica's pool balances, and is all free once its requests are done."""
        for r in self.replicas:
            r.engine.check_block_accounting()
            bm = r.engine.block_manager
            if not r.engine.has_unfinished_requests() and bm.num_free_blocks != bm.num_total_blocks:
                raise AssertionError(f"{r.id}: {bm.num_used_blocks} blocks used when idle")


_ARRIVAL, _STEP, _STATS, _WARMUP = range(4)
