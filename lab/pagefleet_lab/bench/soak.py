"""`pagefleet-lab soak`: a long mixed load with cancels and disconnects, watching for leaks.

It serves a config itself (`pagefleet serve` in a subprocess, on a free port in
8600-8699), then for `--minutes` keeps `--users` clients busy at the knee of
the throughput curve: completions and chat completions, streamed and not, short
and long, some with n=2 (copy-on-write forks) and chat system prompts shared
between users (prefix-cache hits), from a fixed seed. Some clients close a
stream midway (cancel) or leave before their first token (disconnect), as real
clients do; the server must free what those requests held.

Every `--sample-s` it records the RSS of every process of the server (the
`pagefleet serve` process and all its descendants, grouped by role from their
command lines), the requests finished in the window by outcome and their
latency percentiles, and the replicas' KV blocks from `/metrics`, one line each.

At the end it stops the load, waits for every replica to be idle, and reads
each replica's `pagefleet:kv_blocks_free` against `pagefleet:kv_blocks_total`:
any difference is a leaked block, and the command exits non-zero. Then it stops
the server with SIGINT (Ctrl-C) and checks that nothing of it is left.

The report (`benchmarks/results/soak.md` + `.png`): error rate (errors other than
the client's own cancels and disconnects; 429s apart), RSS growth per 1,000
requests per process role (a linear fit after the warm-up), leaked blocks, and
the p99 latency drift from the first to the last fifth of the run.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

from pagefleet.bench.launcher import (
    exit_on_signals,
    free_port,
    pagefleet_serve,
    served_config,
    tail,
)
from pagefleet.bench.machine import machine_description
from pagefleet.bench.stats import percentile
from pagefleet_lab.bench.soak_load import Plan, make_plan, send
from pagefleet_lab.bench.soak_report import Run, Sample, report, window_stats
from pagefleet_lab.bench.soak_watch import scrape_replicas, server_processes

PORTS = range(8600, 8700)


def _progress(s: Sample) -> str:
    w = s.window
    kv_used = sum(r.total - r.free for r in s.replicas.values() if not math.isnan(r.free))
    kv_total = sum(r.total for r in s.replicas.values() if not math.isnan(r.total))
    roles = s.role_rss()
    top = sorted(roles.items(), key=lambda kv: -kv[1])[:4]
    return (
        f"[{s.t:6.0f} s] {s.finished:6d} req ({s.rate:5.1f}/s) ok {w.get('ok', 0):4d} "
        f"cancel {w.get('cancelled', 0):3d} disc {w.get('disconnected', 0):3d} "
        f"429 {w.get('rejected', 0):3d} err {w.get('error', 0):3d} | "
        f"e2e p50 {s.e2e_p50:5.2f} p99 {s.e2e_p99:6.2f} s, ttft p99 {s.ttft_p99:5.2f} s | "
        f"kv {kv_used:.0f}/{kv_total:.0f} on {len(s.replicas)} | "
        f"RSS {sum(roles.values()) / 1024:5.2f} GiB ("
        + ", ".join(f"{r} {v:.0f}" for r, v in top)
        + " MiB)"
    )


async def _sample(
    run: Run,
    client: httpx.AsyncClient,
    url: str,
    root_pid: int,
    t0: float,
    stop_at: float,
    every_s: float,
) -> None:
    """A `Sample` every `every_s` until `stop_at`: the server's processes, its replicas,
    and the requests finished in the window."""
    seen, prev_t = 0, 0.0
    while True:
        next_at = t0 + (len(run.samples) + 1) * every_s
        if next_at > stop_at + 1e-6:
            return
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        procs = await asyncio.to_thread(server_processes, root_pid)
        replicas, fleet = await scrape_replicas(client, url)
        new = run.records[seen:]
        seen = len(run.records)
        counts, e2e, ttft = window_stats(new)
        p50 = percentile([r.end - r.start for r in new if r.outcome == "ok"], 0.5)
        t = time.monotonic() - t0
        s = Sample(t, seen, procs, replicas, fleet, counts, e2e, ttft, p50, t - prev_t)
        prev_t = t
        run.samples.append(s)
        print(_progress(s), flush=True)


async def _drain(run: Run, client: httpx.AsyncClient, url: str, idle_timeout_s: float) -> None:
    """Until every replica is idle and balanced (or `idle_timeout_s`): `run.final`."""
    # A snapshot of a replica that stopped stays in the hub until it is stale (30 s), so
    # wait longer than that before concluding.
    t_idle = time.monotonic()
    while True:
        replicas, _ = await scrape_replicas(client, url)
        run.final = replicas
        run.idle = bool(replicas) and all(
            r.running == 0 and r.waiting == 0 and r.free == r.total for r in replicas.values()
        )
        if run.idle or time.monotonic() - t_idle > idle_timeout_s:
            break
        await asyncio.sleep(1.0)
    if run.idle:
        # The replicas push about twice a second: read again once more have arrived.
        await asyncio.sleep(3.0)
        run.final, _ = await scrape_replicas(client, url)
    run.drain_s = time.monotonic() - t_idle


async def soak(
    args: argparse.Namespace, url: str, model: str, key: str | None, root_pid: int
) -> Run:
    run = Run()
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    limits = httpx.Limits(max_connections=args.users + 8, max_keepalive_connections=args.users + 8)
    timeout = httpx.Timeout(args.request_timeout_s)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers) as client:
        # A warm-up request per endpoint, outside the measurement.
        for plan in (make_plan(random.Random(1), 0, 0), Plan(True, True, 8, 1, 0, 0, "finish")):
            await send(client, url, model, plan, 0, time.monotonic())
        t0 = time.monotonic()
        stop_at = t0 + args.minutes * 60

        async def user(u: int) -> None:
            rng = random.Random(args.seed * 100_003 + u)
            while time.monotonic() < stop_at:
                plan = make_plan(rng, args.cancel_rate, args.disconnect_rate)
                run.records.append(await send(client, url, model, plan, rng.getrandbits(31), t0))

        tasks = [asyncio.create_task(user(u)) for u in range(args.users)]
        await _sample(run, client, url, root_pid, t0, stop_at, args.sample_s)
        # No new requests now; those in flight finish (a hang shows as unfinished).
        await asyncio.sleep(max(0.0, stop_at - time.monotonic()))
        run.span_s = time.monotonic() - t0
        done, pending = await asyncio.wait(tasks, timeout=args.request_timeout_s + 30)
        for t in pending:
            t.cancel()
        run.unfinished = len(pending)
        for t in done:
            if t.exception() is not None:
                print(f"a user failed: {t.exception()!r}", flush=True)
        print(f"load stopped after {run.span_s:.0f} s; waiting for the fleet to be idle ...")
        await _drain(run, client, url, args.idle_timeout_s)
        after = await send(client, url, model, Plan(False, False, 8, 1, 0, 0, "finish"), 1, t0)
        run.after_ok = after.outcome == "ok"
    return run


def run(args: argparse.Namespace) -> int:
    exit_on_signals()
    if args.warmup_s is None:
        args.warmup_s = min(120.0, max(2 * args.sample_s, args.minutes * 60 / 5))
    machine = machine_description()
    workdir = Path(tempfile.mkdtemp(prefix="pagefleet-soak-"))
    port = args.port or free_port(PORTS)
    config, data = served_config(args.config)
    key = config.resolved_api_key()
    log = workdir / "soak.log"
    print(f"starting pagefleet serve {args.config} on port {port} (log {log}) ...", flush=True)
    with pagefleet_serve(
        data, workdir, "soak", timeout_s=args.start_timeout_s, port=port, api_key=key
    ) as server:
        try:
            print(
                f"ready; {args.users} users for {args.minutes:g} min, a line every "
                f"{args.sample_s:g} s",
                flush=True,
            )
            result = asyncio.run(soak(args, server.url, server.model, key, server.proc.pid))
        except BaseException:
            server.stop()
            print(tail(log), flush=True)
            raise
        code, left = server.stop()
    load_end = " ".join(f"{x:.2f}" for x in os.getloadavg())
    path, leaked = report(result, args, machine, {"code": code, "left": left, "load_end": load_end})
    print(path.read_text(), flush=True)
    if leaked != 0:
        print(f"pagefleet: {leaked} KV blocks leaked (server log: {log})", file=sys.stderr)
        return 1
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "soak", help="long mixed load with cancels/disconnects: errors, RSS, leaked blocks"
    )
    p.add_argument("--config", default="configs/local.yaml", help="served on a free port")
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument(
        "--users",
        type=int,
        default=16,
        help="concurrent clients; 16 is the knee of configs/local.yaml on 2 cores "
        "(`bench serve`: 8 -> 16 -> 32 users gives 524 -> 640 -> 718 tok/s)",
    )
    p.add_argument("--sample-s", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cancel-rate", type=float, default=0.10, help="streams closed midway")
    p.add_argument(
        "--disconnect-rate", type=float, default=0.05, help="requests abandoned before a token"
    )
    p.add_argument(
        "--warmup-s",
        type=float,
        default=None,
        help="RSS fits start after this (default: a fifth of the run, at most 120 s)",
    )
    p.add_argument("--port", type=int, default=None, help="default: a free one in 8600-8699")
    p.add_argument("--request-timeout-s", type=float, default=120.0)
    p.add_argument("--idle-timeout-s", type=float, default=60.0)
    p.add_argument("--start-timeout-s", type=float, default=300.0)
    p.add_argument("--out", default="benchmarks/results/soak")
