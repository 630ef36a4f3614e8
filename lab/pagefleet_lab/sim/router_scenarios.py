"""`pagefleet-lab router`'s runs, simulated: `bench simulate --workloads router_skew,router_prefix`.

Issue 22's validation: the same workload at 2 replicas in the simulator and on real
Serve, compared by `sim_validation`. So everything bench router decides is taken from it,
not copied:

- the requests: `router.scenarios` over bench router's own argument parser
  (`router.router_args`; `--router-args` passes its flags, e.g. "--seed 1
  --skew-requests 96"): the same seeded token ids and lengths, the same users, each
  user's requests in the same order (`workloads.deal`), the same ramp
  (`router.user_offsets`) and warm-up requests;
- the phases, as `router.run` sends them to each policy's fleet: the fleet warm-up
  (`router.fleet_warmup_requests`, six users with one request each, all at once), the
  scenario's warm-up requests (closed loop over the ramp), a pause (bench router's
  `wait_idle`: scrapes every 0.5 s until nothing runs, then waits 1.5 s: `--idle-pause`,
  2 s), then the measured requests (closed loop over the ramp again). Closed loop as in
  `client.closed_loop`: a user sends its next request when its previous one's stream has
  ended, with no think time (`sim_workloads.ClosedLoop`);
- what is measured, as bench router measures it: the measured requests only; TTFT from
  the send; output tokens/s over the time from the phase's start (the client's clock
  starts before the first user's offset, which is 0) to the last answer; preemptions
  and prefix-cache hits (tokens) from the phase's start; requests per replica;
- the fleet: bench router's 2 replicas (`--replicas`), each engine as bench router
  configures it: `--num-kv-blocks`, `--block-size`, `--max-num-seqs`, `--max-model-len`
  and the step token budget the engine resolves (none set, chunked prefill on: the
  engine's default, 2048), reports every `--routing-stats-period-s`; the step time
  from the fit to its replicas (`sim_step_model.ROUTER_FIT_PATH`, `--fit --fit-for
  router`), unless `--step-model`/`--step-fit` say otherwise;
- the policies under bench router's names: most_free_blocks, power_of_two and
  round_robin are the same code (`sim_policies`); prefix_cache_affinity, Ray's router,
  is stood in for by `approx_prefix_ray`, a re-implementation over block hashes with
  Ray's defaults (`STAND_INS`): reports name it so.

What is not the same, knowingly:

- each scenario runs on a fresh fleet; bench router runs its scenarios one after the
  other on one fleet per policy. By the prefix scenario every skew block is evictable
  and its warm-up's prompts (24 x ~600 tokens, against 2 x 2,048 tokens of KV) replace
  them; what carries over is the routers' memory of the skew's prompts;
- there is no client, proxy or ingress: a request reaches its replica's engine when
  its user sends it, and the first token reaches the user when the step that made it
  ends; the serving stack's CPU on the shared cores is outside the step fit too
  (`measure_engine_steps`). Both make the simulator optimistic: by ~1.3x on this
  machine (BENCHMARKS.md, "Validation against reality"), which `--step-scale`, measured
  on one scenario by `benchmarks/sim_validation.py --calibrate`, puts back;
- power_of_two reads the replicas' unfinished requests live, Serve's router its
  queue-length cache or a probe.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pagefleet.bench.client import RequestResult
from pagefleet.bench.machine import LoadMonitor, machine_description
from pagefleet.bench.workloads import BenchRequest, deal
from pagefleet_lab.bench.router import fleet_warmup_requests, router_args, scenarios, user_offsets
from pagefleet_lab.bench.router_report import Outcome, Scenario, fmt, report
from pagefleet_lab.sim.fleet import Fleet, ReplicaShape, RunResult
from pagefleet_lab.sim.policies import POLICIES, policy_factory
from pagefleet_lab.sim.pool import run_all
from pagefleet_lab.sim.step_model import StepModel
from pagefleet_lab.sim.workloads import ClosedLoop, Phase, SimRequest

ROUTER_WORKLOADS = {"router_skew": "skew", "router_prefix": "prefix"}
DEFAULT_POLICIES = ("most_free_blocks", "power_of_two", "round_robin", "approx_prefix_ray")
# A simulated policy standing in for one of bench router's that it is not the code of.
STAND_INS = {"approx_prefix_ray": "prefix_cache_affinity", "approx_prefix": "prefix_cache_affinity"}
IDLE_PAUSE_S = 2.0  # bench router's wait_idle between a warm-up and the measured requests
GUARD_S = 36_000.0  # simulated seconds after which a run is cut off (it never should be)


def real_policy(policy: str) -> str:
    """bench router's name for what the simulated `policy` is (or stands in for)."""
    return STAND_INS.get(policy, policy)


def vocab_size(rargs: argparse.Namespace) -> int:
    """The vocabulary bench router draws token ids from: its checkpoint's (`--model`),
    else its `--preset`'s, which is what bench router would write there."""
    config = Path(rargs.model) / "config.json"
    if config.is_file():
        return int(json.loads(config.read_text())["vocab_size"])
    from pagefleet.cluster.model_presets import PRESETS

    return PRESETS[rargs.preset].vocab_size


def replica_shape(rargs: argparse.Namespace) -> ReplicaShape:
    """One replica's engine limits as bench router configures it (`router.fleet_config`):
    max_num_batched_tokens is not set there, so the engine's default with chunked
    prefill (`model_runner.resolve_capacity`)."""
    from pagefleet.engine.model_runner import _DEFAULT_BATCHED_TOKENS

    return ReplicaShape(
        rargs.num_kv_blocks,
        rargs.block_size,
        rargs.max_num_seqs,
        _DEFAULT_BATCHED_TOKENS,
        rargs.max_model_len,
    )


def sim_requests(reqs: Sequence[BenchRequest], first_id: int) -> list[SimRequest]:
    """bench router's requests as the simulator's, token for token (ids from `first_id`)."""
    out = []
    for i, r in enumerate(reqs):
        if isinstance(r.prompt, str):
            raise ValueError("a router workload's prompts are token ids")
        out.append(SimRequest(first_id + i, 0.0, (), 0, 0, r.max_tokens, r.kind, tuple(r.prompt)))
    return out


def closed_loop(
    scenario: Scenario,
    rargs: argparse.Namespace,
    vocab: int,
    idle_pause_s: float = IDLE_PAUSE_S,
) -> ClosedLoop:
    """The phases bench router sends one policy's fleet for `scenario` (module docstring):
    fleet warm-up, the scenario's warm-up, the pause, the measured requests."""
    fleet_warmup = sim_requests(fleet_warmup_requests(vocab, rargs.seed), 0)
    warmup = sim_requests(scenario.warmup, len(fleet_warmup))
    measured = sim_requests(scenario.requests, len(fleet_warmup) + len(warmup))
    offsets = tuple(user_offsets(scenario.users, rargs.ramp_s))

    def users(reqs: list[SimRequest]) -> tuple[tuple[SimRequest, ...], ...]:
        return tuple(tuple(u) for u in deal(reqs, scenario.users))

    return ClosedLoop(
        [
            Phase(tuple((r,) for r in fleet_warmup), (0.0,) * len(fleet_warmup)),
            Phase(users(warmup), offsets),
            # bench router waits for an idle fleet before the measured requests, warm-up
            # or none.
            Phase(users(measured), offsets, measured=True, pause_before_s=idle_pause_s),
        ]
    )


def simulate(
    scenario: Scenario,
    policy: str,
    rargs: argparse.Namespace,
    vocab: int,
    model: StepModel,
    replicas: int = 2,
    shape: ReplicaShape | None = None,
    stats_period_s: float | None = None,
    seed: int = 0,
    idle_pause_s: float = IDLE_PAUSE_S,
    routing: Mapping[str, Any] | None = None,
) -> tuple[RunResult, Fleet, ClosedLoop]:
    """One policy on one scenario, on a fresh fleet; `seed` is the policies' own (their
    random choices and tie breaks), the requests' is bench router's `--seed`; `routing`:
    RoutingConfig fields (`policy_factory`)."""
    fleet = Fleet(
        replicas,
        shape or replica_shape(rargs),
        model,
        rargs.routing_stats_period_s if stats_period_s is None else stats_period_s,
    )
    loop = closed_loop(scenario, rargs, vocab, idle_pause_s)
    result = fleet.run(loop, policy_factory(policy, seed, routing), GUARD_S, max_drain_s=0.0)
    return result, fleet, loop


def outcome_checked(job: tuple[Any, ...]) -> tuple[Outcome, float]:
    """`simulate(*job)` as its `Outcome` and wall time, every pool's block accounting
    checked after."""
    result, fleet, loop = simulate(*job)
    fleet.check_accounting()
    return outcome(job[0], job[1], result, loop), result.wall_s


def outcome(scenario: Scenario, policy: str, result: RunResult, loop: ClosedLoop) -> Outcome:
    """The run as bench router's `Outcome` (one `RequestResult` per measured request), so
    that its report, plot and OUT.json are bench router's own. A request cut off by the
    guard is not ok."""
    start = loop.measured_start_s if loop.measured_start_s is not None else 0.0
    kinds = {}
    for phase in loop.phases:
        for user in phase.per_user:
            kinds.update((r.request_id, r.kind) for r in user)
    results = [
        RequestResult(
            ok=done,
            kind=kinds[rid],
            sent_at=arrival - start,
            ttft=ttft,
            e2e=end - arrival,
            tokens=tokens,
            error="" if done else "cut off",
        )
        for rid, arrival, ttft, end, tokens, done in zip(
            result.request_ids,
            result.arrival_s,
            result.ttft_s,
            result.end_s,
            result.output_tokens,
            result.finished,
            strict=True,
        )
    ]
    wall = max(result.end_s, default=start) - start
    return Outcome(
        policy=policy,
        scenario=scenario.name,
        results=results,
        wall_s=wall,
        preemptions=result.preemptions,
        prefix_hits=result.prefix_hits,
        prefix_queries=result.prefix_queries,
        router_hit_tokens=math.nan,  # not simulated: the table shows "-"
        per_replica=sorted(result.routed.values(), reverse=True),
    )


def fit_mismatches(measured: dict[str, object] | None, shape: ReplicaShape) -> list[str]:
    """Where the engine a step fit was measured on differs from the simulated replicas
    (a fit to other blocks or another step budget times other steps)."""
    if not measured:
        return []
    want = {
        "num_kv_blocks": shape.num_blocks,
        "block_size": shape.block_size,
        "max_num_seqs": shape.max_num_seqs,
        "max_num_batched_tokens": shape.max_num_batched_tokens,
        "max_model_len": shape.max_model_len,
    }
    return [
        f"{k} {measured[k]} (simulated: {v})"
        for k, v in want.items()
        if k in measured and measured[k] != v
    ]


def run(
    args: argparse.Namespace,
    workloads: Sequence[str],
    model: StepModel,
    model_label: str,
    measured: dict[str, object] | None = None,
) -> int:
    """The router workloads of `bench simulate` (its `run` resolved the step model;
    `measured`: how its fit was measured, `Fit.engine`)."""
    rargs = router_args(shlex.split(args.router_args))
    vocab = vocab_size(rargs)
    rargs.scenarios = ",".join(ROUTER_WORKLOADS[w] for w in workloads)
    scens = scenarios(rargs, vocab)
    replicas = [int(x) for x in args.replicas.split(",")]
    if len(replicas) != 1:
        raise SystemExit("router workloads: one fleet size (--replicas 2, bench router's)")
    n = replicas[0]
    base = replica_shape(rargs)
    shape = ReplicaShape(
        args.kv_blocks or base.num_blocks,
        args.block_size or base.block_size,
        args.max_num_seqs or base.max_num_seqs,
        args.max_num_batched_tokens or base.max_num_batched_tokens,
        base.max_model_len,
        args.prefix_cache_protected_fraction,
    )
    period = args.stats_period or rargs.routing_stats_period_s
    policies = [p for p in args.policies.split(",") if p]
    for p in policies:
        if p not in POLICIES:
            raise SystemExit(f"unknown policy {p!r}: one of {', '.join(POLICIES)}")
    mismatch = fit_mismatches(measured, shape)
    if mismatch:
        print(f"warning: the step fit was measured on another engine: {'; '.join(mismatch)}")
    outcomes: list[Outcome] = []
    t0 = time.perf_counter()
    jobs = [
        (s, p, rargs, vocab, model, n, shape, period, args.seed, args.idle_pause, args.routing)
        for s in scens
        for p in policies
    ]
    with LoadMonitor() as load:
        for (_, p, *_), (o, wall_s) in zip(jobs, run_all(outcome_checked, jobs), strict=True):
            outcomes.append(o)
            print(
                f"{p} {o.scenario}: {len(o.ok)}/{len(o.results)} ok, {o.tok_s:.1f} tok/s, TTFT "
                f"p50 {o.ttft(0.5):.3f} s p99 {o.ttft(0.99):.3f} s, {o.preemptions:.0f} "
                f"preemptions, prefix hits {fmt(o.hit_rate, '.1%')}, per replica "
                f"{o.per_replica} ({wall_s:.1f} s wall)",
                flush=True,
            )
    stand_ins = [f"`{p}` stands in for `{real_policy(p)}`" for p in policies if p in STAND_INS]
    notes = [
        machine_description(),
        load.summary(),
        "",
        f"**Simulated** (`sim_router`, `sim_fleet`): bench router's requests and phases "
        f"(seed {rargs.seed}; fleet warm-up, {rargs.warmup_per_user} warm-up request(s) per "
        f"user, a {args.idle_pause:g} s pause, the measured requests; users starting over "
        f"{rargs.ramp_s:g} s, closed loop, no think time) on {n} simulated replicas, each "
        f"the engine's real scheduler and block manager: {shape.num_blocks} KV blocks of "
        f"{shape.block_size} tokens, max_num_seqs {shape.max_num_seqs}, "
        f"{shape.max_num_batched_tokens} tokens per step, max_model_len "
        f"{shape.max_model_len}, chunked prefill and prefix caching on; step time from "
        f"**{model_label}**; routing stats every {period:g} s; policies' seed {args.seed}. "
        "Each scenario on a fresh fleet. No client, proxy or ingress: TTFT is from the "
        "send to the end of the step that made the first token. `router expected` is not "
        "simulated."
        + (
            f" Stand-ins: {'; '.join(stand_ins)} (Ray's defaults, over block hashes)."
            if stand_ins
            else ""
        )
        + (
            f" The fit was measured as {measured.get('timed')}, {measured.get('num_threads')} "
            f"thread(s), beside {measured.get('contenders')} contender engine(s), each "
            f"shape's {measured.get('kept')}."
            if measured
            else " The fit does not say how it was measured."
        )
        + (f" **The fit's engine differs**: {'; '.join(mismatch)}." if mismatch else ""),
    ]
    out = argparse.Namespace(
        **{k: v for k, v in vars(rargs).items() if k != "out"},
        out=args.out,
        sim_policies=",".join(policies),
        sim_seed=args.seed,
        step_model=model_label,
        idle_pause=args.idle_pause,
        stand_ins={p: real_policy(p) for p in policies if p in STAND_INS},
    )
    path = report(
        outcomes,
        scens,
        out,
        notes,
        title=f"Routing policies on {n} replicas, simulated (bench router's workloads)",
        source="simulated",
        replicas=n,
    )
    print(path.read_text())
    print(f"wrote {path} ({time.perf_counter() - t0:.0f} s)")
    return 0
