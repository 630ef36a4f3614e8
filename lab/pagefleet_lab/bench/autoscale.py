"""`pagefleet-lab autoscale`: a ramp of load up and down against the KV autoscaler.

Starts `pagefleet serve` with autoscaling (min 1, max `--max-replicas`, one
replica at first) and a small KV pool per replica, then drives a closed-loop
load whose number of users follows a ramp: 1 user, up to `--users` over
`--up-s`, held for `--hold-s`, down to 1 over `--down-s`, then 1 user until
the fleet is back to its minimum (at most `--tail-s`). Each user sends
streamed completions back to back (seeded random prompts and lengths); a
user leaving finishes its request first, so every error is the server's.

Every second it scrapes `/metrics`: `pagefleet:replicas`,
`pagefleet:target_replicas`, `pagefleet:autoscaler_kv_utilization` and
`pagefleet:autoscaler_compute_utilization` (the fleet KV and compute use the policy
acted on) and the replicas' own
`vllm:kv_cache_usage_perc` / running / waiting. Writes a timeline PNG
(replicas and target, KV utilisation, client-side TTFT of every request) and
a markdown table: when the target and the running replicas went up and came
back down, measured from the ramp's start and from its end, and the errors
(there must be none: a scale-in drains its replica).

`--config FILE` serves that pagefleet config instead (its autoscaling bounds and
levels, started at its `min_replicas`); `--scenario saturated` is issue 22's
saturated replica: `configs/local.yaml` from one replica, 32 users at once for
141 s, each sending 216-token prompts for 200 tokens (lock-step waves of full
batches), then 1 user until the fleet is back to one replica; `--scenario burst`
is issue 54's: the same 32 users sending 12 such requests each (384), the run
ending with the last. After the load it reads the start-up timeline of the
replica the scale-out added (`pagefleet:replica_startup_seconds{phase}` and
`pagefleet:replica_start_time_seconds`) and reports each phase, from the
autoscaler's decision (the first scrape whose target is above the minimum) to
the replica's first request, in seconds from the load's start.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import random
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from pagefleet.bench.checkpoint import ensure_model
from pagefleet.bench.client import RequestResult, stream_completion
from pagefleet.bench.launcher import exit_on_signals, pagefleet_serve
from pagefleet.bench.machine import LoadMonitor, machine_description
from pagefleet.bench.metrics import Scrape, scrape
from pagefleet.bench.report import markdown_table, pyplot, save_png, write_report
from pagefleet.bench.stats import percentile
from pagefleet.bench.workloads import BenchRequest, random_tokens, token_range
from pagefleet.cluster.autoscaling import AutoscalingPolicyConfig
from pagefleet.engine.startup import PHASES


def users_at(t: float, users: int, up_s: float, hold_s: float, down_s: float) -> int:
    """The ramp: 1 -> `users` linearly over up_s, held, back to 1 over down_s, then 1."""
    if t < 0:
        return 0
    if t < up_s:
        return 1 + math.floor((users - 1) * t / up_s)
    t -= up_s
    if t < hold_s:
        return users
    t -= hold_s
    if t < down_s:
        return users - math.floor((users - 1) * t / down_s)
    return 1


@dataclass
class Sample:
    t: float
    users: int
    replicas: float | None
    target: float | None
    kv_acted: float | None  # what the policy acted on (look-back averaged by Serve)
    kv_now: float | None  # mean of the replicas' own gauges at this scrape
    reporting: int  # engine replicas with fresh series
    running: float
    waiting: float
    compute_acted: float | None = None  # the replicas' mean compute use it acted on


@dataclass
class Run:
    samples: list[Sample] = field(default_factory=list)
    results: list[RequestResult] = field(default_factory=list)
    ramp_end: float = 0.0  # when users came back to 1 (a burst: when its last request ended)
    wall_s: float = 0.0
    t0_wall: float = 0.0  # the load's start, in Unix time


class UserRequests:
    """Each user's own seeded stream of requests (independent of the timing)."""

    def __init__(self, args: argparse.Namespace, vocab_size: int) -> None:
        self._args, self._vocab = args, vocab_size
        self._rngs: dict[int, random.Random] = {}

    def next(self, user: int) -> BenchRequest:
        rng = self._rngs.setdefault(user, random.Random(self._args.seed * 1_000_003 + user))
        a = self._args
        prompt = random_tokens(rng, rng.randint(*a.prompt_tokens), self._vocab)
        return BenchRequest(prompt, rng.randint(*a.output_tokens))


async def drive(url: str, model: str, args: argparse.Namespace, vocab_size: int) -> Run:
    run = Run()
    reqs = UserRequests(args, vocab_size)
    stop_flags: list[asyncio.Event] = []
    tasks: list[asyncio.Task[None]] = []
    limits = httpx.Limits(max_connections=args.users + 8, max_keepalive_connections=args.users + 8)
    done = asyncio.Event()
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0), limits=limits) as client:
        t0 = time.perf_counter()
        run.t0_wall = time.time()
        quota = args.requests_per_user or math.inf

        async def user(u: int, stop: asyncio.Event) -> None:
            sent = 0
            while not stop.is_set() and sent < quota:
                res = await stream_completion(client, url, model, reqs.next(u), t0)
                run.results.append(res)
                sent += 1

        async def sampler() -> None:
            while not done.is_set():
                t = time.perf_counter() - t0
                try:
                    m = await asyncio.to_thread(scrape, url, 10.0)
                except httpx.HTTPError:
                    await asyncio.sleep(1.0)
                    continue
                usage = m.by("vllm:kv_cache_usage_perc", "replica")
                run.samples.append(
                    Sample(
                        t=t,
                        users=sum(not s.is_set() for s in stop_flags),
                        replicas=m.value("pagefleet:replicas"),
                        target=m.value("pagefleet:target_replicas"),
                        kv_acted=m.value("pagefleet:autoscaler_kv_utilization"),
                        compute_acted=m.value("pagefleet:autoscaler_compute_utilization"),
                        kv_now=sum(usage.values()) / len(usage) if usage else None,
                        reporting=len(m.by("pagefleet:kv_blocks_total", "replica")),
                        running=m.total("vllm:num_requests_running"),
                        waiting=m.total("vllm:num_requests_waiting"),
                    )
                )
                await asyncio.sleep(max(0.0, 1.0 - (time.perf_counter() - t0 - t)))

        sampling = asyncio.create_task(sampler())
        ramp_s = args.up_s + args.hold_s + args.down_s
        last_report = -math.inf
        back_at = 0.0
        while True:
            t = time.perf_counter() - t0
            want = users_at(t, args.users, args.up_s, args.hold_s, args.down_s)
            active = [i for i, s in enumerate(stop_flags) if not s.is_set()]
            for _ in range(want - len(active)):
                stop_flags.append(asyncio.Event())
                tasks.append(asyncio.create_task(user(len(stop_flags) - 1, stop_flags[-1])))
            for i in active[want:]:  # the newest leave first
                stop_flags[i].set()
            back = run.samples and run.samples[-1].target == args.min_replicas
            back = back and run.samples[-1].replicas == args.min_replicas
            if args.requests_per_user and tasks and all(x.done() for x in tasks):
                run.ramp_end = t  # a burst: every user has sent its requests
                break
            if t >= ramp_s and not run.ramp_end:
                run.ramp_end = t
            if t >= ramp_s and back and not back_at:
                back_at = t
            # Keep the one user on for `settle_s` after the fleet is back: the replica
            # that was let go drains meanwhile, and an error there must show.
            if t >= ramp_s and (
                (back_at and t >= back_at + args.settle_s) or t >= ramp_s + args.tail_s
            ):
                break
            if t - last_report >= 10:
                last_report = t
                s = run.samples[-1] if run.samples else None
                errors = sum(not r.ok for r in run.results)
                print(
                    f"[{t:5.0f} s] users {want:2d}, replicas {_num(s and s.replicas)} "
                    f"(target {_num(s and s.target)}), KV acted on {_pct(s and s.kv_acted)}, "
                    f"now {_pct(s and s.kv_now)}, compute acted on "
                    f"{_pct(s and s.compute_acted)}, waiting {_num(s and s.waiting)}; "
                    f"{len(run.results)} requests done, {errors} errors",
                    flush=True,
                )
            await asyncio.sleep(0.25)
        for s in stop_flags:
            s.set()
        await asyncio.gather(*tasks)
        done.set()
        await sampling
        run.wall_s = time.perf_counter() - t0
    return run


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:g}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def first_time(samples: list[Sample], cond: object, after: float = 0.0) -> float | None:
    for s in samples:
        if s.t >= after and cond(s):  # type: ignore[operator]
            return s.t
    return None


def _t(x: float | None) -> str:
    return "never" if x is None else f"{x:.0f} s"


def _after(x: float | None, ref: float | None) -> str:
    return "-" if x is None or ref is None else f"{x - ref:+.0f} s"


def timeline_table(run: Run, args: argparse.Namespace) -> tuple[list[list[str]], list[str]]:
    """(rows of events, summary lines) from the samples."""
    s = run.samples
    peak = max((x.replicas or 0 for x in s), default=0)
    t_target_up = first_time(s, lambda x: (x.target or 0) > args.min_replicas)
    t_up = first_time(s, lambda x: (x.replicas or 0) > args.min_replicas)
    t_full = first_time(s, lambda x: (x.replicas or 0) >= peak) if peak else None
    # What the policy reacts to: utilisation above the target, or more requests waiting
    # per replica than it tolerates.
    tolerated = AutoscalingPolicyConfig().max_waiting_per_replica
    t_high = first_time(
        s,
        lambda x: (
            (x.kv_acted or 0) > args.target_kv_utilization
            or x.waiting > tolerated * max(1, x.replicas or 0)
        ),
    )
    down_start = args.up_s + args.hold_s
    after = max(t_full or 0.0, down_start)
    t_target_in = first_time(s, lambda x: x.target == args.min_replicas, after)
    t_in = first_time(s, lambda x: x.replicas == args.min_replicas, t_target_in or after)
    rows = [
        ["load starts (1 user)", "0 s", "-"],
        [f"users reach {args.users}", _t(args.up_s), "-"],
        [
            f"first pressure: utilisation acted on above {args.target_kv_utilization:g}, "
            "or requests waiting",
            _t(t_high),
            "-",
        ],
        ["target replicas first above min", _t(t_target_up), _after(t_target_up, t_high)],
        ["running replicas first above min", _t(t_up), _after(t_up, t_high)],
        [f"fleet at its peak ({peak:g} replicas)", _t(t_full), _after(t_full, t_high)],
        ["users start to fall", _t(down_start), "-"],
        ["users back to 1", _t(run.ramp_end), "-"],
        ["target back to min", _t(t_target_in), _after(t_target_in, run.ramp_end)],
        ["running replicas back to min", _t(t_in), _after(t_in, run.ramp_end)],
    ]
    ok = [r for r in run.results if r.ok]
    errors = len(run.results) - len(ok)
    summary = [
        f"- requests: {len(run.results)}, **errors: {errors}**"
        + (
            f" ({'; '.join(sorted({r.error for r in run.results if not r.ok})[:3])})"
            if errors
            else ""
        ),
        f"- scale out: a second replica served {_t(t_up)} after the load started"
        + (f", {t_up - t_high:.0f} s after the first pressure" if t_up and t_high else ""),
        f"- scale in: back to {args.min_replicas} at {_t(t_in)}"
        + (f", {t_in - run.ramp_end:+.0f} s from the users' return to 1" if t_in else "")
        + f" (scale_in_after_s {args.scale_in_after_s:g})",
        f"- TTFT p50 / p99: {percentile([r.ttft for r in ok], 0.5):.3f} / "
        f"{percentile([r.ttft for r in ok], 0.99):.3f} s over the run",
    ]
    # What the second replica bought: TTFT at peak users, before and after it served.
    peak_lo, peak_hi = args.up_s, args.up_s + args.hold_s
    if t_full is not None and peak_lo < t_full < peak_hi:
        before = [r.ttft for r in ok if peak_lo <= r.sent_at < t_full]
        after_ = [r.ttft for r in ok if t_full <= r.sent_at < peak_hi]
        summary.append(
            f"- at {args.users} users, TTFT p50 / p99 with {args.min_replicas} replica(s): "
            f"{percentile(before, 0.5):.3f} / {percentile(before, 0.99):.3f} s "
            f"({len(before)} requests); with {peak:g}: {percentile(after_, 0.5):.3f} / "
            f"{percentile(after_, 0.99):.3f} s ({len(after_)} requests)"
        )
    return rows, summary


@dataclass
class ReplicaStartup:
    """A replica's start-up as its `/metrics` report it (`pagefleet:replica_startup_seconds`)."""

    replica: str
    start: float  # its process's creation, Unix time
    phases: dict[str, float]  # seconds, in the order they ran


def replica_startups(m: Scrape) -> list[ReplicaStartup]:
    """Every reporting replica's start-up timeline, oldest first."""
    starts = m.by("pagefleet:replica_start_time_seconds", "replica")
    out = []
    for replica, start in starts.items():
        found = {
            dict(labels)["phase"]: v
            for (name, labels), v in m.samples.items()
            if name == "pagefleet:replica_startup_seconds" and dict(labels)["replica"] == replica
        }
        phases = {p: found[p] for p in PHASES if p in found}
        out.append(ReplicaStartup(replica, start, phases))
    return sorted(out, key=lambda r: r.start)


def new_replica_startup(url: str, after: float, wait_s: float) -> ReplicaStartup | None:
    """The first replica started after `after` (Unix time), once it has served a request
    or `wait_s` has passed (then as far as it got; None if it never reported)."""
    deadline = time.monotonic() + wait_s
    found = None
    while True:
        with contextlib.suppress(httpx.HTTPError):
            new = [r for r in replica_startups(scrape(url)) if r.start > after]
            found = new[0] if new else found
        if (found and "first_request" in found.phases) or time.monotonic() > deadline:
            return found
        time.sleep(1.0)


def startup_section(
    startup: ReplicaStartup | None, run: Run, args: argparse.Namespace
) -> list[str]:
    """The new replica's phases, from the autoscaler's decision to its first request."""
    t_target = first_time(run.samples, lambda x: (x.target or 0) > args.min_replicas)
    if startup is None:
        return ["- no replica started during the load reported a start-up timeline"]
    rows = [["autoscaler's target above min (scrape, 1 s)", "-", _t(t_target)]]
    begin = startup.start - run.t0_wall
    placement = begin - t_target if t_target is not None else None
    rows.append(
        ["placement: Serve starts the replica's process", _secs(placement), f"{begin:.1f} s"]
    )
    at = begin
    for phase, seconds in startup.phases.items():
        at += seconds
        rows.append([phase, f"{seconds:.2f} s", f"{at:.1f} s"])
    served = at if "first_request" in startup.phases else None
    return [
        f"Start-up of the replica the scale-out added ({startup.replica}), phase by phase "
        "(`pagefleet:replica_startup_seconds`), times from the load's start:",
        "",
        markdown_table(["phase", "took", "ended at"], rows),
        "",
        f"- **the second replica served its first request {_t(served)} after the load "
        f"started** (the load ended at {run.ramp_end:.0f} s)",
    ]


def _secs(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f} s"


def _plot(run: Run, args: argparse.Namespace, out: str) -> None:
    plt = pyplot()
    s = run.samples
    t = [x.t for x in s]
    fig, ax = plt.subplots(3, 1, figsize=(12, 9), sharex=True)
    ax[0].step(t, [x.replicas for x in s], where="post", label="replicas (running)", lw=2)
    ax[0].step(t, [x.target for x in s], where="post", label="target replicas", ls="--")
    ax[0].set_ylabel("replicas")
    ax[0].set_ylim(0, args.max_replicas + 0.5)
    users = ax[0].twinx()
    users.plot(t, [x.users for x in s], color="tab:gray", alpha=0.6, label="users")
    users.set_ylabel("users", color="tab:gray")
    ax[0].legend(loc="upper left", fontsize=8)
    ax[0].set_title("Autoscaling under a ramp of users")

    ax[1].plot(t, [x.kv_acted for x in s], label="utilisation the policy acted on", lw=2)
    ax[1].plot(
        t,
        [x.kv_now for x in s],
        label="mean of replicas' vllm:kv_cache_usage_perc (instant)",
        alpha=0.4,
        lw=0.8,
    )
    ax[1].plot(
        t, [x.compute_acted for x in s], label="compute use the policy acted on", ls="--", lw=1.5
    )
    ax[1].axhline(args.target_kv_utilization, color="tab:red", ls=":", label="target (scale out)")
    ax[1].axhline(args.scale_in_kv_utilization, color="tab:green", ls=":", label="scale-in band")
    ax[1].set_ylabel("KV (and compute) use")
    ax[1].set_ylim(0, 1.05)
    ax[1].legend(loc="upper left", fontsize=8)

    ok = [r for r in run.results if r.ok]
    ax[2].scatter([r.sent_at for r in ok], [r.ttft for r in ok], s=6, alpha=0.4, label="TTFT")
    # A rolling p50 over 10 s windows of send time.
    if ok:
        end = max(r.sent_at for r in ok)
        mids, p50 = [], []
        for start in range(0, int(end) + 1, 5):
            w = [r.ttft for r in ok if start <= r.sent_at < start + 10]
            if w:
                mids.append(start + 5)
                p50.append(percentile(w, 0.5))
        ax[2].plot(mids, p50, color="tab:orange", lw=2, label="p50 over 10 s")
    bad = [r for r in run.results if not r.ok]
    if bad:
        ax[2].scatter(
            [r.sent_at for r in bad], [1.0] * len(bad), color="red", marker="x", label="errors"
        )
    ax[2].set_yscale("log")
    ax[2].set_ylabel("TTFT (s)")
    ax[2].set_xlabel("time since the load started (s); requests at their send time")
    ax[2].legend(loc="upper left", fontsize=8)
    for a in ax:
        a.grid(alpha=0.3)
        a.axvspan(args.up_s, args.up_s + args.hold_s, color="tab:gray", alpha=0.08)
    save_png(fig, out, 100)


def fleet_config(args: argparse.Namespace, model: str) -> dict:
    return {
        "model": model,
        "served_model_name": Path(model).name,
        "replica_resources": {"num_cpus": 0.5},
        "routing": "most_free_blocks",
        "drain_timeout_s": 60,
        "autoscaling": {
            "min_replicas": args.min_replicas,
            "max_replicas": args.max_replicas,
            "initial_replicas": args.min_replicas,
            "target_kv_utilization": args.target_kv_utilization,
            "scale_in_kv_utilization": args.scale_in_kv_utilization,
            "scale_out_after_s": args.scale_out_after_s,
            "scale_in_after_s": args.scale_in_after_s,
            "look_back_period_s": args.look_back_period_s,
            "metrics_interval_s": args.metrics_interval_s,
        },
        "engine": {
            "dtype": args.dtype,
            "block_size": args.block_size,
            "num_kv_blocks": args.num_kv_blocks,
            "max_num_seqs": args.max_num_seqs,
            "max_model_len": args.max_model_len,
            "num_threads": 1,
        },
    }


# `--scenario NAME`: the load and config it stands for (flags left at their defaults only).
SCENARIOS: dict[str, dict[str, object]] = {
    # Issue 54's burst: does the second replica serve before the burst is over?
    "burst": {
        "config": "configs/local.yaml",
        "users": 32,
        "up_s": 0.0,
        "hold_s": 600.0,
        "down_s": 0.0,
        "prompt_tokens": [216, 216],
        "output_tokens": [200, 200],
        "requests_per_user": 12,
    },
    "saturated": {
        "config": "configs/local.yaml",
        "users": 32,
        "up_s": 0.0,
        "hold_s": 141.0,
        "down_s": 0.0,
        "prompt_tokens": [216, 216],
        "output_tokens": [200, 200],
    },
}


def apply_scenario(args: argparse.Namespace) -> None:
    """Fill the flags a `--scenario` sets where the command line left their defaults."""
    parser: argparse.ArgumentParser = args.autoscale_parser
    types = {a.dest: a.type for a in parser._actions}
    for key, value in SCENARIOS.get(args.scenario or "", {}).items():
        default = parser.get_default(key)
        if isinstance(default, str) and types.get(key) is not None:
            default = types[key](default)  # as argparse converts a string default
        if getattr(args, key) == default:
            setattr(args, key, value)


def config_fleet(args: argparse.Namespace) -> tuple[dict, str, int]:
    """(`--config`'s serving dict started at its min_replicas, its model, vocabulary size);
    its autoscaling settings replace the fleet flags the report reads."""
    from pagefleet.bench.launcher import served_config

    config, data = served_config(args.config)
    if config.autoscaling is None:
        raise SystemExit(f"{args.config}: no autoscaling section to measure")
    model, vocab = ensure_model(config.model, config.make_model or args.preset)
    a = data["autoscaling"]
    a["initial_replicas"] = a["min_replicas"]
    for key in (
        "min_replicas",
        "max_replicas",
        "target_kv_utilization",
        "scale_in_kv_utilization",
        "scale_in_after_s",
    ):
        setattr(args, key, a[key])
    data.pop("host", None)
    data.pop("port", None)
    return {**data, "model": model}, model, vocab


def run(args: argparse.Namespace) -> int:
    exit_on_signals()
    apply_scenario(args)
    if args.config:
        cfg, model, vocab = config_fleet(args)
    else:
        model, vocab = ensure_model(args.model, args.preset)
        cfg = fleet_config(args, model)
    machine = machine_description()
    print(machine, flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="pagefleet-bench-autoscale-"))
    t_start = time.monotonic()
    try:
        with (
            LoadMonitor() as load,
            pagefleet_serve(cfg, workdir, "autoscale", replicas=args.min_replicas) as fleet,
        ):
            # The policy publishes its first status a few seconds after deploy.
            deadline = time.monotonic() + 120
            while scrape(fleet.url).value("pagefleet:target_replicas") is None:
                if time.monotonic() > deadline:
                    raise RuntimeError("the autoscaler published no status in 120 s")
                time.sleep(1.0)
            print(
                f"[{time.monotonic() - t_start:4.0f} s since start] serving; ramp begins",
                flush=True,
            )
            result = asyncio.run(drive(fleet.url, fleet.model, args, vocab))
            startup = new_replica_startup(fleet.url, result.t0_wall, args.startup_wait_s)
        rows, summary = timeline_table(result, args)
        a = cfg["autoscaling"]
        e = cfg["engine"]
        body = "\n".join(
            [
                machine,
                load.summary(),
                "",
                f"Fleet: `pagefleet serve`, `{Path(model).name}` ({args.dtype}), autoscaling "
                f"{a['min_replicas']}..{a['max_replicas']} replicas from 1, each "
                f"{e['num_kv_blocks']} KV blocks of {e['block_size']} tokens, max_num_seqs "
                f"{e['max_num_seqs']}, {e['num_threads']} engine thread(s); {cfg['routing']} "
                "routing"
                + (f" (config `{args.config}`)" if args.config else "")
                + ". Autoscaling: "
                + ", ".join(
                    f"{k} {v}"
                    for k, v in a.items()
                    if k not in ("min_replicas", "max_replicas", "initial_replicas")
                    and v is not None
                )
                + ".",
                "",
                f"Load: closed-loop users, each sending streamed completions back to back (prompt "
                f"{args.prompt_tokens[0]}-{args.prompt_tokens[1]}, output "
                f"{args.output_tokens[0]}-{args.output_tokens[1]} tokens, random tokens, seed "
                f"{args.seed}); users 1 -> {args.users} over {args.up_s:g} s, held "
                f"{args.hold_s:g} s, -> 1 over {args.down_s:g} s, then 1 user until the fleet is "
                f"back to {args.min_replicas} replica(s) and {args.settle_s:g} s more (at most "
                f"{args.tail_s:g} s). /metrics sampled every second.",
                "",
                markdown_table(["event", "at", "after its trigger"], rows),
                "",
                '(Times from the start of the load; "after its trigger": from the first '
                "pressure for scaling out, from the start of the low spell for scaling in. "
                "Replica counts are the policy's view, as `pagefleet:replicas` exports it; "
                "waiting is the replicas' instant `vllm:num_requests_waiting`.)",
                "",
                *summary,
                "",
                *startup_section(startup, result, args),
            ]
        )
        _plot(result, args, args.out)
        report = write_report(args.out, "Autoscaling timeline", body)
        print(report.read_text())
        print(f"took {time.monotonic() - t_start:.0f} s")
        return 1 if any(not r.ok for r in result.results) else 0
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "autoscale",
        help="a ramp of users up and down against the KV autoscaler: timeline PNG",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--model", default="models/tiny", help="written with --preset if missing")
    p.add_argument("--preset", default="tiny", choices=["tiny", "smollm-135m"])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--config", help="serve this pagefleet config (from its min_replicas) instead of --model"
    )
    p.add_argument(
        "--scenario",
        choices=sorted(SCENARIOS),
        help="saturated: configs/local.yaml, 32 users at once for 141 s, 216-token prompts "
        "for 200 tokens; burst: the same users sending 12 requests each (384), with the new "
        "replica's start-up timeline (flags given explicitly still win)",
    )
    g = p.add_argument_group("load ramp")
    g.add_argument("--users", type=int, default=12, help="users at the peak")
    g.add_argument("--up-s", type=float, default=60.0)
    g.add_argument("--hold-s", type=float, default=90.0)
    g.add_argument("--down-s", type=float, default=60.0)
    g.add_argument("--tail-s", type=float, default=180.0, help="at most this long at 1 user after")
    g.add_argument(
        "--settle-s", type=float, default=20.0, help="1 user on this long after scaling in"
    )
    g.add_argument(
        "--requests-per-user",
        type=int,
        default=0,
        help="a burst: each user sends this many requests, and the run ends with the last "
        "(0: the ramp decides)",
    )
    g.add_argument("--prompt-tokens", type=token_range, default="32-128", help="LO-HI")
    g.add_argument("--output-tokens", type=token_range, default="64-192", help="LO-HI")
    g = p.add_argument_group("fleet")
    g.add_argument("--min-replicas", type=int, default=1)
    g.add_argument("--max-replicas", type=int, default=2)
    g.add_argument("--num-kv-blocks", type=int, default=64, help="per replica: a small pool")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-model-len", type=int, default=1024)
    g.add_argument("--target-kv-utilization", type=float, default=0.75)
    g.add_argument("--scale-in-kv-utilization", type=float, default=0.4)
    g.add_argument("--scale-out-after-s", type=float, default=10.0)
    g.add_argument("--scale-in-after-s", type=float, default=30.0)
    g.add_argument("--look-back-period-s", type=float, default=10.0)
    g.add_argument("--metrics-interval-s", type=float, default=1.0)
    p.add_argument(
        "--startup-wait-s",
        type=float,
        default=120.0,
        help="after the load, wait this long at most for a replica started during it to "
        "report its start-up timeline",
    )
    p.add_argument("--out", default="benchmarks/results/autoscale", help="writes OUT.md, OUT.png")
    p.set_defaults(autoscale_parser=p)
