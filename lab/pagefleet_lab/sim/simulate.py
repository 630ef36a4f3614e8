"""`pagefleet-lab simulate`: routing policies side by side on a simulated fleet of 4-64 replicas.

A discrete-event simulation (`sim_fleet`): every replica is the engine's real
scheduling (`TokenEngine` over the real `Scheduler` and `BlockManager`) with the model
forward replaced by a step-time model (`sim_step_model`): by default the H200 +
Llama-3.1-8B roofline model, `--step-model cpu` the fit to this machine's engine.
Every policy (`sim_policies`) gets the same seeded requests (`sim_workloads`); the
router under test, most_free_blocks, is the real `pagefleet.cluster.routing` code fed reports
`--stats-period` stale. Deterministic for a seed: simulated time only, never the clock.

For each workload x replica count x rate x policy: TTFT p50/p90/p99, mean inter-token
latency per request (p50/p90), output throughput, prefix-cache hit rate, preemptions,
and goodput: requests per second that met the SLO (TTFT <= `--slo-ttft`, ITL <=
`--slo-itl`). Requests arriving in the first `--warmup` seconds (cold caches) are not
counted; a run stops `--drain` seconds after the last arrival, and requests still
unfinished then count with their TTFT cut off there (a lower bound).

Rates are per replica (`--qps`), so a sweep means the same load per replica at every
fleet size; the multi-tenant workload's tenant count scales with the fleet's KV
capacity (`--prefix-fraction` of it in system prompts, llm-d's ratio by default).

`--autoscale MIN:MAX` runs the sinusoidal workload (sized for MAX replicas, the first
`--qps` per replica of MAX as the peak, a quarter of it as the trough, `--period`) on a
fleet that starts at MIN with the real autoscaling policy in the loop (`sim_fleet`'s
`SimAutoscale`: `--startup`, `--scale-out-after`, `--scale-in-after`, `--look-back`), and
reports per policy the timeline and, around each scale event, the fleet's prefix hit
rate and the p99 TTFT of the requests that arrived in the `--event-window` before and
after (`event_windows`).

`--workloads router_skew,router_prefix` are `pagefleet-lab router`'s scenarios, closed
loop, on its fleet (2 replicas of its engine, its policies): `sim_router`, for issue
22's validation against a real run (`sim_validation`). Engine settings, stats period,
policies and replica count then default to bench router's, the step model to the fit
to its replicas; `--router-args` passes bench router's own flags (seed, users, request
counts, KV blocks ...).

`--fit` measures the real engine's steps on this machine (`--fit-model`), fits the
linear step model, and writes lab/fits/sim_cpu_fit.json and
benchmarks/results/sim_step_fit.md. `--fit --fit-for router` measures the engine as
bench router configures each replica (its `--router-args` read the same way) with
`--fit-contenders` (1) engines of the same config stepping beside it, the other
replica (`sim_step_model.measure_engine_steps`), and writes lab/fits/sim_cpu_fit_router.json
and benchmarks/results/sim_step_fit_router.md.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import json
import math
import pstats
import shlex
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagefleet.bench.machine import LoadMonitor, machine_description
from pagefleet.bench.report import markdown_table, pyplot, save_png, write_report
from pagefleet.bench.stats import percentile
from pagefleet.cluster.autoscaling import AutoscalingPolicyConfig
from pagefleet.cluster.routing.config import RoutingConfig
from pagefleet.engine.block_manager import PROTECTED_FRACTION
from pagefleet.engine.config import EngineConfig
from pagefleet.settings import declared
from pagefleet_lab.sim import router_scenarios as sim_router
from pagefleet_lab.sim.fleet import (
    Fleet,
    ReplicaShape,
    RunResult,
    ScaleEvent,
    SimAutoscale,
    TimelinePoint,
)
from pagefleet_lab.sim.policies import POLICIES, policy_factory
from pagefleet_lab.sim.pool import run_all
from pagefleet_lab.sim.router_scenarios import DEFAULT_POLICIES as ROUTER_POLICIES
from pagefleet_lab.sim.router_scenarios import IDLE_PAUSE_S, ROUTER_WORKLOADS
from pagefleet_lab.sim.step_model import (
    CPU_FIT_PATH,
    H200_LLAMA31_8B,
    ROUTER_FIT_PATH,
    ScaledStepModel,
    StepModel,
    fit_linear,
    load_cpu_fit,
    measure_engine_steps,
)
from pagefleet_lab.sim.workloads import SimRequest, multi_tenant, read_trace, sinusoidal, skewed

# llm-d's benchmark: 150 tenants x 6k-token system prompts on 8 replicas whose KV holds
# about 2.4M tokens: the system prompts are ~0.375 of the fleet's KV.
LLMD_PREFIX_FRACTION = 0.375
DEFAULT_POLICIES = (
    "random",
    "round_robin",
    "power_of_two",
    "load_only",
    "approx_prefix",
    "approx_prefix_gie",
    "kv_cost",
    "most_free_blocks",
)


@dataclass(frozen=True)
class Setup:
    """What a run is made of besides the policy."""

    workload: str
    replicas: int
    qps_per_replica: float
    duration_s: float
    warmup_s: float
    seed: int
    shape: ReplicaShape
    model: StepModel
    stats_period_s: float
    system_tokens: int = 6000
    query_tokens: int = 1200
    output_tokens: int = 128
    prefix_fraction: float = LLMD_PREFIX_FRACTION
    trace: str | None = None
    period_s: float | None = None  # sinusoidal: the period (default: half the duration)
    # RoutingConfig fields for the policies that read one (`sim_policies.policy_factory`).
    routing: Mapping[str, Any] = field(default_factory=dict)

    @property
    def period(self) -> float:
        return self.period_s or self.duration_s / 2

    @property
    def qps(self) -> float:
        return self.qps_per_replica * self.replicas

    @property
    def tenants(self) -> int:
        kv = self.shape.num_blocks * self.shape.block_size
        return max(1, round(self.prefix_fraction * self.replicas * kv / self.system_tokens))

    def requests(self) -> Iterator[SimRequest]:
        if self.workload in ("multi_tenant", "sinusoidal"):
            tenants = multi_tenant(
                self.qps,
                self.duration_s,
                self.tenants,
                self.system_tokens,
                self.query_tokens,
                self.output_tokens,
                self.seed,
            )
            if self.workload == "multi_tenant":
                return tenants
            # The rate swings between a quarter of the QPS and the QPS (twice per run unless
            # `period_s` says otherwise).
            return sinusoidal(tenants, self.qps / 4, self.qps, self.period, self.seed)
        if self.workload == "skewed":
            return skewed(
                self.qps,
                self.duration_s,
                0.1,
                (self.system_tokens // 2, self.system_tokens + self.query_tokens),
                (4 * self.output_tokens, 8 * self.output_tokens),
                (100, 500),
                (self.output_tokens // 2, self.output_tokens),
                self.seed,
            )
        if self.workload == "trace":
            if not self.trace:
                raise SystemExit("--workloads trace needs --trace FILE (Mooncake JSONL)")
            reqs = read_trace(self.trace, time_scale=self.qps_per_replica)
            return (r for r in reqs if r.arrival_s < self.duration_s)
        raise SystemExit(f"unknown workload {self.workload!r}")


def setup_of(
    args: argparse.Namespace,
    workload: str,
    replicas: int,
    qps_per_replica: float,
    shape: ReplicaShape,
    model: StepModel,
) -> Setup:
    """The `Setup` the command line describes for one workload, fleet size and rate (the
    sweep's and the autoscaled run's: `--trace` and `--period` reach only the workloads
    that read them)."""
    return Setup(
        workload,
        replicas,
        qps_per_replica,
        args.duration,
        args.warmup,
        args.seed,
        shape,
        model,
        args.stats_period,
        args.system_tokens,
        args.query_tokens,
        args.output_tokens,
        args.prefix_fraction,
        args.trace,
        period_s=args.period,
        routing=args.routing,
    )


def _declared_float(config: type, name: str) -> Callable[[str], float]:
    """An argparse type for `config`'s field `name`: a float within the range the field
    declares (`pagefleet.settings.setting`), checked now, so a flag cannot drift from
    the setting it sets."""
    decl = declared(next(f for f in dataclasses.fields(config) if f.name == name))
    assert decl is not None, f"{config.__name__}.{name} declares no range"

    def parse(text: str) -> float:
        value = float(text)
        if not decl.accepts(value):
            raise argparse.ArgumentTypeError(f"{name} must be {decl.range_text()}, got {text}")
        return value

    return parse


def _routing_fields(text: str) -> dict[str, Any]:
    """`--routing`: a JSON object of RoutingConfig fields, checked now (a bad one fails
    before any run)."""
    try:
        fields = json.loads(text)
        if not isinstance(fields, dict):
            raise ValueError("not a JSON object")
        RoutingConfig(**fields)
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return fields


def simulate(setup: Setup, policy: str, progress: bool = False) -> tuple[RunResult, Fleet]:
    """One run of `setup` under `policy`."""
    fleet = Fleet(setup.replicas, setup.shape, setup.model, setup.stats_period_s)
    factory = policy_factory(policy, setup.seed, setup.routing)
    result = fleet.run(
        setup.requests(),
        factory,
        setup.duration_s,
        setup.warmup_s,
        progress=(lambda line: print(line, flush=True)) if progress else None,
    )
    return result, fleet


def simulate_checked(job: tuple[Setup, str]) -> RunResult:
    """One run of `setup` under `policy`, every pool's block accounting checked after."""
    setup, policy = job
    result, fleet = simulate(setup, policy)
    fleet.check_accounting()
    return result


@dataclass(frozen=True)
class Summary:
    """One run's figures (times in seconds)."""

    requests: int
    ttft: tuple[float, float, float]  # p50, p90, p99
    itl: tuple[float, float]  # p50, p90 of the per-request mean
    throughput: float  # output tokens / s
    hit_rate: float
    preemptions: int
    goodput: float  # requests / s meeting the SLO
    unfinished: int

    @classmethod
    def of(cls, r: RunResult, slo_ttft: float, slo_itl: float) -> Summary:
        """A single-token request has no ITL: it meets that half of the SLO."""
        itl = [x for x in r.itl_s if not math.isnan(x)]
        good = sum(
            1
            for ttft, i, done in zip(r.ttft_s, r.itl_s, r.finished, strict=True)
            if done and ttft <= slo_ttft and (math.isnan(i) or i <= slo_itl)
        )
        span = max(max(r.end_s, default=r.duration_s) - r.warmup_s, 1e-9)
        return cls(
            len(r.ttft_s),
            (percentile(r.ttft_s, 0.5), percentile(r.ttft_s, 0.9), percentile(r.ttft_s, 0.99)),
            (percentile(itl, 0.5), percentile(itl, 0.9)),
            sum(r.output_tokens) / span,
            r.prefix_hits / r.prefix_queries if r.prefix_queries else math.nan,
            r.preemptions,
            good / max(r.duration_s - r.warmup_s, 1e-9),
            r.unfinished,
        )


# -- the report -------------------------------------------------------------------------

HEADER = (
    "workload",
    "replicas",
    "QPS",
    "policy",
    "requests",
    "TTFT p50 (s)",
    "TTFT p90 (s)",
    "TTFT p99 (s)",
    "ITL p50 (ms)",
    "ITL p90 (ms)",
    "out tok/s",
    "prefix hit %",
    "preemptions",
    "goodput (req/s)",
    "unfinished",
)


@dataclass(frozen=True)
class Row:
    setup: Setup
    policy: str
    summary: Summary
    wall_s: float
    steps: int


def _s(x: float) -> str:
    return "nan" if math.isnan(x) else f"{x:.3f}" if x < 10 else f"{x:.1f}"


def table_row(row: Row) -> list[object]:
    s, su = row.setup, row.summary
    return [
        s.workload,
        s.replicas,
        f"{s.qps:g}",
        row.policy,
        su.requests,
        *(_s(x) for x in su.ttft),
        *(f"{1000 * x:.1f}" for x in su.itl),
        f"{su.throughput:.0f}",
        f"{100 * su.hit_rate:.1f}",
        su.preemptions,
        f"{su.goodput:.2f}",
        su.unfinished,
    ]


def headline(rows: Sequence[Row], replicas: int, workload: str = "multi_tenant") -> str:
    """p90 TTFT per policy across the sweep at `replicas`, and the issue's aims checked."""
    mine = [r for r in rows if r.setup.replicas == replicas and r.setup.workload == workload]
    if not mine:
        return ""
    rates = sorted({r.setup.qps for r in mine})
    policies = list(dict.fromkeys(r.policy for r in mine))
    p90 = {(r.policy, r.setup.qps): r.summary.ttft[1] for r in mine}
    lines = [
        f"p90 TTFT (s), {workload}, {replicas} replicas:",
        "",
        markdown_table(
            ["policy", *(f"{q:g} QPS" for q in rates)],
            [[p, *(_s(p90.get((p, q), math.nan)) for q in rates)] for p in policies],
        ),
        "",
    ]
    # The ranking, with each approximate prefix scorer the run has (Ray Serve
    # LLM's tree, the EPP's default profile).
    held = []
    for approx in ("approx_prefix", "approx_prefix_gie"):
        order = ["random", "load_only", approx, "most_free_blocks"]
        if not all(p in policies for p in order):
            continue
        for q in rates:
            v = [p90[(p, q)] for p in order]
            ranked = v[0] > v[1] > v[2] >= v[3]
            vs_p2 = p90.get(("power_of_two", q), math.nan) / max(v[3], 1e-9)
            held.append(
                f"- {q:g} QPS: random > load_only > {approx} >= most_free_blocks "
                f"(p90): {'yes' if ranked else 'no'}; power_of_two / most_free_blocks "
                f"{vs_p2:.2f}x ({'>= 2x' if vs_p2 >= 2 else '< 2x'})"
            )
    if held:
        lines += ["The issue's aim, per rate:", "", *held, ""]
    return "\n".join(lines)


def plot(rows: Sequence[Row], out: str) -> None:
    plt = pyplot()
    groups = list(dict.fromkeys((r.setup.workload, r.setup.replicas) for r in rows))
    fig, axes = plt.subplots(2, len(groups), figsize=(4.2 * len(groups), 7), squeeze=False)
    for col, (workload, n) in enumerate(groups):
        mine = [r for r in rows if (r.setup.workload, r.setup.replicas) == (workload, n)]
        for policy in dict.fromkeys(r.policy for r in mine):
            pts = sorted((r.setup.qps, r.summary) for r in mine if r.policy == policy)
            xs = [q for q, _ in pts]
            axes[0][col].plot(xs, [s.ttft[1] for _, s in pts], "o-", label=policy)
            axes[1][col].plot(xs, [s.goodput for _, s in pts], "o-", label=policy)
        axes[0][col].set_title(f"{workload}, {n} replicas", fontsize=9)
        axes[0][col].set_yscale("log")
        axes[0][col].set_ylabel("p90 TTFT (s)")
        axes[1][col].set_ylabel("goodput (req/s in SLO)")
        axes[1][col].set_xlabel("QPS (fleet)")
    axes[0][0].legend(fontsize=7)
    save_png(fig, out, 100)


def timing_note(rows: Sequence[Row]) -> str:
    """Simulation speed, and what a simulated hour of the largest fleet costs at that speed."""
    big = max(r.setup.replicas for r in rows)
    mine = [r for r in rows if r.setup.replicas == big]
    sim = sum(r.setup.duration_s for r in mine)
    wall = sum(r.wall_s for r in mine)
    hour = 3600 * wall / sim
    return (
        f"Simulation speed at {big} replicas: {sim:.0f} simulated s in {wall:.0f} s of wall "
        f"time over {len(mine)} runs (every rate and policy), {sum(r.steps for r in mine):,} "
        f"engine steps: a simulated hour of this fleet at these loads takes ~{hour / 60:.0f} "
        f"min here ({'within' if hour < 600 else 'over'} the 10-minute aim)."
    )


def profile_note(setup: Setup, policy: str, top: int = 14) -> str:
    """Where one run's time goes (cProfile, the functions with the most own time)."""
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    result, _ = simulate(setup, policy)
    prof.disable()
    wall = time.perf_counter() - t0
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    body = buf.getvalue()
    body = body[body.index("ncalls") :] if "ncalls" in body else body
    return (
        f"Profile of one run ({setup.replicas} replicas, {setup.qps:g} QPS, {policy}, "
        f"{setup.duration_s:.0f} simulated s, {result.steps:,} steps; {wall:.1f} s under "
        f"cProfile, routing {result.routing_wall_s:.1f} s):\n\n```\n{body.rstrip()}\n```"
    )


def fill_defaults(args: argparse.Namespace, router: bool) -> None:
    """The options left unset (None) on the command line: bench router's for its
    workloads (`sim_router` reads the engine's from `--router-args`), else the fleet
    sweep's."""
    if router:
        fill = {"replicas": "2", "policies": ",".join(ROUTER_POLICIES), "step_model": "cpu"}
    else:
        fill = {
            "replicas": "4,16,64",
            "policies": ",".join(DEFAULT_POLICIES),
            "step_model": "gpu",
            "block_size": 16,
            "max_num_seqs": 256,
            "max_num_batched_tokens": 8192,
            "stats_period": 2.0,
        }
    for key, value in fill.items():
        if getattr(args, key) is None:
            setattr(args, key, value)


def step_model(
    args: argparse.Namespace, router: bool
) -> tuple[StepModel, str, dict[str, object] | None]:
    """The step model `--step-model` names, how a report names it, and how its fit was
    measured (None for the roofline or an older fit): for cpu, the fit at `--step-fit`
    (default: the one to bench router's replicas for its workloads)."""
    if args.step_model == "gpu":
        return H200_LLAMA31_8B, H200_LLAMA31_8B.name, None
    path = Path(args.step_fit) if args.step_fit else ROUTER_FIT_PATH if router else CPU_FIT_PATH
    if not path.is_file():
        fit_cmd = "--fit --fit-for router" if path == ROUTER_FIT_PATH else "--fit"
        raise SystemExit(f"no step fit at {path}: `pagefleet-lab simulate {fit_cmd}` writes it")
    fit = load_cpu_fit(path)
    if args.step_scale == 1.0:
        return fit.model, f"{fit.model.name} ({path.name})", fit.engine
    scaled = ScaledStepModel(fit.model, args.step_scale)
    return scaled, f"{scaled.name} ({path.name}, --step-scale)", fit.engine


def run(args: argparse.Namespace) -> int:
    if args.fit:
        return run_fit(args)
    workloads = [w for w in args.workloads.split(",") if w]
    routed = [w for w in workloads if w in ROUTER_WORKLOADS]
    if routed:
        if len(routed) != len(workloads):
            raise SystemExit("router workloads (closed loop) run apart from the open-loop ones")
        fill_defaults(args, router=True)
        model, label, measured = step_model(args, router=True)
        return sim_router.run(args, workloads, model, label, measured)
    fill_defaults(args, router=False)
    if args.autoscale:
        return run_autoscale(args)
    model = step_model(args, router=False)[0]
    shape = replica_shape(args)
    policies = [p for p in args.policies.split(",") if p]
    for p in policies:
        if p not in POLICIES:
            raise SystemExit(f"unknown policy {p!r}: one of {', '.join(POLICIES)}")
    plan: list[tuple[str, int, list[float]]] = []
    for workload in args.workloads.split(","):
        for n in (int(x) for x in args.replicas.split(",")):
            rates = args.qps_at.get(n, args.qps) if args.qps_at else args.qps
            plan.append((workload, n, rates))
    jobs = [
        (setup_of(args, workload, n, q, shape, model), p)
        for workload, n, rates in plan
        for q in rates
        for p in policies
    ]
    rows: list[Row] = []
    with LoadMonitor() as load:
        for (setup, p), result in zip(jobs, run_all(simulate_checked, jobs), strict=True):
            summary = Summary.of(result, args.slo_ttft, args.slo_itl)
            rows.append(Row(setup, p, summary, result.wall_s, result.steps))
            print(
                f"{setup.workload}, {setup.replicas} replicas, {setup.qps:g} QPS, {p}: p90 TTFT "
                f"{_s(summary.ttft[1])} s, hits {100 * summary.hit_rate:.0f}%, "
                f"goodput {summary.goodput:.1f}/s ({result.wall_s:.1f} s wall)",
                flush=True,
            )
    prof = ""
    if args.profile:
        big = max(rows, key=lambda r: (r.setup.replicas, r.setup.qps))
        prof = profile_note(big.setup, "most_free_blocks")
    body = "\n".join(
        [
            machine_description(),
            load.summary(),
            "",
            describe(args, shape, model),
            "",
            headline(rows, 16) or headline(rows, max(r.setup.replicas for r in rows)),
            timing_note(rows),
            "",
            markdown_table(HEADER, [table_row(r) for r in rows]),
            "",
            prof,
        ]
    )
    plot(rows, args.out)
    path = write_report(args.out, "Fleet simulation: routing policies at 4-64 replicas", body)
    print(f"\nwrote {path}")
    return 0


# -- the autoscaler in the loop ---------------------------------------------------------


@dataclass(frozen=True)
class EventWindow:
    """One scale event's surroundings: the `window_s` before it and after it."""

    event: ScaleEvent
    hit_before: float
    hit_after: float
    p99_before: float
    p99_after: float
    requests_before: int
    requests_after: int


def hit_rate_between(timeline: Sequence[TimelinePoint], t0: float, t1: float) -> float:
    """The fleet's prefix hit rate (tokens) over [t0, t1), from the timeline's counters."""
    inside = [p for p in timeline if t0 <= p.time_s <= t1]
    if len(inside) < 2:
        return math.nan
    q = inside[-1].prefix_queries - inside[0].prefix_queries
    return (inside[-1].prefix_hits - inside[0].prefix_hits) / q if q else math.nan


def p99_between(r: RunResult, t0: float, t1: float) -> tuple[float, int]:
    """p99 TTFT of the requests that arrived in [t0, t1), and how many."""
    xs = [t for a, t in zip(r.arrival_s, r.ttft_s, strict=True) if t0 <= a < t1]
    return (percentile(xs, 0.99) if xs else math.nan), len(xs)


def event_windows(r: RunResult, window_s: float) -> list[EventWindow]:
    out = []
    for e in r.scale_events:
        before, nb = p99_between(r, e.time_s - window_s, e.time_s)
        after, na = p99_between(r, e.time_s, e.time_s + window_s)
        out.append(
            EventWindow(
                e,
                hit_rate_between(r.timeline, e.time_s - window_s, e.time_s),
                hit_rate_between(r.timeline, e.time_s, e.time_s + window_s),
                before,
                after,
                nb,
                na,
            )
        )
    return out


def autoscale_checked(job: tuple[Setup, str, int, float, SimAutoscale]) -> RunResult:
    """One autoscaled run of `setup` under a policy from `min_replicas` replicas, every
    pool's block accounting checked after."""
    setup, policy, min_replicas, stats_period_s, spec = job
    fleet = Fleet(min_replicas, setup.shape, setup.model, stats_period_s)
    result = fleet.run(
        setup.requests(),
        policy_factory(policy, setup.seed, setup.routing),
        setup.duration_s,
        setup.warmup_s,
        autoscale=spec,
    )
    fleet.check_accounting()
    return result


def run_autoscale(args: argparse.Namespace) -> int:
    """The sinusoidal load on an autoscaled fleet, the real policy in the loop."""
    lo, _, hi = args.autoscale.partition(":")
    min_r, max_r = int(lo), int(hi or lo)
    model = step_model(args, router=False)[0]
    shape = replica_shape(args)
    config = AutoscalingPolicyConfig(
        min_replicas=min_r,
        max_replicas=max_r,
        scale_out_after_s=args.scale_out_after,
        scale_in_after_s=args.scale_in_after,
        look_back_period_s=args.look_back,
        metrics_interval_s=min(2.0, args.look_back),
        target_compute_utilization=args.target_compute_utilization,
    )
    spec = SimAutoscale(config, startup_s=args.startup)
    policies = [p for p in args.policies.split(",") if p]
    # Sized for the largest fleet: tenants from max_replicas' KV, the rate per replica x it.
    setup = setup_of(args, "sinusoidal", max_r, args.qps[0], shape, model)
    results: list[tuple[str, RunResult]] = []
    jobs = [(setup, p, min_r, args.stats_period, spec) for p in policies]
    with LoadMonitor() as load:
        for p, r in zip(policies, run_all(autoscale_checked, jobs), strict=True):
            results.append((p, r))
            print(
                f"autoscaled {min_r}..{max_r}, {p}: {len(r.scale_events)} scale events, "
                f"p99 TTFT {_s(percentile(r.ttft_s, 0.99))} s, {r.wall_s:.0f} s wall",
                flush=True,
            )
    rows = []
    for p, r in results:
        for w in event_windows(r, args.event_window):
            e = w.event
            rows.append(
                [
                    p,
                    f"{e.time_s:.0f}",
                    f"{e.old_target} -> {e.new_target}",
                    f"{100 * w.hit_before:.1f}",
                    f"{100 * w.hit_after:.1f}",
                    f"{100 * (w.hit_after - w.hit_before):+.1f}",
                    _s(w.p99_before),
                    _s(w.p99_after),
                    f"{w.requests_before}/{w.requests_after}",
                ]
            )
    summary = [
        [
            p,
            len(r.ttft_s),
            *(_s(x) for x in (percentile(r.ttft_s, q) for q in (0.5, 0.9, 0.99))),
            f"{100 * r.prefix_hits / max(r.prefix_queries, 1):.1f}",
            len(r.scale_events),
            max((t.replicas for t in r.timeline), default=0),
            f"{r.warm_ups} ({r.warm_up_tokens:,})",
            r.unfinished,
            f"{r.wall_s:.0f}",
        ]
        for p, r in results
    ]
    w = args.event_window
    body = "\n".join(
        [
            machine_description(),
            load.summary(),
            "",
            describe(args, shape, model),
            "",
            f"Autoscaled {min_r}..{max_r} replicas by the real `KVCacheAutoscalingPolicy` "
            f"(`decide`), target_compute_utilization {config.target_compute_utilization:g}, "
            f"scale_out_after_s {config.scale_out_after_s:g}, scale_in_after_s "
            f"{config.scale_in_after_s:g}, look-back {config.look_back_period_s:g} s, metrics "
            f"every {config.metrics_interval_s:g} s, controller every "
            f"{spec.control_interval_s:g} s; a new replica serves {spec.startup_s:g} s after "
            f"the target rises (empty cache); scale-in drains the newest. Sinusoidal arrivals "
            f"between {setup.qps / 4:g} and {setup.qps:g} QPS, period {setup.period:g} s; "
            f"the fleet starts at {min_r}.",
            "",
            markdown_table(
                [
                    "policy",
                    "requests",
                    "TTFT p50 (s)",
                    "TTFT p90 (s)",
                    "TTFT p99 (s)",
                    "prefix hit %",
                    "scale events",
                    "most replicas",
                    "warm-ups (tokens)",
                    "unfinished",
                    "wall (s)",
                ],
                summary,
            ),
            "",
            f"Around each scale event (the target's change): the fleet's prefix hit rate "
            f"(tokens, users' requests: the warm-ups a scale-in notice sends are left out) "
            f"over the {w:g} s before and after, and p99 TTFT of the requests that arrived "
            f"in those windows. The autoscaler announces a scale-in "
            f"{config.scale_in_notice_s:g} s before it is due.",
            "",
            markdown_table(
                [
                    "policy",
                    "at (s)",
                    "target",
                    f"hit % {w:g} s before",
                    f"hit % {w:g} s after",
                    "change (points)",
                    "p99 TTFT before (s)",
                    "p99 TTFT after (s)",
                    "requests before/after",
                ],
                rows,
            ),
        ]
    )
    plot_autoscale(results, setup, args.out)
    path = write_report(args.out, "Fleet simulation: the autoscaler in the loop", body)
    print(body)
    print(f"\nwrote {path}")
    return 0


def plot_autoscale(results: Sequence[tuple[str, RunResult]], setup: Setup, out: str) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(4, 1, figsize=(10, 11), sharex=True)
    bucket = 10.0
    for p, r in results:
        t = [x.time_s for x in r.timeline]
        axes[0].step(t, [x.replicas for x in r.timeline], where="post", label=f"{p}: replicas")
        axes[0].step(t, [x.target for x in r.timeline], where="post", ls=":", label=f"{p}: target")
        edges = [bucket * i for i in range(int(setup.duration_s / bucket) + 1)]
        mids = [e + bucket / 2 for e in edges[:-1]]
        axes[2].plot(
            mids,
            [100 * hit_rate_between(r.timeline, a, a + bucket) for a in edges[:-1]],
            label=p,
        )
        axes[3].plot(mids, [p99_between(r, a, a + bucket)[0] for a in edges[:-1]], label=p)
        for e in r.scale_events:
            for ax in axes[1:]:
                ax.axvline(e.time_s, color="0.85", lw=0.8)
    edges = [bucket * i for i in range(int(setup.duration_s / bucket) + 1)]
    arrivals = [0] * (len(edges) - 1)
    for req in setup.requests():
        i = int(req.arrival_s // bucket)
        if i < len(arrivals):
            arrivals[i] += 1
    axes[1].plot([e + bucket / 2 for e in edges[:-1]], [a / bucket for a in arrivals], "k-")
    axes[0].set_ylabel("replicas")
    axes[1].set_ylabel("arrivals (QPS)")
    axes[2].set_ylabel(f"prefix hit % ({bucket:g} s)")
    axes[3].set_ylabel(f"p99 TTFT (s), {bucket:g} s")
    axes[3].set_yscale("log")
    axes[3].set_xlabel("simulated time (s); grey: scale events")
    axes[0].legend(fontsize=7)
    axes[2].legend(fontsize=7)
    save_png(fig, out, 100)


def replica_shape(args: argparse.Namespace) -> ReplicaShape:
    """One replica's engine limits from the flags (`fill_defaults` has run)."""
    blocks = args.kv_blocks or (
        H200_LLAMA31_8B.kv_capacity_tokens // args.block_size if args.step_model == "gpu" else 512
    )
    return ReplicaShape(
        blocks,
        args.block_size,
        args.max_num_seqs,
        args.max_num_batched_tokens,
        protected_fraction=args.prefix_cache_protected_fraction,
    )


def describe(args: argparse.Namespace, shape: ReplicaShape, model: StepModel) -> str:
    name = getattr(model, "name", "")
    return (
        f"Simulated (`sim_fleet`): each replica is the engine's real scheduler and block "
        f"manager, {shape.num_blocks:,} blocks of {shape.block_size} tokens, max_num_seqs "
        f"{shape.max_num_seqs}, {shape.max_num_batched_tokens} tokens per step, chunked "
        f"prefill and prefix caching on (protected share {shape.protected_fraction:g}); step "
        f"time from **{name}**"
        + (
            " (a roofline **model**, not a measurement)"
            if args.step_model == "gpu"
            else f" (fitted on this machine, {Path(args.step_fit or CPU_FIT_PATH).name})"
        )
        + f". Reports reach the router every {args.stats_period:g} s. Multi-tenant: "
        f"{args.system_tokens}-token system prompts (tenants: {args.prefix_fraction:g} of the "
        f"fleet's KV) + {args.query_tokens}-token queries, {args.output_tokens} tokens out; "
        f"skewed: 10% long. Poisson arrivals for {args.duration:g} s, the first "
        f"{args.warmup:g} s not counted, seed {args.seed}. SLO: TTFT <= {args.slo_ttft:g} s "
        f"and ITL <= {1000 * args.slo_itl:g} ms."
    )


def run_fit(args: argparse.Namespace) -> int:
    """`--fit`: time the real engine's steps, fit the linear model, write the JSON the
    simulator loads and a markdown report. `--fit-for router`: the engine exactly as
    bench router configures each replica (`router.fleet_config` through `ServeConfig`,
    as a Serve replica builds it), beside `--fit-contenders` engines like it."""
    router = args.fit_for == "router"
    info: dict[str, object] = {}
    if router:
        from pagefleet.bench.checkpoint import ensure_model
        from pagefleet.cluster.config import ServeConfig
        from pagefleet_lab.bench.router import fleet_config, router_args

        rargs = router_args(shlex.split(args.router_args))
        model_path, _ = ensure_model(rargs.model, rargs.preset)
        config = ServeConfig.model_validate(
            fleet_config(rargs, model_path, "most_free_blocks")
        ).engine_config()
        contenders = 1 if args.fit_contenders is None else args.fit_contenders
        print(
            f"timing bench router's replica engine ({Path(model_path).name}, "
            f"{config.num_threads} thread) beside {contenders} contender(s) ...",
            flush=True,
        )
        xs, ys = measure_engine_steps(
            model_path, repeats=args.fit_repeats, config=config, contenders=contenders, info=info
        )
        name = (
            f"fit: {Path(model_path).name}, bench router's replica engine, "
            f"{contenders + 1} engines stepping on this machine"
        )
    else:
        contenders = args.fit_contenders or 0
        print(f"timing the real engine's steps on {args.fit_model} ...", flush=True)
        xs, ys = measure_engine_steps(
            args.fit_model, repeats=args.fit_repeats, contenders=contenders, info=info
        )
        name = f"fit: {Path(args.fit_model).name} on this machine"
    fit = fit_linear(xs, ys, name=name, engine=info)
    json_path = (
        Path(args.fit_json) if args.fit_json else ROUTER_FIT_PATH if router else CPU_FIT_PATH
    )
    json_path.write_text(json.dumps(fit.to_json(), indent=2) + "\n")
    m = fit.model
    how = (
        f"`EngineCore.step` + `encode_events` (what a replica's engine core does per "
        f"iteration) of the engine bench router's replicas run ({info['model']}, "
        f"{info['dtype']}, {info['num_threads']} thread, {info['num_kv_blocks']} blocks of "
        f"{info['block_size']}, max_num_seqs {info['max_num_seqs']}, max_model_len "
        f"{info['max_model_len']}, {info['max_num_batched_tokens']} tokens per step, prefix "
        f"caching on) while {contenders} more engine(s) of the same config stepped the same "
        "batches in processes of their own (the other replica sharing the cores); each "
        f"shape's median over {args.fit_repeats} repeats. Not in it: Serve's proxy, "
        "ingress and replica actors, which share the same cores in a real run"
        if router
        else f"`LLMEngine` on `{args.fit_model}`, each shape's fastest of "
        f"{args.fit_repeats} repeats"
        + (f", beside {contenders} contender(s)" if contenders else "")
    )
    batches = ", ".join("x".join(str(v) for v in b) for b in info["batches"])  # type: ignore[attr-defined]
    body = "\n".join(
        [
            machine_description(),
            "",
            f"`t = a + b * prefill_tokens + c * decode_seqs + d * attended_kv_tokens`, least "
            f"squares over {fit.points} timed steps: {how}. Batches (requests x prompt "
            f"tokens x max tokens x steps between adds): {batches} "
            "(sim_step_model.measure_engine_steps).",
            "",
            markdown_table(
                ["a (s)", "b (s/prefill token)", "c (s/decode seq)", "d (s/KV token)"],
                [[f"{m.a:.3g}", f"{m.b:.3g}", f"{m.c:.3g}", f"{m.d:.3g}"]],
            ),
            "",
            f"Residuals: RMSE {1000 * fit.rmse_s:.1f} ms, max |residual| "
            f"{1000 * fit.max_abs_residual_s:.1f} ms, R² {fit.r2:.3f}, median |residual| / "
            f"measured {100 * fit.median_abs_rel:.0f}%. Written to {json_path.name}.",
        ]
    )
    print(body)
    out = args.fit_out or (
        "benchmarks/results/sim_step_fit_router" if router else "benchmarks/results/sim_step_fit"
    )
    title = (
        "Step-time model fitted to bench router's replicas on this machine"
        if router
        else "Step-time model fitted to this machine"
    )
    path = write_report(out, title, body)
    print(f"\nwrote {path}")
    return 0


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def _rates_at(text: str) -> dict[int, list[float]]:
    """ "64=1,4;4=2,6" -> {64: [1, 4], 4: [2, 6]}."""
    out: dict[int, list[float]] = {}
    for part in text.split(";"):
        if part.strip():
            n, _, rates = part.partition("=")
            out[int(n)] = _floats(rates)
    return out


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "simulate",
        help="routing policies on a simulated 4-64 replica fleet (real scheduler, step model)",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--workloads",
        default="multi_tenant",
        help="multi_tenant,skewed,sinusoidal,trace; or router_skew,router_prefix (bench "
        "router's scenarios, closed loop: sim_router)",
    )
    p.add_argument(
        "--replicas",
        default=None,
        help="comma list of fleet sizes (unset: 4,16,64; router workloads: 2)",
    )
    p.add_argument(
        "--qps", type=_floats, default=[2.0, 5.0, 8.0], help="per replica (trace: its speed-up)"
    )
    p.add_argument(
        "--qps-at",
        type=_rates_at,
        default=_rates_at("4=5,8;64=3"),
        help="per-fleet-size rates overriding --qps, e.g. '64=3,7;4=3,7'",
    )
    p.add_argument(
        "--policies",
        default=None,
        help=f"unset: {','.join(DEFAULT_POLICIES)}; router workloads: {','.join(ROUTER_POLICIES)}",
    )
    p.add_argument("--duration", type=float, default=30.0, help="simulated seconds of arrivals")
    p.add_argument("--warmup", type=float, default=10.0, help="first seconds not counted")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--step-model",
        choices=("gpu", "cpu"),
        default=None,
        help="unset: gpu; router workloads: cpu",
    )
    p.add_argument(
        "--step-fit",
        default=None,
        help=f"--step-model cpu's fit (default {CPU_FIT_PATH.name}; router workloads: "
        f"{ROUTER_FIT_PATH.name}, beside this module)",
    )
    p.add_argument(
        "--step-scale",
        type=float,
        default=1.0,
        help="--step-model cpu's step times times this: the cores the serving stack takes "
        "in a real run (benchmarks/sim_validation.py --calibrate measures it)",
    )
    p.add_argument(
        "--kv-blocks",
        type=int,
        default=None,
        help="unset: the step model's GPU (cpu: 512); router workloads: bench router's",
    )
    p.add_argument(
        "--block-size", type=int, default=None, help="unset: 16; router workloads: bench router's"
    )
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="unset: 256; router workloads: bench router's",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="unset: 8192; router workloads: what bench router's engines resolve (2048)",
    )
    p.add_argument(
        "--prefix-cache-protected-fraction",
        type=_declared_float(EngineConfig, "prefix_cache_protected_fraction"),
        default=PROTECTED_FRACTION,
        help="each replica's engine prefix_cache_protected_fraction (0: plain LRU eviction)",
    )
    p.add_argument(
        "--stats-period",
        type=float,
        default=None,
        help="routing_stats_period_s (unset: 2; router workloads: bench router's)",
    )
    p.add_argument(
        "--routing",
        type=_routing_fields,
        default={},
        help="RoutingConfig fields as JSON for most_free_blocks and load_only_stale, e.g. "
        "'{\"affinity_owner_weight\": 4}' (the other policies read none; the router "
        "workloads take bench router's flags instead)",
    )
    p.add_argument(
        "--router-args",
        default="",
        help="router workloads and --fit-for router: bench router's own flags, as one "
        "string (e.g. '--seed 1 --skew-requests 96')",
    )
    p.add_argument(
        "--idle-pause",
        type=float,
        default=IDLE_PAUSE_S,
        help="router workloads: bench router's wait for an idle fleet before the measured "
        "requests (s)",
    )
    p.add_argument("--system-tokens", type=int, default=6000)
    p.add_argument("--query-tokens", type=int, default=1200)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--prefix-fraction", type=float, default=LLMD_PREFIX_FRACTION)
    p.add_argument("--trace", default=None, help="Mooncake JSONL for --workloads trace")
    p.add_argument("--slo-ttft", type=float, default=2.0)
    p.add_argument("--slo-itl", type=float, default=0.05)
    p.add_argument("--profile", action="store_true", help="profile the largest run once more")
    p.add_argument("--out", default="benchmarks/results/simulate")
    p.add_argument(
        "--autoscale",
        default=None,
        metavar="MIN:MAX",
        help="the autoscaler in the loop from MIN to MAX replicas (the first --qps, per "
        "replica of MAX; --workloads ignored: sinusoidal); writes --out",
    )
    p.add_argument("--period", type=float, default=None, help="sinusoidal period (s)")
    p.add_argument("--startup", type=float, default=30.0, help="a new replica's start-up (s)")
    p.add_argument("--scale-out-after", type=float, default=10.0)
    p.add_argument("--scale-in-after", type=float, default=60.0)
    p.add_argument("--look-back", type=float, default=15.0)
    p.add_argument(
        "--target-compute-utilization",
        type=_declared_float(AutoscalingPolicyConfig, "target_compute_utilization"),
        default=AutoscalingPolicyConfig.target_compute_utilization,
        help="the autoscaler's compute-use target, in (0, 1] (1: off, the policy before it)",
    )
    p.add_argument("--event-window", type=float, default=60.0, help="s around a scale event")
    p.add_argument("--fit", action="store_true", help="fit the CPU step model instead")
    p.add_argument("--fit-model", default="models/tiny", help="not with --fit-for router")
    p.add_argument(
        "--fit-for",
        choices=("engine", "router"),
        default="engine",
        help="router: the engine as bench router's replicas run it (its --router-args), "
        "beside --fit-contenders more",
    )
    p.add_argument(
        "--fit-contenders",
        type=int,
        default=None,
        help="engines stepping beside the timed one, each in its own process (default: 0; "
        "--fit-for router: 1, bench router's other replica)",
    )
    p.add_argument("--fit-repeats", type=int, default=2)
    p.add_argument(
        "--fit-json", default=None, help=f"default {CPU_FIT_PATH.name} (or the router one)"
    )
    p.add_argument(
        "--fit-out",
        default=None,
        help="report stem (benchmarks/results/sim_step_fit, or sim_step_fit_router)",
    )
