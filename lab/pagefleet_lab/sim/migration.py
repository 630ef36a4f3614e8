"""`pagefleet-lab migration`: mid-stream migration on a simulated fleet that loses replicas.

A steady Poisson load of shared-prefix requests (`multi_tenant`: `--tenants` system
prompts, each request one of them plus its own query) runs on `--replicas` replicas,
routed by most_free_blocks (`sim_policies`). At `--fault-at` seconds the `--faulted`
newest replicas leave the fleet (`Fleet.run(faults=...)`, its module docstring), in
four runs on the same seeded requests:

- **kill, no migration**: the replicas die; their in-flight requests fail (pagefleet
  with `migration_limit: 0`: a 503 error event);
- **kill, migration**: each in-flight request continues elsewhere as a continuation
  (`pagefleet.cluster.migration`): prompt + the tokens delivered so far, the remaining
  output, placed by the router like any request (a prefix hit where it finds the
  system prompt or more, a longer prefill for the rest);
- **scale-in, no migration**: the replicas stop taking requests and drain until the
  last one they hold finishes;
- **scale-in, migration**: they drain for `--drain` seconds (`migration_drain_s`), then
  what they still hold moves as above.

Reported per run: completed requests per second of arrivals (goodput), failed requests,
TTFT and end-to-end p50/p99 of every completed request and of the stranded ones (those
on a faulted replica at its fault, wherever they finished), per move the time from the
cut to the continuation's first token, and the scale-in time
(fault to the replica's last request gone), to `benchmarks/results/sim_migration.{md,png}`.
The faulted replicas are not replaced. Deterministic for a seed.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass

from pagefleet.bench.report import markdown_table, pyplot, save_png, write_report
from pagefleet.bench.stats import percentile
from pagefleet_lab.sim.fleet import Fault, Fleet, ReplicaShape, RunResult, SimFaults
from pagefleet_lab.sim.policies import policy_factory
from pagefleet_lab.sim.step_model import H200_LLAMA31_8B, StepModel
from pagefleet_lab.sim.workloads import SimRequest, multi_tenant

POLICY = "most_free_blocks"
RUNS = (("kill", False), ("kill", True), ("scale_in", False), ("scale_in", True))


@dataclass(frozen=True)
class Setup:
    replicas: int
    shape: ReplicaShape
    model: StepModel
    qps: float
    duration_s: float
    fault_s: float
    faulted: int
    drain_s: float  # migration_drain_s
    cutoff_s: float  # after the last arrival
    tenants: int
    system_tokens: int
    query_tokens: int
    output_tokens: int
    seed: int

    def requests(self) -> list[SimRequest]:
        return list(
            multi_tenant(
                self.qps,
                self.duration_s,
                self.tenants,
                self.system_tokens,
                self.query_tokens,
                self.output_tokens,
                self.seed,
            )
        )

    def faults(self, kind: str, migrate: bool) -> SimFaults:
        """The `faulted` newest replicas (Serve scales the newest in) leave at `fault_s`."""
        picked = range(self.replicas - self.faulted, self.replicas)
        return SimFaults(tuple(Fault(self.fault_s, i, kind) for i in picked), migrate, self.drain_s)


def run_one(setup: Setup, kind: str, migrate: bool, requests: Sequence[SimRequest]) -> RunResult:
    """One run: `kind` is kill or scale_in (module docstring)."""
    fleet = Fleet(setup.replicas, setup.shape, setup.model)
    factory = policy_factory(POLICY, setup.seed)
    faults = setup.faults(kind, migrate)
    result = fleet.run(
        requests, factory, setup.duration_s, 0.0, max_drain_s=setup.cutoff_s, faults=faults
    )
    fleet.check_accounting()
    return result


@dataclass(frozen=True)
class Outcome:
    label: str
    kind: str
    completed: int
    failed: int
    unfinished: int  # still running at the cut-off
    moved: int
    stranded: int
    goodput: float  # completed requests per second of arrivals
    ttft: list[float]  # completed requests
    e2e: list[float]
    stranded_ttft: list[float]  # completed stranded requests
    stranded_e2e: list[float]
    resume_gap: list[float]  # per move: the cut to the continuation's first token
    scale_in_s: float  # fault to the last faulted replica empty

    @classmethod
    def of(cls, kind: str, migrate: bool, r: RunResult, setup: Setup) -> Outcome:
        stranded = set(r.stranded)
        rows = zip(r.request_ids, r.arrival_s, r.ttft_s, r.end_s, r.finished, strict=True)
        done = [(rid, t, end - a) for rid, a, t, end, ok in rows if ok]
        cut = [done_at - setup.fault_s for done_at in r.removed_s.values()]
        return cls(
            f"{kind.replace('_', '-')}, {'migration' if migrate else 'no migration'}",
            kind,
            len(done),
            len(r.failed),
            r.unfinished,
            len(r.moved),
            len(stranded),
            len(done) / setup.duration_s,
            [t for _, t, _ in done],
            [e for _, _, e in done],
            [t for rid, t, _ in done if rid in stranded],
            [e for rid, _, e in done if rid in stranded],
            r.resume_gap_s,
            max(cut) if len(cut) == setup.faulted else math.nan,
        )


def _f(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.2f}"


HEADER = (
    "run",
    "goodput (req/s)",
    "completed",
    "failed",
    "unfinished",
    "stranded",
    "moved",
    "TTFT p50 / p99 (s)",
    "e2e p50 / p99 (s)",
    "stranded TTFT p50 / p99 (s)",
    "stranded e2e p50 / p99 (s)",
    "moved: cut to next token p50 / p99 (s)",
    "scale-in time (s)",
)


def row(o: Outcome) -> list[object]:
    return [
        o.label,
        f"{o.goodput:.2f}",
        o.completed,
        o.failed,
        o.unfinished,
        o.stranded,
        o.moved,
        f"{_f(percentile(o.ttft, 0.5))} / {_f(percentile(o.ttft, 0.99))}",
        f"{_f(percentile(o.e2e, 0.5))} / {_f(percentile(o.e2e, 0.99))}",
        f"{_f(percentile(o.stranded_ttft, 0.5))} / {_f(percentile(o.stranded_ttft, 0.99))}",
        f"{_f(percentile(o.stranded_e2e, 0.5))} / {_f(percentile(o.stranded_e2e, 0.99))}",
        f"{_f(percentile(o.resume_gap, 0.5))} / {_f(percentile(o.resume_gap, 0.99))}",
        _f(o.scale_in_s) if o.kind == "scale_in" else "-",
    ]


def plot(outcomes: Sequence[Outcome], out: str) -> None:
    plt = pyplot()
    fig, (left, mid, right) = plt.subplots(1, 3, figsize=(14, 4))
    labels = [o.label.replace(", ", "\n") for o in outcomes]
    xs = list(range(len(outcomes)))
    series = (
        ("all TTFT p99", lambda o: percentile(o.ttft, 0.99)),
        ("all e2e p99", lambda o: percentile(o.e2e, 0.99)),
        ("stranded e2e p99", lambda o: percentile(o.stranded_e2e, 0.99)),
    )
    for i, (name, get) in enumerate(series):
        left.bar([x + 0.27 * (i - 1) for x in xs], [get(o) for o in outcomes], 0.27, label=name)
    left.set_xticks(xs, labels, fontsize=7)
    left.set_ylabel("seconds")
    left.set_ylim(0, 1.3 * left.get_ylim()[1])
    left.legend(fontsize=8, ncol=3, loc="upper center")
    mid.bar(xs, [o.goodput for o in outcomes], 0.6)
    for x, o in zip(xs, outcomes, strict=True):
        mid.annotate(f"{o.failed} failed", (x, o.goodput), ha="center", va="bottom", fontsize=8)
    mid.set_xticks(xs, labels, fontsize=7)
    mid.set_ylabel("goodput (completed req/s)")
    scaled = [o for o in outcomes if o.kind == "scale_in"]
    right.bar(range(len(scaled)), [o.scale_in_s for o in scaled], 0.6)
    right.set_xticks(range(len(scaled)), [o.label.replace(", ", "\n") for o in scaled], fontsize=7)
    right.set_ylabel("scale-in time (s)")
    save_png(fig, out, 100)


def report(setup: Setup, outcomes: Sequence[Outcome]) -> str:
    return "\n".join(
        [
            f"Simulated fleet (`sim_fleet`): {setup.replicas} replicas, each the engine's real "
            f"scheduler and block manager ({setup.shape.num_blocks:,} blocks of "
            f"{setup.shape.block_size}, max_num_seqs {setup.shape.max_num_seqs}), step time "
            f"from **{setup.model.name}** (a model, not a measurement); routed by {POLICY}.",
            "",
            f"Poisson arrivals at {setup.qps:g} req/s for {setup.duration_s:g} s: "
            f"{setup.tenants} shared {setup.system_tokens}-token system prompts, each request "
            f"one of them plus its own {setup.query_tokens}-token query, "
            f"{setup.output_tokens} output tokens. At {setup.fault_s:g} s the "
            f"{setup.faulted} newest replicas are killed, or scaled in (migration: cut after "
            f"a {setup.drain_s:g} s drain); they are not replaced. Cut off "
            f"{setup.cutoff_s:g} s after the last arrival. Stranded: the requests on a "
            "faulted replica at its fault. Latencies are of completed requests; a moved "
            "request's TTFT is its first token's, on whichever replica made it; goodput is "
            "completed requests over the arrival window; a move's cut to next token is the "
            "stall its client sees (the continuation's routing, queueing and prefill).",
            "",
            markdown_table(HEADER, [row(o) for o in outcomes]),
            "",
            summary({o.label: o for o in outcomes}),
        ]
    )


def summary(by: dict[str, Outcome]) -> str:
    """The comparisons the table holds, in words."""
    k0, k1 = by["kill, no migration"], by["kill, migration"]
    s0, s1 = by["scale-in, no migration"], by["scale-in, migration"]
    return (
        f"Kill: without migration {k0.failed} of the {k0.stranded} stranded requests fail "
        f"(goodput {k0.goodput:.2f} req/s); with it {k1.failed} fail and "
        f"{k1.moved} move (goodput {k1.goodput:.2f} req/s), each stalled "
        f"{_f(percentile(k1.resume_gap, 0.99))} s at p99; every request's p99 TTFT goes from "
        f"{_f(percentile(k0.ttft, 0.99))} to {_f(percentile(k1.ttft, 0.99))} s (the moved requests take "
        f"slots and prefill time on the survivors). Scale-in: the replicas are gone "
        f"{_f(s1.scale_in_s)} s after it with migration ({s1.moved} moved), "
        f"{_f(s0.scale_in_s)} s without (their longest stream drained)."
    )


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "migration", help="mid-stream migration on a simulated fleet losing replicas"
    )
    p.add_argument("--replicas", type=int, default=16)
    p.add_argument("--faulted", type=int, default=2, help="replicas killed or scaled in")
    p.add_argument("--qps", type=float, default=50.0)
    p.add_argument("--duration", type=float, default=40.0)
    p.add_argument("--fault-at", type=float, default=20.0)
    p.add_argument("--drain", type=float, default=5.0, help="migration_drain_s")
    p.add_argument("--cutoff", type=float, default=120.0, help="after the last arrival")
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--system-tokens", type=int, default=768)
    p.add_argument("--query-tokens", type=int, default=256)
    p.add_argument("--output-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/sim_migration")


def run(args: argparse.Namespace) -> int:
    if not 0 < args.faulted < args.replicas:
        raise ValueError("--faulted must be at least 1 and fewer than --replicas")
    model = H200_LLAMA31_8B
    shape = ReplicaShape(model.kv_capacity_tokens // 16, 16, args.max_num_seqs, 8192)
    setup = Setup(
        args.replicas,
        shape,
        model,
        args.qps,
        args.duration,
        args.fault_at,
        args.faulted,
        args.drain,
        args.cutoff,
        args.tenants,
        args.system_tokens,
        args.query_tokens,
        args.output_tokens,
        args.seed,
    )
    requests = setup.requests()
    outcomes = []
    for kind, migrate in RUNS:
        o = Outcome.of(kind, migrate, run_one(setup, kind, migrate, requests), setup)
        print(" | ".join(str(c) for c in row(o)), flush=True)
        outcomes.append(o)
    plot(outcomes, args.out)
    path = write_report(args.out, "Mid-stream migration, simulated", report(setup, outcomes))
    print(f"wrote {path}")
    return 0
