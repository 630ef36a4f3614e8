"""`pagefleet-lab fairness`: the ingress's fair queue on a simulated saturated fleet.

Two tenants send Poisson streams of the same request shape; the heavy one at `--ratio`
times the light one's rate, together `--load` times what the fleet finishes per second
(measured first: a closed run with the fleet full). Three runs on the same seeded
requests, routed by most_free_blocks (`sim_policies`):

- **alone**: the light tenant's requests only;
- **fcfs**: both tenants, every request sent to the engines on arrival (pagefleet
  without `fairness.enabled`: the engines queue first come, first served);
- **fair**: both tenants through the product's `FairQueue` (`pagefleet.cluster.fairness`,
  the same object the ingress drives), its capacity `max_num_seqs` x replicas.

`FairGate` drives the queue inside the simulator's event loop through the fleet's
closed-loop hook (`Fleet.run` given a `ClosedLoop`: it hears every request's end and
sends what that end lets through). Arrivals are taken in time order: while the queue has
a free slot an arrival passes and is sent at its own time; once every slot is taken the
next arrivals wait for an end, when they join the queue (each stamped with its own
arrival) and the freed slot goes to the queue's choice, sent at that end. Prompt tokens
are charged as a request leaves the queue, its output tokens when it ends (the ingress
charges them as they stream). A request's TTFT counts from its own arrival, the wait in
the queue included; one still queued at the cut-off counts as unfinished with its TTFT
censored there.

Reported per run: each tenant's TTFT p50/p99 and goodput (requests per second meeting
`--slo-ttft` and `--slo-itl`), to `benchmarks/results/sim_fairness.{md,png}`.
Deterministic for a seed.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from pagefleet.bench.report import markdown_table, pyplot, save_png, write_report
from pagefleet.bench.stats import percentile
from pagefleet.cluster.fairness import FairQueue, Refused
from pagefleet_lab.sim.fleet import Fleet, ReplicaShape, RunResult
from pagefleet_lab.sim.policies import policy_factory
from pagefleet_lab.sim.step_model import H200_LLAMA31_8B, StepModel
from pagefleet_lab.sim.workloads import ClosedLoop, SimRequest, poisson_times

LIGHT, HEAVY = "light", "heavy"
POLICY = "most_free_blocks"


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FairGate(ClosedLoop):
    """The fair queue in front of the fleet (module docstring); `queue` None: no queue."""

    def __init__(
        self, requests: Sequence[SimRequest], queue: FairQueue | None, clock: _Clock
    ) -> None:
        super().__init__([])
        self.measured_start_s = 0.0
        self._pending = collections.deque(sorted(requests, key=lambda r: r.arrival_s))
        self._by_id = {r.request_id: r for r in requests}
        self.queue = queue
        self.clock = clock
        self.sent_at: dict[int, float] = {}
        self.refused = 0

    @property
    def done(self) -> bool:
        return not self._pending and (self.queue is None or self.queue.waiting == 0)

    def begin(self) -> list[SimRequest]:
        if self.queue is None:
            reqs = list(self._pending)
            self._pending.clear()
            self.sent_at.update((r.request_id, r.arrival_s) for r in reqs)
            return reqs
        return self._pass_while_room()

    def finished(self, request_id: int, now: float) -> list[SimRequest]:
        if self.queue is None:
            return []
        req = self._by_id[request_id]
        self._queue_arrivals(now)
        self.clock.now = now
        self.queue.charge(req.kind, req.output_tokens)
        leaving = self.queue.release(req.kind)
        sent = [self._send(self._by_id[w.ticket], now) for w in leaving]  # type: ignore[index]
        return sent + self._pass_while_room()

    def _send(self, req: SimRequest, at: float) -> SimRequest:
        self.sent_at[req.request_id] = at
        return dataclasses.replace(req, arrival_s=at)

    def _arrive(self, req: SimRequest) -> bool:
        """`req` at the queue at its arrival; whether it passed."""
        assert self.queue is not None
        self.clock.now = req.arrival_s
        placed = self.queue.arrive(req.request_id, req.kind, 0, req.prompt_tokens)
        self.refused += isinstance(placed, Refused)
        return placed is None

    def _queue_arrivals(self, upto: float) -> None:
        """The arrivals until `upto`: every slot was taken all that time, so they queue."""
        while self._pending and self._pending[0].arrival_s <= upto:
            passed = self._arrive(self._pending.popleft())
            assert not passed, "an arrival passed while every slot was taken"

    def _pass_while_room(self) -> list[SimRequest]:
        """The next arrivals while a slot is free: each passes at its own time."""
        assert self.queue is not None
        sent = []
        while self._pending and not self.queue.saturated:
            req = self._pending.popleft()
            assert self._arrive(req)
            sent.append(self._send(req, req.arrival_s))
        return sent


def two_tenants(
    light_qps: float, ratio: float, duration_s: float, prompt: int, output: int, seed: int
) -> list[SimRequest]:
    """The light tenant at `light_qps`, the heavy at `ratio` times it: distinct prompts."""
    rng = random.Random(seed)
    arrivals = [(t, LIGHT) for t in poisson_times(light_qps, duration_s, rng)]
    arrivals += [(t, HEAVY) for t in poisson_times(light_qps * ratio, duration_s, rng)]
    arrivals.sort()
    return [
        SimRequest(i, t, (), prompt, rng.randrange(1 << 30), output, kind)
        for i, (t, kind) in enumerate(arrivals)
    ]


@dataclass(frozen=True)
class Setup:
    replicas: int
    shape: ReplicaShape
    model: StepModel
    duration_s: float
    warmup_s: float
    drain_s: float
    prompt_tokens: int
    output_tokens: int
    ratio: float
    seed: int
    max_queued_per_tenant: int


def run_mode(setup: Setup, mode: str, requests: Sequence[SimRequest]) -> Outcome:
    """One run: `mode` is alone, fcfs or fair (module docstring)."""
    if mode == "alone":
        requests = [r for r in requests if r.kind == LIGHT]
    queue, clock = None, _Clock()
    if mode == "fair":
        capacity = setup.shape.max_num_seqs * setup.replicas
        queue = FairQueue(capacity, setup.max_queued_per_tenant, clock=clock)
    gate = FairGate(requests, queue, clock)
    fleet = Fleet(setup.replicas, setup.shape, setup.model)
    factory = policy_factory(POLICY, setup.seed)
    result = fleet.run(gate, factory, setup.duration_s, 0.0, max_drain_s=setup.drain_s)
    fleet.check_accounting()
    return Outcome.of(mode, requests, gate, result, setup)


@dataclass(frozen=True)
class Outcome:
    mode: str
    ttft: dict[str, list[float]]  # tenant -> TTFT of each counted request (from arrival)
    good: dict[str, int]  # tenant -> requests that met the SLO
    unfinished: dict[str, int]
    refused: int
    span_s: float
    throughput: float  # output tokens / s of every request, counted or not

    @classmethod
    def of(
        cls,
        mode: str,
        requests: Sequence[SimRequest],
        gate: FairGate,
        r: RunResult,
        setup: Setup,
        slo: tuple[float, float] = (2.0, 0.1),
    ) -> Outcome:
        cutoff = setup.duration_s + setup.drain_s
        counted = {q.request_id: q for q in requests if q.arrival_s >= setup.warmup_s}
        ttft: dict[str, list[float]] = {LIGHT: [], HEAVY: []}
        good = {LIGHT: 0, HEAVY: 0}
        unfinished = {LIGHT: 0, HEAVY: 0}
        seen = set()
        for rid, t, itl, done in zip(r.request_ids, r.ttft_s, r.itl_s, r.finished, strict=True):
            req = counted.get(rid)
            if req is None:
                continue
            seen.add(rid)
            waited = gate.sent_at[rid] - req.arrival_s
            ttft[req.kind].append(t + waited)
            unfinished[req.kind] += not done
            met = t + waited <= slo[0] and (math.isnan(itl) or itl <= slo[1])
            good[req.kind] += done and met
        for rid, req in counted.items():
            if rid not in seen:  # still queued at the cut-off, or refused
                ttft[req.kind].append(cutoff - req.arrival_s)
                unfinished[req.kind] += 1
        span = setup.duration_s - setup.warmup_s
        tokens = sum(r.output_tokens) / max(max(r.end_s, default=1.0), 1e-9)
        return cls(mode, ttft, good, unfinished, gate.refused, span, tokens)

    def p(self, tenant: str, q: float) -> float:
        return percentile(self.ttft[tenant], q)

    def goodput(self, tenant: str) -> float:
        return self.good[tenant] / self.span_s


def fleet_throughput(setup: Setup) -> float:
    """Requests per second the fleet finishes when full: a run of twice its slots at once."""
    n = 2 * setup.shape.max_num_seqs * setup.replicas
    reqs = [
        SimRequest(i, 0.0, (), setup.prompt_tokens, i, setup.output_tokens, HEAVY) for i in range(n)
    ]
    fleet = Fleet(setup.replicas, setup.shape, setup.model)
    r = fleet.run(reqs, policy_factory(POLICY, setup.seed), 1e9, 0.0)
    return n / max(r.end_s)


HEADER = (
    "run",
    "light TTFT p50 (s)",
    "light TTFT p99 (s)",
    "heavy TTFT p50 (s)",
    "heavy TTFT p99 (s)",
    "light goodput (req/s)",
    "heavy goodput (req/s)",
    "light unfinished",
    "heavy unfinished",
    "refused (429)",
    "output tok/s",
)


def _f(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.2f}"


def row(o: Outcome) -> list[object]:
    return [
        o.mode,
        _f(o.p(LIGHT, 0.5)),
        _f(o.p(LIGHT, 0.99)),
        _f(o.p(HEAVY, 0.5)),
        _f(o.p(HEAVY, 0.99)),
        _f(o.goodput(LIGHT)),
        _f(o.goodput(HEAVY)),
        o.unfinished[LIGHT],
        o.unfinished[HEAVY],
        o.refused,
        f"{o.throughput:.0f}",
    ]


def plot(outcomes: Sequence[Outcome], out: str) -> None:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    modes = [o.mode for o in outcomes]
    xs = range(len(modes))
    for i, (tenant, q) in enumerate(((LIGHT, 0.5), (LIGHT, 0.99), (HEAVY, 0.99))):
        ys = [o.p(tenant, q) for o in outcomes]
        left.bar([x + 0.27 * (i - 1) for x in xs], ys, 0.27, label=f"{tenant} p{round(q * 100)}")
    left.set_xticks(list(xs), modes)
    left.set_yscale("log")
    left.set_ylabel("TTFT (s)")
    left.legend(fontsize=8)
    for i, tenant in enumerate((LIGHT, HEAVY)):
        ys = [o.goodput(tenant) for o in outcomes]
        right.bar([x + 0.4 * (i - 0.5) for x in xs], ys, 0.4, label=tenant)
    right.set_xticks(list(xs), modes)
    right.set_ylabel("goodput (req/s within the SLO)")
    right.legend(fontsize=8)
    save_png(fig, out, 100)


def sweep(setup: Setup, load: float, capacity_qps: float) -> Iterator[Outcome]:
    light_qps = load * capacity_qps / (1 + setup.ratio)
    reqs = two_tenants(
        light_qps,
        setup.ratio,
        setup.duration_s,
        setup.prompt_tokens,
        setup.output_tokens,
        setup.seed,
    )
    for mode in ("alone", "fcfs", "fair"):
        yield run_mode(setup, mode, reqs)


def report(setup: Setup, load: float, outcomes: Sequence[Outcome], capacity_qps: float) -> str:
    by = {o.mode: o for o in outcomes}
    alone, fcfs, fair = (by[m].p(LIGHT, 0.99) for m in ("alone", "fcfs", "fair"))
    return "\n".join(
        [
            f"Simulated fleet (`sim_fleet`): {setup.replicas} replicas, each the engine's real "
            f"scheduler and block manager ({setup.shape.num_blocks:,} blocks of "
            f"{setup.shape.block_size}, max_num_seqs {setup.shape.max_num_seqs}), step time "
            f"from **{setup.model.name}** (a model, not a measurement); routed by {POLICY}.",
            "",
            f"Two tenants, {setup.prompt_tokens}-token prompts and {setup.output_tokens} output "
            f"tokens each; heavy sends {setup.ratio:g}x light's rate; together {load:g}x what the "
            f"fleet finishes when full ({capacity_qps:.1f} req/s). {setup.duration_s:g} s of "
            f"arrivals, the first {setup.warmup_s:g} s not counted, cut off {setup.drain_s:g} s "
            "after the last; SLO: TTFT <= 2 s, ITL <= 100 ms.",
            "",
            markdown_table(HEADER, [row(o) for o in outcomes]),
            "",
            f"Light tenant's p99 TTFT: fair {fair / alone:.2f}x its p99 alone, first come "
            f"first served {fcfs / alone:.1f}x.",
        ]
    )


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fairness", help="the ingress's fair queue on a saturated simulated fleet")
    p.add_argument("--replicas", type=int, default=16)
    p.add_argument("--ratio", type=float, default=10.0, help="heavy's rate over light's")
    p.add_argument("--load", type=float, default=1.3, help="offered load over the fleet's rate")
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--warmup", type=float, default=10.0)
    p.add_argument("--drain", type=float, default=60.0)
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--output-tokens", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-queued-per-tenant", type=int, default=1 << 20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/sim_fairness")


def run(args: argparse.Namespace) -> int:
    model = H200_LLAMA31_8B
    shape = ReplicaShape(model.kv_capacity_tokens // 16, 16, args.max_num_seqs, 8192)
    setup = Setup(
        args.replicas,
        shape,
        model,
        args.duration,
        args.warmup,
        args.drain,
        args.prompt_tokens,
        args.output_tokens,
        args.ratio,
        args.seed,
        args.max_queued_per_tenant,
    )
    capacity_qps = fleet_throughput(setup)
    outcomes = list(sweep(setup, args.load, capacity_qps))
    for o in outcomes:
        print(" | ".join(str(c) for c in row(o)), flush=True)
    plot(outcomes, args.out)
    body = report(setup, args.load, outcomes, capacity_qps)
    path = write_report(args.out, "Fair queuing at the ingress, simulated", body)
    print(f"wrote {path}")
    return 0
