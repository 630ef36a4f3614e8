"""The simulated fleet: replicas that are the real engine's scheduling with a step-time model.

Each replica is a `SimEngine`: the engine's own `TokenEngine` (so its real `Scheduler`
and `BlockManager`: admission, chunked prefill, the prefix cache with eviction,
preemption by recompute; its real stop checks, `stats()` and demand blocks) with the
model runner replaced by `StepRunner`, which samples an arbitrary non-EOS token for
every sequence that reaches the end of its known tokens and records the step's shape,
and its clock by the simulated time (both handed to `TokenEngine`'s constructor; the
fleet counts each step's simulated duration, `TokenEngine.count_busy`). Each request
ends at its output length (`max_tokens`, `ignore_eos`).

Time is simulated, one event at a time in time order (ties in the order scheduled),
so a run is a pure function of its seed:

- an arrival is routed at once by the policy and added to its replica's engine; an
  idle replica starts a step;
- a step is decided (`TokenEngine.step`: schedule, the runner, update) when it starts,
  and lasts `model.seconds(shape)`; its tokens and finishes are seen when it ends, and
  the replica's next step starts then. (A report taken during a step sees the engine
  as the step left it: blocks are taken and freed at the step's start.)
- decode runs: a step that would be decode only (nothing waiting, every running
  sequence computing exactly one token) is planned with the steps after it as one
  `DecodeRun` of k steps, k up to the first finish and within the free blocks (no
  preemption can happen in it). Its steps' times are the step model's, one by one;
  its effect on the engine (each step's block allocations in the scheduler's order,
  `BlockManager.allocate`; the tokens; the full blocks registered,
  `cache_computed_blocks`; the finishes, `finish_sequence`) is applied lazily, in
  bulk, up to the step in progress whenever someone looks (a report, an arrival on
  the replica, a policy reading the live engine) and at its end. An arrival on the
  replica cuts the run at the end of the step in progress, as it would join the
  next step. The outcome is exactly that of stepping one at a time (the tests run
  both), at O(blocks allocated + sequences) per run instead of O(steps x sequences);
  `Fleet(fuse_decode=False)` steps one at a time.
- every `stats_period_s` each replica's report is taken (`routing_stats_from_engine`
  of its `stats()`, what a Serve replica's `record_routing_stats` returns) and handed
  to the policy, as Serve hands the routers the latest poll; replicas' polls are
  spread evenly over the period.

The autoscaler in the loop (`Fleet.run(autoscale=SimAutoscale(...))`): every replica
pushes `autoscaling_stats_from_engine` of its `stats()` every `metrics_interval_s`, as a
Serve replica's `record_autoscaling_stats` does; every `control_interval_s` the real
`KVCacheAutoscalingPolicy` (so the real `decide`) is called with a context built as
Serve 2.60 builds it: each metric's mean over `look_back_period_s` per replica and the
raw points of that window, the running and target replica counts, its own policy
state. A target above the replicas running or starting starts new ones, which take
traffic `startup_s` later with an empty cache (a new id each, as Serve names them); a
target below cancels starting ones first, then drains the newest running ones: they
leave the routable set at once (`Fleet.live`; the policy hears `on_replicas`), stop
reporting, and finish what they hold. The policy's status reaches the router as Serve's
reaches the ingresses: a scale-in notice (`Decision.leaving`) is handed to
`Policy.on_scale_in_notice` when it changes, and the warm-ups the policy routes then or
as one ends (`Policy.take_warm_ups`) are sent to their replicas as requests of one
output token, left out of the results and of the prefix-hit counters the results and
the timeline give (users' requests only; `RunResult.warm_ups` counts them).
`RunResult.timeline` samples the fleet every
control tick (replicas, target, utilisation, the fleet's prefix-cache counters) and
`RunResult.scale_events` lists every target change.

Closed loop (`Fleet.run` given a `ClosedLoop` instead of arrivals): no arrival is known
in advance; each user's next request arrives when its previous one ends (the end of the
step that made its last token), and a phase's first requests when the phase before it
has ended and its pause has passed. Only the measured phase counts: the warm-up ends
(counters are taken) when it starts, and the run when its last request ends.

Faults (`Fleet.run(faults=SimFaults(...))`, `pagefleet-lab migration`): at its time
each `Fault` takes a replica out of the routable set for good, as a dead actor or a
scale-in does in Serve (the policy hears `on_replicas`). A **kill** aborts the replica's
engine requests at once; a **scale-in** lets it finish what it holds, and with migration
cuts what is left after `SimFaults.drain_s` (`migration_drain_s`). A cut request either
fails (no migration: a row with `finished` False, in `RunResult.failed`) or moves, as
`pagefleet.cluster.migration` moves it: a continuation whose prompt is the prompt plus
the tokens delivered so far (a decode run's steps ended by then; a step in progress is
lost), with the remaining output, routed by the policy like any arrival (so a prefix
the router finds is a hit, the rest a longer prefill). The moved request keeps its
arrival, first token and token count (`InFlightRequest.offset`: those carried), and is
one row of the results; `RunResult.resume_gap_s` has, per move, the time from the cut to
its next token. `RunResult.removed_s` is when each faulted replica held nothing.

`Fleet.run` returns `RunResult`: per request arrival, TTFT, mean inter-token latency
(its TPOT: (last token - first token) / (tokens - 1)), end, and per replica its
preemptions and prefix-cache counters from the end of the warm-up on, and the requests
routed to it since.
"""

from __future__ import annotations

import bisect
import dataclasses
import gc
import heapq
import itertools
import math
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, NamedTuple, Protocol

from pagefleet.cluster.autoscaling import (
    AutoscalerStatus,
    AutoscalingPolicyConfig,
    ComputeMeter,
    KVCacheAutoscalingPolicy,
    autoscaling_stats_from_engine,
)
from pagefleet.cluster.routing.policy import RouteRequest
from pagefleet.cluster.routing.reports import ReplicaLoad, routing_stats_from_engine
from pagefleet.engine import SamplingParams, block_hashes, prefix_hash_salt
from pagefleet.engine.block_manager import PROTECTED_FRACTION, BlockManager
from pagefleet.engine.config import ResolvedCapacity
from pagefleet.engine.handoffs import EngineRequest, TokenStepOutput
from pagefleet.engine.model_runner import ModelRunnerOutput
from pagefleet.engine.scheduler import Scheduler, SchedulerOutput
from pagefleet.engine.sequence import Sequence
from pagefleet.engine.token_engine import TokenEngine
from pagefleet_lab.sim.step_model import StepModel, StepShape, decode_run_ends, step_shape
from pagefleet_lab.sim.workloads import VOCAB, ClosedLoop, Prompts, SimRequest

SAMPLED_TOKEN = 17  # any plain token: never EOS (there is none), ignore_eos anyway


@dataclass(frozen=True)
class ReplicaShape:
    """One replica's engine limits."""

    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 32768
    protected_fraction: float = PROTECTED_FRACTION  # the engine's prefix_cache_protected_fraction


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
    """A `TokenEngine` whose runner is `StepRunner` and whose clock is simulated
    (`now`, which the fleet sets before each step and each look)."""

    runner: StepRunner

    def __init__(self, shape: ReplicaShape, hash_salt: int) -> None:
        self.now = 0.0
        block_manager = BlockManager(
            shape.num_blocks,
            shape.block_size,
            True,
            hash_salt,
            clock=self.simulated_time,
            protected_fraction=shape.protected_fraction,
        )
        scheduler = Scheduler(
            block_manager,
            max_num_seqs=shape.max_num_seqs,
            max_num_batched_tokens=shape.max_num_batched_tokens,
            enable_chunked_prefill=True,
        )
        capacity = ResolvedCapacity(
            shape.num_blocks,
            shape.block_size,
            shape.max_model_len,
            shape.max_num_batched_tokens,
            kv_bytes_per_block=0,
        )
        super().__init__(
            StepRunner(), scheduler, capacity, frozenset(), VOCAB, clock=self.simulated_time
        )

    def simulated_time(self) -> float:
        return self.now


class DecodeRun:
    """k decode-only steps of one replica, planned at `start_s` (module docstring).

    `ends[i]` is the end time of step i + 1 (`ends[-1]` the run's end); `applied` the
    steps applied to the engine so far. Step i + 1 is decided (applied) when it starts,
    at `ends[i - 1]` (`start_s` for the first), as `TokenEngine.step` decides a step."""

    def __init__(
        self,
        engine: SimEngine,
        start_s: float,
        seqs: list[Sequence],
        k: int,
        allocations: list[tuple[int, int]],
        ends: list[float],
    ) -> None:
        self.engine = engine
        self.start_s = start_s
        self.seqs = seqs
        self.c0 = [s.num_computed_tokens for s in seqs]
        self.k = k
        self.allocations = allocations  # (step, index in seqs), in the scheduler's order
        self.ends = ends
        self.applied = 0
        self._next_alloc = 0

    @classmethod
    def plan(cls, engine: SimEngine, now: float, model: StepModel) -> DecodeRun | None:
        """A run from the engine's state now, or None (not decode only, or k < 2)."""
        sched = engine.scheduler
        if sched.waiting or not sched.running:
            return None
        seqs = list(sched.running)
        n = len(seqs)
        if n > sched.max_num_batched_tokens:
            return None
        max_len = engine.capacity.max_model_len
        k = max_len  # steps to the first finish
        for seq in seqs:
            if seq.num_schedulable_tokens != 1 or seq.num_forks_pending:
                return None
            p = seq.params
            if not p.ignore_eos or p.stop_token_ids or p.max_tokens is None:
                return None  # the sim's requests only: they end at max_tokens
            k = min(k, p.max_tokens - seq.num_output_tokens, max_len - seq.num_tokens)
        if k < 2:
            return None
        bm = engine.block_manager
        bs = bm.block_size
        allocations: list[tuple[int, int]] = []
        for j, seq in enumerate(seqs):
            # Step i writes slot c0 + i - 1: a new block when that slot is past the table.
            first = len(seq.block_table) * bs - seq.num_computed_tokens + 1
            allocations += ((i, j) for i in range(max(first, 1), k + 1, bs))
        allocations.sort()
        free = bm.num_free_blocks
        if len(allocations) > free:  # the first allocation that would not fit preempts
            k = allocations[free][0] - 1
            if k < 2:
                return None
            del allocations[free:]
        kv0 = sum(s.num_computed_tokens for s in seqs)
        return cls(engine, now, seqs, k, allocations, decode_run_ends(model, now, n, kv0, k))

    def started_by(self, now: float) -> int:
        """Steps decided by `now` (the one in progress included)."""
        return min(self.k, 1 + bisect.bisect_right(self.ends, now))

    def apply(self, upto: int) -> None:
        """Apply steps `applied + 1 .. upto` to the engine."""
        if upto <= self.applied:
            return
        engine, bm = self.engine, self.engine.block_manager
        allocs, copies = self.allocations, []
        while self._next_alloc < len(allocs) and allocs[self._next_alloc][0] <= upto:
            step, j = allocs[self._next_alloc]
            seq = self.seqs[j]
            seq.num_computed_tokens = self.c0[j] + step - 1
            if not bm.allocate(seq, self.c0[j] + step, copies):
                raise AssertionError("a decode run's allocation failed: its plan was wrong")
            self._next_alloc += 1
        d = upto - self.applied
        before = self.ends[self.applied - 1] if self.applied else self.start_s
        engine.count_busy(self.ends[upto - 1] - before, len(self.seqs))
        tokens = [SAMPLED_TOKEN] * d
        for j, seq in enumerate(self.seqs):
            seq.num_computed_tokens = self.c0[j] + upto
            seq.token_ids += tokens
            bm.cache_computed_blocks(seq)
        engine.count_generated(d * len(self.seqs))
        self.applied = upto
        if upto == self.k:
            for seq in self.seqs:
                if seq.num_output_tokens >= seq.params.max_tokens or (  # type: ignore[operator]
                    seq.num_tokens >= engine.capacity.max_model_len
                ):
                    engine.finish_sequence(seq.request_id, seq.index, "length")

    def cut(self, now: float) -> None:
        """End the run with the step in progress at `now` (an arrival joins the next)."""
        self.k = self.started_by(now)
        del self.ends[self.k :]
        self.apply(self.k)

    @property
    def end_s(self) -> float:
        return self.ends[self.k - 1]


@dataclass
class InFlightRequest:
    req: SimRequest
    route: RouteRequest
    replica: int
    first_token_s: float | None = None
    last_token_s: float = 0.0
    tokens: int = 0
    warm_up: bool = False  # a router's warm-up (`Policy.on_scale_in_notice`), not a user's
    seq: Sequence | None = None  # its engine sequence (a warm-up's: its cached tokens)
    offset: int = 0  # tokens delivered before this replica (a continuation's, carried)
    moved_s: float | None = None  # a continuation's: when it was cut, until its next token


@dataclass
class SimReplica:
    index: int
    engine: SimEngine
    busy: bool = False
    run: DecodeRun | None = None  # the decode run in progress
    serial: int = 0  # of the step or run in progress: a cut run's end event is stale
    # What a policy may read live (Serve's queue probe, Dynamo's KV events):
    unfinished: int = 0  # requests routed here and not finished
    active_tokens: int = 0  # tokens of those requests (prompt + generated so far)
    steps: int = 0
    step_calls: int = 0
    hits_at_warmup: int = 0
    queries_at_warmup: int = 0
    preemptions_at_warmup: int = 0

    @property
    def id(self) -> str:
        return f"r{self.index}"

    def sync(self, now: float) -> None:
        """Bring the engine to `now`: a decode run's steps decided by then applied."""
        self.engine.now = now
        if self.run is not None:
            self.run.apply(self.run.started_by(now))

    def active_tokens_at(self, now: float) -> int:
        """`active_tokens` with a decode run's tokens delivered by `now` (each step's at
        its end, as one-at-a-time stepping counts them)."""
        run = self.run
        if run is None:
            return self.active_tokens
        done = bisect.bisect_right(run.ends, now, hi=run.k)
        return self.active_tokens + done * len(run.seqs)


class Policy(Protocol):
    name: str
    # True: it reads the replicas' engines live (`Fleet.run` syncs them before `choose`).
    live_engine: bool

    def choose(self, request: InFlightRequest, now: float) -> int: ...

    def on_completed(self, request: InFlightRequest, now: float) -> None: ...

    def on_stats(self, replica: int, load: ReplicaLoad, now: float) -> None: ...

    def on_replicas(self, now: float) -> None: ...

    def on_scale_in_notice(self, leaving: int, now: float) -> None:
        """The autoscaler's scale-in notice (`autoscaling.Decision.leaving`; 0: withdrawn
        or done)."""
        ...

    def take_warm_ups(self, now: float) -> list[tuple[int, SimRequest]]:
        """Warm-ups the policy has routed since (on a notice, or as one ended): (replica,
        request) each, for the fleet to send now."""
        ...


@dataclass(frozen=True)
class SimAutoscale:
    """The autoscaler in the loop (module docstring): the policy's config (its Serve
    knobs too: look-back, metrics interval, bounds), how long a new replica takes to
    serve, and how often Serve's controller runs the policy."""

    config: AutoscalingPolicyConfig
    startup_s: float = 30.0
    control_interval_s: float = 1.0


@dataclass(frozen=True)
class Fault:
    """At `time_s`, replica `replica` is killed (`kind` "kill") or scaled in ("scale_in")."""

    time_s: float
    replica: int
    kind: str


@dataclass(frozen=True)
class SimFaults:
    """Faults in the loop (module docstring); `migrate` False: the cut requests fail."""

    faults: tuple[Fault, ...]
    migrate: bool
    drain_s: float = 5.0


class TimelinePoint(NamedTuple):
    time_s: float
    replicas: int  # routable (started, not draining)
    target: int
    starting: int
    kv_utilization: float | None  # what the policy acted on
    prefix_hits: int  # the fleet's counters so far (tokens), every replica ever
    prefix_queries: int


class ScaleEvent(NamedTuple):
    time_s: float
    old_target: int
    new_target: int
    reason: str


@dataclass
class RunResult:
    policy: str
    replicas: int
    duration_s: float
    warmup_s: float
    request_ids: list[int] = field(default_factory=list)  # each row's `SimRequest.request_id`
    arrival_s: list[float] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)  # per request; NaN for one token
    end_s: list[float] = field(default_factory=list)
    output_tokens: list[int] = field(default_factory=list)
    finished: list[bool] = field(default_factory=list)
    routed: dict[int, int] = field(default_factory=dict)  # replica -> requests since warm-up
    unfinished: int = 0  # still running at the cut-off (their TTFT: censored there)
    preemptions: int = 0
    prefix_hits: int = 0
    prefix_queries: int = 0
    steps: int = 0  # engine steps simulated
    step_calls: int = 0  # of those, one-at-a-time `TokenEngine.step`s, plus decode runs
    wall_s: float = 0.0
    routing_wall_s: float = 0.0
    # Warm-ups sent on scale-in notices, and their prompt tokens; `prefix_hits`,
    # `prefix_queries` and the timeline's counters leave them out (users' requests only).
    warm_ups: int = 0
    warm_up_tokens: int = 0
    timeline: list[TimelinePoint] = field(default_factory=list)
    scale_events: list[ScaleEvent] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)  # request ids cut and not moved
    moved: list[int] = field(default_factory=list)  # request ids moved, once a move
    removed_s: dict[int, float] = field(default_factory=dict)  # faulted replica -> empty at
    stranded: list[int] = field(default_factory=list)  # request ids on a replica at its fault
    resume_gap_s: list[float] = field(default_factory=list)  # per move: cut to next token


@contextmanager
def _cyclic_gc_off() -> Iterator[None]:
    """Python's cyclic collector off for a run.

    The replicas' caches hold millions of long-lived objects (a tuple of token ids per
    cached block, the router's ledgers), and every full collection walks them all
    again: at 64 replicas that was 40% of a run's wall time (43 s against 25 s for
    100 simulated s, the same peak memory). The loop makes no cycles to speak of:
    reference counting frees its garbage as it goes (and the fleet itself, after).
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        # What the run made and kept goes to the oldest generation as it is: a freeze
        # then an unfreeze moves every tracked object there without walking any (the
        # project freezes nothing else). Else the first collection after `enable` walks
        # every object the run made, as young (3 s after 600 simulated s at 64
        # replicas), and a full collection would walk them again anyway.
        gc.freeze()
        gc.unfreeze()
        if was:
            gc.enable()


class Fleet:
    """`n` replicas of `shape`, routed by `policy`, timed by `model` (module docstring)."""

    def __init__(
        self,
        n: int,
        shape: ReplicaShape,
        model: StepModel,
        stats_period_s: float = 2.0,
        model_name: str = "sim",
        fuse_decode: bool = True,
    ) -> None:
        self.shape = shape
        self.fuse_decode = fuse_decode
        self.model = model
        self.stats_period_s = stats_period_s
        self.salt = prefix_hash_salt(model_name, shape.block_size)
        self.replicas = [SimReplica(i, SimEngine(shape, self.salt)) for i in range(n)]
        self.live = list(range(n))  # routable: started and not draining, oldest first
        self.prompts = Prompts()
        self._prefix_hashes: dict[tuple[int, int], list[int]] = {}
        # Warm-ups' prompt tokens looked up and found cached, as the engines counted them.
        self.warm_queries = 0
        self.warm_hits = 0
        # A closed loop's hook during `run`: a request ended (its user may send the next).
        self._on_finished: Callable[[SimRequest, float], None] | None = None
        self.draining: set[int] = set()  # scaled in by a fault, not yet empty
        self.retired: set[int] = set()  # faulted: never polled again

    # -- requests --------------------------------------------------------------

    def route_request(self, req: SimRequest) -> tuple[list[int], RouteRequest]:
        """`req`'s prompt tokens, and what a router is given of it."""
        tokens = self.prompts.tokens(req)
        start = self.shared_hashes(req)
        hashes = block_hashes(tokens, self.shape.block_size, self.salt, start)
        return tokens, self.route_of(req, len(tokens), hashes)

    def route_of(self, req: SimRequest, prompt_tokens: int, hashes: Iterable[int]) -> RouteRequest:
        return RouteRequest(
            str(req.request_id), prompt_tokens, req.output_tokens, tuple(hashes), self.salt
        )

    def shared_hashes(self, req: SimRequest) -> list[int]:
        """The block hashes of `req`'s prefix when its prompt is one piece and a tail (a
        tenant's system prompt and a query): hashed once a piece, the same int objects in
        every prompt that starts with it; [] for other prompts."""
        if len(req.pieces) != 1:
            return []
        key = req.pieces[0]
        start = self._prefix_hashes.get(key)
        if start is None:
            piece = self.prompts.piece(*key)
            start = self._prefix_hashes[key] = block_hashes(piece, self.shape.block_size, self.salt)
        return start

    def catch_up(self, now: float) -> Iterator[None]:
        """`SimReplica.sync(now)` for each replica in a decode run, one a step of the
        iteration (the caller may stop at any point): what any look at `now` applies
        (applied is applied, whenever), so a run's results do not change. A policy
        process's loop does it while it waits for a choice, so less is left to apply
        when the runs end."""
        for r in self.replicas:
            if r.run is not None:
                r.sync(now)
                yield

    def flight_of(self, route: RouteRequest, req: SimRequest) -> InFlightRequest:
        """`req` as a policy is asked to route it."""
        return InFlightRequest(req, route, -1)

    @_cyclic_gc_off()
    def run(
        self,
        requests: Iterable[SimRequest] | ClosedLoop,
        policy_factory: Callable[[Fleet], Policy],
        duration_s: float,
        warmup_s: float = 0.0,
        max_drain_s: float | None = None,
        progress: Callable[[str], None] | None = None,
        progress_every: float | None = None,
        autoscale: SimAutoscale | None = None,
        faults: SimFaults | None = None,
    ) -> RunResult:
        """Simulate `requests` under the policy `policy_factory` makes (module docstring);
        `progress` gets a line every `progress_every` simulated seconds (default: a
        quarter of `duration_s`). A `ClosedLoop` sends its own requests and decides its
        own warm-up (`warmup_s` is not read); the run is then cut off at `duration_s`
        plus `max_drain_s` only as a guard."""
        policy = policy_factory(self)
        args = (requests, duration_s, warmup_s, max_drain_s, progress, progress_every, autoscale)
        return self._run(policy, *args, faults)

    def _run(
        self,
        policy: Policy,
        requests: Iterable[SimRequest] | ClosedLoop,
        duration_s: float,
        warmup_s: float,
        max_drain_s: float | None,
        progress: Callable[[str], None] | None,
        progress_every: float | None,
        autoscale: SimAutoscale | None,
        faults: SimFaults | None = None,
    ) -> RunResult:
        loop = requests if isinstance(requests, ClosedLoop) else None
        if loop is not None:
            warmup_s = math.inf  # until the measured phase starts
        result = RunResult(policy.name, len(self.replicas), duration_s, warmup_s)
        cutoff = duration_s + (duration_s if max_drain_s is None else max_drain_s)
        order = itertools.count()
        events: list[tuple[float, int, int, Any]] = []  # (time, order, kind, payload)
        arrivals = iter(() if loop is not None else requests)
        flying: dict[str, InFlightRequest] = {}
        wall0 = time.perf_counter()
        routing = 0.0
        warm_at = (self.warm_hits, self.warm_queries)  # at the warm-up's end

        def push(t: float, kind: int, payload: Any) -> None:
            heapq.heappush(events, (t, next(order), kind, payload))

        more = [True]  # arrivals left to come

        def next_arrival() -> None:
            if loop is not None:
                return  # a closed loop's come as requests end (`sent`)
            req = next(arrivals, None)
            if req is not None:
                push(req.arrival_s, _ARRIVAL, req)
            more[0] = req is not None

        def sent(reqs: list[SimRequest]) -> None:
            """A closed loop's new requests; the warm-up ends as its measured phase starts
            (before any of its requests arrive: the counters are taken first)."""
            assert loop is not None
            start = loop.measured_start_s
            if start is not None and math.isinf(result.warmup_s):
                result.warmup_s = start
                push(start, _WARMUP, None)
            for req in reqs:
                push(req.arrival_s, _ARRIVAL, req)
            more[0] = not loop.done

        if loop is not None:
            self._on_finished = lambda req, now: sent(loop.finished(req.request_id, now))
            sent(loop.begin())
        next_arrival()
        n = len(self.replicas)
        for r in self.replicas:
            push(self.stats_period_s * r.index / n, _STATS, r.index)
        if loop is None:
            push(warmup_s, _WARMUP, None)
        scaler = _Scaler(self, autoscale, push) if autoscale is not None else None
        for at in sorted({f.time_s for f in faults.faults} if faults is not None else ()):
            push(at, _FAULT, [f for f in faults.faults if f.time_s == at])  # type: ignore[union-attr]
        next_report = 0.0
        while events:
            now, _, kind, payload = heapq.heappop(events)
            if now > cutoff:
                break
            if kind == _ARRIVAL:
                next_arrival()
                routing += self._admit(payload, None, now, policy, push, flying, result)
            elif kind == _STEP:
                replica = self.replicas[payload[0]]
                if payload[1] != replica.serial:
                    continue  # a cut run's old end
                if isinstance(payload[2], DecodeRun):
                    self._end_run(replica, payload[2], now, flying, policy, result)
                else:
                    self._end_step(replica, payload[2], now, flying, policy, result)
                self._start_step(replica, now, push)
            elif kind in (_FAULT, _CUT):
                assert faults is not None
                args = (now, policy, push, flying, result, faults)
                if kind == _FAULT:
                    self._fault(payload, *args)
                else:
                    self._cut(payload, *args)
            elif kind == _STATS:
                if scaler is not None and payload not in scaler.live_set:
                    continue  # drained: no longer polled
                if payload in self.retired:
                    continue
                policy.on_stats(payload, self.report(self.replicas[payload], now), now)
                if more[0] or flying:
                    push(now + self.stats_period_s, _STATS, payload)
            elif kind in (_METRICS, _CONTROL, _STARTED):
                assert scaler is not None
                scaler.handle(kind, payload, now, policy, result, more[0] or bool(flying))
            if kind != _ARRIVAL and scaler is not None:  # a notice, or a warm-up's end
                for index, warm in policy.take_warm_ups(now):
                    self._admit(warm, index, now, policy, push, flying, result)
            elif kind == _WARMUP:
                warm_at = (self.warm_hits, self.warm_queries)
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
                next_report += (
                    max(duration_s / 4, 1.0) if progress_every is None else progress_every
                )
        for r in self.replicas:  # a run's steps that ended by the cut-off delivered
            self._delivered(r, cutoff, flying)
        for flight in flying.values():  # cut off: censored at the cut-off
            if flight.req.arrival_s >= result.warmup_s and not flight.warm_up:
                result.unfinished += 1
                _unfinished_row(flight, cutoff, result)
        for flight in flying.values():  # a warm-up admitted by the cut-off was counted
            if flight.warm_up and flight.seq is not None and flight.seq.block_table:
                self.warm_queries += flight.route.prompt_tokens
                self.warm_hits += flight.seq.num_cached_tokens
        result.prefix_hits -= self.warm_hits - warm_at[0]
        result.prefix_queries -= self.warm_queries - warm_at[1]
        for r in self.replicas:
            bm = r.engine.block_manager
            result.preemptions += r.engine.scheduler.num_preemptions - r.preemptions_at_warmup
            result.prefix_hits += bm.prefix_cache_hits - r.hits_at_warmup
            result.prefix_queries += bm.prefix_cache_queries - r.queries_at_warmup
            result.steps += r.steps
            result.step_calls += r.step_calls
        result.wall_s = time.perf_counter() - wall0
        result.routing_wall_s = routing
        self._on_finished = None
        return result

    def _admit(
        self,
        req: SimRequest,
        index: int | None,
        now: float,
        policy: Policy,
        push: Callable[..., None],
        flying: dict[str, InFlightRequest],
        result: RunResult,
    ) -> float:
        """`req` arrives: routed by `policy`, or a warm-up the policy sent to replica
        `index`; added to its replica's engine. The seconds the policy took to choose."""
        tokens, route = self.route_request(req)
        rid = route.request_id
        flight = InFlightRequest(req, route, -1 if index is None else index)
        if index is None:
            if getattr(policy, "live_engine", False):
                for r in self.replicas:
                    r.sync(now)
            t0 = time.perf_counter()
            flight.replica = policy.choose(flight, now)
            choosing = time.perf_counter() - t0
        else:
            choosing = 0.0
            flight.warm_up = True
            result.warm_ups += 1
            result.warm_up_tokens += len(tokens)
        replica = self.replicas[flight.replica]
        run = replica.run
        if run is not None and run.started_by(now) < run.k:
            # It joins the step after the one in progress: the run ends there.
            run.cut(now)
            replica.serial += 1
            push(run.end_s, _STEP, (replica.index, replica.serial, run))
        flying[rid] = flight
        if req.arrival_s >= result.warmup_s and not flight.warm_up:
            result.routed[flight.replica] = result.routed.get(flight.replica, 0) + 1
        replica.unfinished += 1
        replica.active_tokens += len(tokens)
        params = SamplingParams(max_tokens=req.output_tokens, ignore_eos=True)
        replica.engine.add(EngineRequest(rid, None, tokens, params, now))
        # The router already hashed it: the engine reuses the hashes.
        flight.seq = replica.engine.sequences(rid)[0]
        flight.seq.block_hashes[:] = route.prompt_block_hashes
        if not replica.busy:
            self._start_step(replica, now, push)
        return choosing

    def report(self, replica: SimReplica, now: float) -> ReplicaLoad:
        """What the replica's `record_routing_stats` returns now, as the router parses it."""
        return ReplicaLoad.from_routing_stats(replica.id, self.routing_stats(replica, now))

    def routing_stats(self, replica: SimReplica, now: float) -> dict[str, Any]:
        """What the replica's `record_routing_stats` returns now."""
        replica.sync(now)
        engine = replica.engine
        stats = engine.stats(with_prefix=False)
        stats = dataclasses.replace(stats, prefix_digest=engine.block_manager.prefix_digest())
        return routing_stats_from_engine(stats, now)

    # -- steps -----------------------------------------------------------------

    def _start_step(self, replica: SimReplica, now: float, push: Callable[..., None]) -> None:
        replica.run = None
        replica.serial += 1
        engine = replica.engine
        engine.now = now
        if not engine.has_unfinished_requests():
            replica.busy = False
            return
        replica.busy = True
        replica.step_calls += 1
        run = DecodeRun.plan(engine, now, self.model) if self.fuse_decode else None
        if run is not None:
            replica.run = run
            run.apply(1)  # the first step is decided now
            push(run.end_s, _STEP, (replica.index, replica.serial, run))
            return
        out = engine.step()
        if out is None:
            replica.busy = False
            return
        replica.steps += 1
        shape = engine.runner.last_shape
        seconds = self.model.seconds(shape)
        engine.count_busy(seconds, shape.prefill_tokens + shape.decode_seqs)
        push(now + seconds, _STEP, (replica.index, replica.serial, out))

    def _end_run(
        self,
        replica: SimReplica,
        run: DecodeRun,
        now: float,
        flying: dict[str, InFlightRequest],
        policy: Policy,
        result: RunResult,
    ) -> None:
        """A decode run's k steps are done: every sequence got k tokens, one at each
        step's end; those that reached max_tokens finished at the last."""
        run.apply(run.k)
        replica.steps += run.k
        first_end = run.ends[0]
        for seq in run.seqs:
            flight = flying[seq.request_id]
            if flight.first_token_s is None:
                flight.first_token_s = first_end
            self._resumed(flight, first_end, result)
            self._tokens(replica, flight, run.k, now, seq.is_finished, policy, flying, result)

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
            got = int(sample.token is not None)
            if got and flight.first_token_s is None:
                flight.first_token_s = now
            if got:
                self._resumed(flight, now, result)
            self._tokens(
                replica, flight, got, now, sample.finish_reason is not None, policy, flying, result
            )

    def _tokens(
        self,
        replica: SimReplica,
        flight: InFlightRequest,
        got: int,
        now: float,
        finished: bool,
        policy: Policy,
        flying: dict[str, InFlightRequest],
        result: RunResult,
    ) -> None:
        """`flight` got `got` tokens, the last at `now`; and finished, if so."""
        if got:
            flight.last_token_s = now
            flight.tokens += got
            replica.active_tokens += got
        if finished:
            del flying[flight.route.request_id]
            replica.unfinished -= 1
            replica.active_tokens -= flight.route.prompt_tokens + flight.tokens - flight.offset
            policy.on_completed(flight, now)
            if replica.index in self.draining and replica.unfinished == 0:
                self.draining.discard(replica.index)
                result.removed_s[replica.index] = now
            if flight.warm_up:
                assert flight.seq is not None
                self.warm_queries += flight.route.prompt_tokens
                self.warm_hits += flight.seq.num_cached_tokens
            elif flight.req.arrival_s >= result.warmup_s:
                first = flight.first_token_s or now
                result.request_ids.append(flight.req.request_id)
                result.arrival_s.append(flight.req.arrival_s)
                result.ttft_s.append(first - flight.req.arrival_s)
                result.itl_s.append(
                    (now - first) / (flight.tokens - 1) if flight.tokens > 1 else float("nan")
                )
                result.end_s.append(now)
                result.output_tokens.append(flight.tokens)
                result.finished.append(True)
            if self._on_finished is not None and not flight.warm_up:
                self._on_finished(flight.req, now)

    # -- faults ----------------------------------------------------------------

    def _fault(
        self,
        at_once: list[Fault],
        now: float,
        policy: Policy,
        push: Callable[..., None],
        flying: dict[str, InFlightRequest],
        result: RunResult,
        faults: SimFaults,
    ) -> None:
        """`at_once` happen: their replicas leave the routable set together; a killed
        one's requests are cut now; a scaled-in one's finish there, or are cut after the
        drain (migration)."""
        for fault in at_once:
            index = fault.replica
            on = (f for f in flying.values() if f.replica == index and not f.warm_up)
            result.stranded += sorted(f.req.request_id for f in on)
            self.live.remove(index)
            self.retired.add(index)
        policy.on_replicas(now)
        for fault in at_once:
            self._leave(fault, now, policy, push, flying, result, faults)

    def _leave(
        self,
        fault: Fault,
        now: float,
        policy: Policy,
        push: Callable[..., None],
        flying: dict[str, InFlightRequest],
        result: RunResult,
        faults: SimFaults,
    ) -> None:
        """`fault`'s replica, out of the routable set, is stopped or drains."""
        index = fault.replica
        if fault.kind == "kill":
            self._cut(index, now, policy, push, flying, result, faults)
        elif self.replicas[index].unfinished == 0:
            result.removed_s[index] = now
        else:
            self.draining.add(index)
            if faults.migrate:
                push(now + faults.drain_s, _CUT, index)

    def _cut(
        self,
        index: int,
        now: float,
        policy: Policy,
        push: Callable[..., None],
        flying: dict[str, InFlightRequest],
        result: RunResult,
        faults: SimFaults,
    ) -> None:
        """Replica `index`'s requests are cut at `now`: each fails or moves."""
        if index in result.removed_s:
            return
        self.draining.discard(index)
        result.removed_s[index] = now
        replica = self.replicas[index]
        flights = self._stop(replica, now, flying, result)
        for flight in flights:
            policy.on_completed(flight, now)
        for flight in flights:
            if flight.warm_up:
                continue
            if faults.migrate:
                self._move(flight, now, policy, push, flying, result)
            else:
                self._failed(flight, now, result)

    def _stop(
        self,
        replica: SimReplica,
        now: float,
        flying: dict[str, InFlightRequest],
        result: RunResult,
    ) -> list[InFlightRequest]:
        """Abort everything on `replica`; its requests with the tokens delivered by `now`."""
        replica.sync(now)
        run = replica.run
        for flight in self._delivered(replica, now, flying):
            assert run is not None
            self._resumed(flight, run.ends[0], result)
        flights = [f for f in flying.values() if f.replica == replica.index]
        replica.engine.abort([f.route.request_id for f in flights])
        for f in flights:
            del flying[f.route.request_id]
        replica.run, replica.busy = None, False
        replica.serial += 1
        replica.unfinished = replica.active_tokens = 0
        return flights

    @staticmethod
    def _delivered(
        replica: SimReplica, at: float, flying: dict[str, InFlightRequest]
    ) -> list[InFlightRequest]:
        """Credit `replica`'s running steps that ended by `at`: the requests that got
        tokens from them."""
        run = replica.run
        if run is None:
            return []
        replica.steps += run.started_by(at)
        done = bisect.bisect_right(run.ends, at, hi=run.k)
        got = [flying[seq.request_id] for seq in run.seqs] if done else []
        for flight in got:
            flight.first_token_s = flight.first_token_s or run.ends[0]
            flight.tokens += done
            flight.last_token_s = run.ends[done - 1]
        return got

    def _move(
        self,
        flight: InFlightRequest,
        now: float,
        policy: Policy,
        push: Callable[..., None],
        flying: dict[str, InFlightRequest],
        result: RunResult,
    ) -> None:
        """`flight` continues on the replica the policy chooses: prompt + its tokens."""
        req = flight.req
        new = flight.tokens - flight.offset
        tokens = tuple(self.prompts.tokens(req)) + (SAMPLED_TOKEN,) * new
        cont = dataclasses.replace(
            req, pieces=(), tail_tokens=0, tokens=tokens, output_tokens=req.output_tokens - new
        )
        self._admit(cont, None, now, policy, push, flying, result)
        moved = flying[flight.route.request_id]
        moved.first_token_s, moved.last_token_s = flight.first_token_s, flight.last_token_s
        moved.tokens = moved.offset = flight.tokens
        moved.moved_s = now
        result.moved.append(req.request_id)

    def _resumed(self, flight: InFlightRequest, at: float, result: RunResult) -> None:
        """`flight` got a token at `at`: a continuation's first ends its resume gap."""
        if flight.moved_s is not None:
            result.resume_gap_s.append(at - flight.moved_s)
            flight.moved_s = None

    def _failed(self, flight: InFlightRequest, now: float, result: RunResult) -> None:
        """`flight` ends with an error at `now`: a row, not finished."""
        req = flight.req
        result.failed.append(req.request_id)
        if req.arrival_s >= result.warmup_s:
            _unfinished_row(flight, now, result)

    def check_accounting(self) -> None:
        """Every replica's pool balances, and is all free once its requests are done."""
        for r in self.replicas:
            r.engine.check_block_accounting()
            bm = r.engine.block_manager
            if not r.engine.has_unfinished_requests() and bm.num_free_blocks != bm.num_total_blocks:
                raise AssertionError(f"{r.id}: {bm.num_used_blocks} blocks used when idle")


class _Scaler:
    """The autoscaler's side of `Fleet.run` (module docstring)."""

    def __init__(self, fleet: Fleet, spec: SimAutoscale, push: Callable[..., None]) -> None:
        self.fleet = fleet
        self.spec = spec
        self.push = push
        cfg = spec.config
        # Its status reaches the router as Serve's reaches the ingresses (`publish_status`).
        self.policy = KVCacheAutoscalingPolicy(publish=self._published, **cfg.policy_kwargs())
        self.status: AutoscalerStatus | None = None
        self.leaving = 0  # the scale-in notice the router last heard
        self.policy_state: dict[str, Any] = {}
        self.target = len(fleet.live)
        self.starting: list[int] = []
        self.cancelled: set[int] = set()
        self.live_set = set(fleet.live)
        self.points: dict[int, list[tuple[float, dict[str, float]]]] = {}
        self.meters: dict[int, ComputeMeter] = {}  # per replica, as each Serve replica keeps one
        self.last_util: float | None = None
        n = len(fleet.live)
        for i in fleet.live:
            push(cfg.metrics_interval_s * i / max(n, 1), _METRICS, i)
        push(0.0, _CONTROL, None)

    def handle(
        self, kind: int, payload: Any, now: float, policy: Policy, result: RunResult, going: bool
    ) -> None:
        fleet, cfg = self.fleet, self.spec.config
        if kind == _METRICS:
            if payload not in self.live_set:
                return
            replica = fleet.replicas[payload]
            replica.sync(now)
            stats = replica.engine.stats(with_prefix=False)
            meter = self.meters.setdefault(payload, ComputeMeter())
            compute = meter.read(stats.busy_budget_seconds, now)
            point = autoscaling_stats_from_engine(stats, fleet.shape.max_num_seqs, compute)
            series = self.points.setdefault(payload, [])
            series.append((now, point))
            while series and series[0][0] < now - cfg.look_back_period_s:
                series.pop(0)
            if going:
                self.push(now + cfg.metrics_interval_s, _METRICS, payload)
        elif kind == _STARTED:
            if payload in self.cancelled:
                return
            self.starting.remove(payload)
            fleet.live.append(payload)
            self.live_set.add(payload)
            policy.on_replicas(now)
            self.push(now, _METRICS, payload)
            self.push(now + fleet.stats_period_s, _STATS, payload)
        else:
            self._control(now, policy, result)
            if going:
                self.push(now + self.spec.control_interval_s, _CONTROL, None)

    def _published(self, key: bytes, status: AutoscalerStatus) -> None:
        self.status = status

    def _context(self, now: float) -> SimpleNamespace:
        """What Serve 2.60 hands the policy: per replica each metric's mean over the
        look-back window (`aggregated_metrics`) and the window's points (`raw_metrics`)."""
        fleet, cfg = self.fleet, self.spec.config
        agg: dict[str, dict[str, float]] = {}
        raw: dict[str, dict[str, list[SimpleNamespace]]] = {}
        for i in fleet.live:
            window = [p for t, p in self.points.get(i, []) if t >= now - cfg.look_back_period_s]
            if not window:
                continue
            rid = fleet.replicas[i].id
            for key in window[0]:
                values = [p[key] for p in window]
                agg.setdefault(key, {})[rid] = sum(values) / len(values)
                raw.setdefault(key, {})[rid] = [SimpleNamespace(value=v) for v in values]
        return SimpleNamespace(
            aggregated_metrics=agg,
            raw_metrics=raw,
            current_num_replicas=len(fleet.live),
            target_num_replicas=self.target,
            policy_state=self.policy_state,
            current_time=now,
            app_name="sim",
            deployment_name="engine",
        )

    def _control(self, now: float, policy: Policy, result: RunResult) -> None:
        fleet, cfg = self.fleet, self.spec.config
        ctx = self._context(now)
        desired, self.policy_state = self.policy(ctx)
        sample_util = None
        used = ctx.aggregated_metrics.get("pagefleet_kv_used_blocks")
        if used:
            from pagefleet.cluster.autoscaling import sample_from_context

            smp = sample_from_context(ctx, cfg.kv_utilization_quantile)
            total = sum(r.total_blocks for r in smp.replicas.values())
            sample_util = sum(r.used_blocks for r in smp.replicas.values()) / total
        new = max(cfg.min_replicas, min(cfg.max_replicas, desired))
        if new != self.target:
            result.scale_events.append(ScaleEvent(now, self.target, new, ""))
            self._scale(new, now, policy)
        leaving = self.status.leaving if self.status is not None else 0
        if leaving != self.leaving:
            self.leaving = leaving
            policy.on_scale_in_notice(leaving, now)
        # Users' requests only: the warm-ups' lookups left out.
        hits = sum(r.engine.block_manager.prefix_cache_hits for r in fleet.replicas)
        queries = sum(r.engine.block_manager.prefix_cache_queries for r in fleet.replicas)
        hits, queries = hits - fleet.warm_hits, queries - fleet.warm_queries
        result.timeline.append(
            TimelinePoint(
                now, len(fleet.live), self.target, len(self.starting), sample_util, hits, queries
            )
        )

    def _scale(self, new: int, now: float, policy: Policy) -> None:
        fleet = self.fleet
        self.target = new
        have = len(fleet.live) + len(self.starting)
        for _ in range(new - have):  # scale out: new replicas, serving after start-up
            idx = len(fleet.replicas)
            fleet.replicas.append(SimReplica(idx, SimEngine(fleet.shape, fleet.salt)))
            self.starting.append(idx)
            self.push(now + self.spec.startup_s, _STARTED, idx)
        drop = have - new
        while drop > 0 and self.starting:  # scale in: cancel starts first
            self.cancelled.add(self.starting.pop())
            drop -= 1
        changed = False
        while drop > 0 and len(fleet.live) > 1:  # then drain the newest
            idx = fleet.live.pop()
            self.live_set.discard(idx)
            self.points.pop(idx, None)
            changed = True
            drop -= 1
        if changed:
            policy.on_replicas(now)


_ARRIVAL, _STEP, _STATS, _WARMUP, _METRICS, _CONTROL, _STARTED, _FAULT, _CUT = range(9)


def _unfinished_row(flight: InFlightRequest, at: float, result: RunResult) -> None:
    """`flight`'s row in `result`, ended at `at` without finishing (cut off or failed)."""
    req, first = flight.req, flight.first_token_s
    result.request_ids.append(req.request_id)
    result.arrival_s.append(req.arrival_s)
    result.ttft_s.append((at if first is None else first) - req.arrival_s)
    result.itl_s.append(float("nan"))
    result.end_s.append(at)
    result.output_tokens.append(flight.tokens)
    result.finished.append(False)
