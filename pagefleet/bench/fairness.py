"""`pagefleet bench fairness`: two tenants on a saturated fleet, with and without fair queuing.

A light tenant sends Poisson arrivals at a rate r, a heavy one at `--ratio` x r, and the
heavy one also sends urgent requests (`priority: -1`) at r; every request is a distinct
random prompt of `--prompt-tokens` ids and `--max-tokens` streamed tokens (ignore_eos),
its tenant in the `x-tenant` header. r is set from the fleet's own rate, measured first
(a closed loop of twice its batch slots): together the streams offer `--load` times it.

The fleet (`--config`, one fixed replica count, `engine.scheduling_policy: priority`) is
served twice by this command, one after the other:

- fairness off: the light tenant **alone**, then all three streams (**fcfs**: the
  engines queue what comes, first come, first served, the urgent ones by priority);
- fairness on (`fairness.enabled`, tenant from `x-tenant`): all three streams (**fair**).

Reported per run: TTFT p50/p99 of each stream (from the send, as the client sees it),
the requests that finished against those sent, and refusals; the light tenant's p99
against its p99 alone. Each phase's streams run `--duration` seconds; requests still
unanswered `--drain` seconds after the last send count as failed.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from pagefleet.bench.checkpoint import ensure_model
from pagefleet.bench.client import TEMPERATURE, closed_loop, read_stream
from pagefleet.bench.launcher import exit_on_signals, pagefleet_serve, served_config
from pagefleet.bench.machine import LoadMonitor, machine_description
from pagefleet.bench.metrics import wait_idle
from pagefleet.bench.report import markdown_table, pyplot, save_png, write_report
from pagefleet.bench.stats import percentile
from pagefleet.bench.workloads import BenchRequest, distinct_prompts, poisson_times

HEADER = "x-tenant"
STREAMS = ("light", "heavy", "urgent")  # urgent: the heavy tenant's priority -1 requests
# Distinct prompts (no two share a prefix block), used in turn: the tiny model's
# vocabulary has fewer first tokens than a run sends requests.
PROMPTS = 512


@dataclass(frozen=True)
class Sent:
    stream: str
    ttft: float  # NaN when it failed
    ok: bool
    status: int


@dataclass(frozen=True)
class Arrival:
    at: float
    stream: str
    prompt: tuple[int, ...]


def arrivals(
    light_qps: float, ratio: float, duration_s: float, prompts: list[tuple[int, ...]], seed: int
) -> list[Arrival]:
    """The three Poisson streams merged in time order, each request its own prompt."""
    rng = random.Random(seed)
    streams = (("light", light_qps), ("heavy", ratio * light_qps), ("urgent", light_qps))
    out = sorted((t, s) for s, qps in streams for t in poisson_times(qps, duration_s, rng))
    return [Arrival(t, s, prompts[i % len(prompts)]) for i, (t, s) in enumerate(out)]


async def send(
    client: httpx.AsyncClient, url: str, model: str, a: Arrival, max_tokens: int
) -> Sent:
    body: dict[str, Any] = {
        "model": model,
        "prompt": list(a.prompt),
        "max_tokens": max_tokens,
        "temperature": TEMPERATURE,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "priority": -1 if a.stream == "urgent" else 0,
    }
    tenant = "light" if a.stream == "light" else "heavy"
    start = time.perf_counter()
    try:
        async with client.stream(
            "POST", f"{url}/v1/completions", json=body, headers={HEADER: tenant}
        ) as r:
            if r.status_code != 200:
                await r.aread()
                return Sent(a.stream, math.nan, False, r.status_code)
            s = await read_stream(r, start)
    except httpx.HTTPError:
        return Sent(a.stream, math.nan, False, 0)
    ok = not s.error and s.tokens == max_tokens
    return Sent(a.stream, s.ttft if ok else math.nan, ok, 200)


async def open_loop(
    url: str, model: str, plan: list[Arrival], max_tokens: int, drain_s: float
) -> list[Sent]:
    """Each request sent at its time, whatever the ones before are doing."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(drain_s), limits=limits) as client:
        t0 = time.perf_counter()

        async def one(a: Arrival) -> Sent:
            await asyncio.sleep(max(0.0, t0 + a.at - time.perf_counter()))
            return await send(client, url, model, a, max_tokens)

        return list(await asyncio.gather(*(one(a) for a in plan)))


@dataclass(frozen=True)
class RunResult:
    name: str
    sent: list[Sent]

    def of(self, stream: str) -> list[Sent]:
        return [s for s in self.sent if s.stream == stream]

    def p(self, stream: str, q: float) -> float:
        return percentile([s.ttft for s in self.of(stream) if s.ok], q)

    def done(self, stream: str) -> str:
        mine = self.of(stream)
        return f"{sum(s.ok for s in mine)}/{len(mine)}" if mine else "-"

    @property
    def refused(self) -> int:
        return sum(s.status == 429 for s in self.sent)


def fleet_rate(
    url: str, model: str, prompts: list[tuple[int, ...]], users: int, max_tokens: int
) -> float:
    """Requests per second the fleet finishes with `users` sending back to back."""
    per_user = [
        [BenchRequest(prompts[(u * 3 + i) % len(prompts)], max_tokens) for i in range(3)]
        for u in range(users)
    ]
    results, wall = asyncio.run(closed_loop(url, model, per_user, [0.0] * users))
    return sum(r.ok for r in results) / wall


def config_for(args: argparse.Namespace, fair: bool) -> dict[str, Any]:
    _, data = served_config(args.config)
    data["autoscaling"] = None
    data["replicas"] = args.replicas
    data["engine"] = {**data["engine"], "max_num_seqs": args.max_num_seqs}
    data["engine"]["scheduling_policy"] = "priority"
    data["fairness"] = {
        **data.get("fairness", {}),
        "enabled": fair,
        "tenant_header": HEADER,
        "max_queued_per_tenant": args.max_queued_per_tenant,
    }
    return data


def _f(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.2f}"


HEADER_ROW = (
    "run",
    "light TTFT p50 (s)",
    "light TTFT p99 (s)",
    "heavy TTFT p50 (s)",
    "heavy TTFT p99 (s)",
    "urgent TTFT p50 (s)",
    "urgent TTFT p99 (s)",
    "light done",
    "heavy done",
    "urgent done",
    "429s",
)


def row(r: RunResult) -> list[object]:
    cells: list[object] = [r.name]
    for stream in STREAMS:
        cells += [_f(r.p(stream, 0.5)), _f(r.p(stream, 0.99))]
    return [*cells, *(r.done(s) for s in STREAMS), r.refused]


def plot(runs: list[RunResult], out: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / (2 * len(STREAMS))
    series = [(s, q) for s in STREAMS for q in (0.5, 0.99)]
    for i, (stream, q) in enumerate(series):
        xs = [j + (i - len(series) / 2 + 0.5) * width for j in range(len(runs))]
        ax.bar(xs, [r.p(stream, q) for r in runs], width, label=f"{stream} p{round(q * 100)}")
    ax.set_xticks(range(len(runs)), [r.name for r in runs])
    ax.set_yscale("log")
    ax.set_ylabel("TTFT (s)")
    ax.legend(fontsize=7, ncol=3)
    save_png(fig, out, 100)


def phase(
    url: str, model: str, plan: list[Arrival], args: argparse.Namespace, name: str
) -> RunResult:
    print(f"  {name}: {len(plan)} requests over {args.duration:g} s", flush=True)
    result = RunResult(name, asyncio.run(open_loop(url, model, plan, args.max_tokens, args.drain)))
    print("  " + " | ".join(str(c) for c in row(result)), flush=True)
    wait_idle(url)
    return result


def run(args: argparse.Namespace) -> int:
    exit_on_signals()
    from pagefleet.bench.serve import vocabulary

    workdir = Path(tempfile.mkdtemp(prefix="pagefleet-fairness-"))
    config = served_config(args.config)[0]
    model_dir = config.model
    if config.make_model is not None:
        ensure_model(model_dir, config.make_model)
    vocab, special = vocabulary(model_dir)
    prompts = distinct_prompts(PROMPTS, args.prompt_tokens, vocab, args.seed, special)
    runs: list[RunResult] = []
    with LoadMonitor() as monitor:
        with pagefleet_serve(config_for(args, False), workdir, "fcfs", args.replicas) as s:
            slots = args.max_num_seqs * args.replicas
            rate = fleet_rate(s.url, s.model, prompts, 2 * slots, args.max_tokens)
            wait_idle(s.url)
            light_qps = args.load * rate / (args.ratio + 2)
            plan = arrivals(light_qps, args.ratio, args.duration, prompts, args.seed)
            print(f"fleet rate {rate:.2f} req/s; light {light_qps:.2f} req/s", flush=True)
            alone = [a for a in plan if a.stream == "light"]
            runs.append(phase(s.url, s.model, alone, args, "alone"))
            runs.append(phase(s.url, s.model, plan, args, "fcfs"))
        with pagefleet_serve(config_for(args, True), workdir, "fair", args.replicas) as s:
            runs.append(phase(s.url, s.model, plan, args, "fair"))
    plot(runs, args.out)
    body = report(runs, args, rate, light_qps, monitor.summary(), model_dir)
    print(f"wrote {write_report(args.out, 'Fairness under saturation', body)}")
    return 0


def report(
    runs: list[RunResult],
    args: argparse.Namespace,
    rate: float,
    light_qps: float,
    load: str,
    model_dir: str,
) -> str:
    by = {r.name: r for r in runs}
    alone = by["alone"].p("light", 0.99)
    lines = [
        machine_description(),
        "",
        f"Fleet: `{args.config}` ({model_dir}) at {args.replicas} fixed replica(s), "
        f"max_num_seqs {args.max_num_seqs}, scheduling_policy priority. Its rate, measured "
        f"first: {rate:.2f} req/s. Light tenant {light_qps:.2f} req/s, heavy {args.ratio:g}x "
        f"that, urgent (heavy's, priority -1) {light_qps:.2f} req/s: {args.load:g}x the "
        f"fleet's rate together. {args.prompt_tokens}-token prompts, {args.max_tokens} "
        f"tokens out, {args.duration:g} s per phase.",
        "",
        markdown_table(HEADER_ROW, [row(r) for r in runs]),
        "",
        f"Light tenant's p99 TTFT against alone: fair {by['fair'].p('light', 0.99) / alone:.2f}x, "
        f"first come first served {by['fcfs'].p('light', 0.99) / alone:.2f}x.",
        "",
        f"{load} Timings on a shared, loaded machine are noisy: compare the runs of one "
        "report, not figures across reports.",
    ]
    return "\n".join(lines)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fairness", help="two tenants on a saturated fleet: fair queuing vs FCFS")
    p.add_argument(
        "--config",
        default="configs/fairness-bench.yaml",
        help="the fleet (its replicas, max_num_seqs, priority and fairness are set here)",
    )
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--ratio", type=float, default=10.0, help="heavy's rate over light's")
    p.add_argument("--load", type=float, default=1.5, help="offered load over the fleet's rate")
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--drain", type=float, default=600.0)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--max-queued-per-tenant", type=int, default=100_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/fairness")
