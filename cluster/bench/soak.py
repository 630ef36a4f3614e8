"""`pagefleet bench soak`: a long mixed load with cancels and disconnects, watching for leaks.

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
import contextlib
import json
import math
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import httpx
import psutil
import yaml
from prometheus_client.parser import text_string_to_metric_families

from .loadgen import cpu_info, first_free_port
from .report import markdown_table, write_report

PORTS = range(8600, 8700)

# Completion prompts of different lengths (so requests take 1 to several KV blocks).
PROMPTS = [
    "def quicksort(items):",
    "The three most important ideas in distributed systems are",
    "import numpy as np\n\n# compute the moving average of a signal\n",
    "Once upon a time in a small village, there lived an old clockmaker who",
    "class LRUCache:\n    def __init__(self, capacity):\n        self.capacity = capacity\n",
    "Summarize the plot of a detective novel in which the butler did not do it.",
    "SELECT name, count(*) FROM orders JOIN users ON orders.user_id = users.id GROUP BY",
    "List five uses for a paperclip:",
]
# Chat system prompts shared by every user: long enough to fill whole blocks, so requests
# hit the prefix cache and share blocks by reference count, which a leak would unbalance.
SYSTEMS = [
    "You are a careful assistant. Answer in plain English, cite no sources, keep every "
    "answer short and concrete, and say so when you do not know something. " * 3,
    "You are a senior Python reviewer. Point out bugs first, then style, then naming; "
    "quote the line you mean and suggest the fix in one sentence. " * 3,
]
QUESTIONS = [
    "How do I reverse a linked list?",
    "What is a paged KV cache?",
    "Explain backpressure in one paragraph.",
    "Why is my for loop slow?",
    "What does continuous batching do?",
    "Give me a haiku about schedulers.",
]


# -- the load ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """One request a user will send, and how its client will behave."""

    chat: bool
    stream: bool
    max_tokens: int
    n: int
    prompt: int  # index into PROMPTS (completions) or QUESTIONS (chat)
    system: int  # index into SYSTEMS (chat)
    action: str  # "finish", "cancel" (close the stream after `after` chunks), "disconnect"
    after: int = 0  # chunks with text before a cancel
    delay_s: float = 0.0  # a disconnect leaves this long after sending, unless answered


def make_plan(rng: random.Random, cancel_rate: float, disconnect_rate: float) -> Plan:
    """The mix: 70 % short (8-32 tokens), 30 % long (128-384); half chat; 70 % streamed."""
    long = rng.random() < 0.3
    max_tokens = rng.randint(128, 384) if long else rng.randint(8, 32)
    chat = rng.random() < 0.5
    stream = rng.random() < 0.7
    n = 2 if rng.random() < 0.1 else 1
    prompt, system = rng.randrange(len(PROMPTS)), rng.randrange(len(SYSTEMS))
    roll = rng.random()
    if roll < cancel_rate and stream:
        after = rng.randint(1, max(1, max_tokens // 2))
        return Plan(chat, stream, max_tokens, n, prompt, system, "cancel", after=after)
    if roll < cancel_rate:
        # Not streamed: the client gives up while its answer is being generated.
        delay = rng.uniform(0.3, 1.5)
        return Plan(chat, stream, max_tokens, n, prompt, system, "disconnect", delay_s=delay)
    if roll < cancel_rate + disconnect_rate:
        # Gone before its first token: queued, or still being prefilled.
        delay = rng.uniform(0.02, 0.3)
        return Plan(chat, stream, max_tokens, n, prompt, system, "disconnect", delay_s=delay)
    return Plan(chat, stream, max_tokens, n, prompt, system, "finish")


@dataclass
class Record:
    """What happened to one request (times in seconds since the load started)."""

    start: float
    end: float
    outcome: str  # ok | cancelled | disconnected | rejected (429) | error
    plan: Plan
    ttft: float | None = None
    tokens: int = 0
    reason: str = ""


def _body(plan: Plan, model: str, seed: int) -> tuple[str, dict]:
    common = {
        "model": model,
        "max_tokens": plan.max_tokens,
        "n": plan.n,
        "temperature": 0.8,
        "seed": seed,
        # Every request makes exactly max_tokens tokens: their count checks the answer.
        "ignore_eos": True,
        "stream": plan.stream,
    }
    if plan.stream:
        common["stream_options"] = {"include_usage": True}
    if plan.chat:
        messages = [
            {"role": "system", "content": SYSTEMS[plan.system]},
            {"role": "user", "content": QUESTIONS[plan.prompt % len(QUESTIONS)]},
        ]
        return "/v1/chat/completions", {**common, "messages": messages}
    return "/v1/completions", {**common, "prompt": PROMPTS[plan.prompt]}


def _chunk_text(chunk: dict) -> bool:
    for c in chunk.get("choices") or []:
        if c.get("text") or (c.get("delta") or {}).get("content"):
            return True
    return False


class _Left(Exception):
    """The client closed the request on purpose (a planned cancel)."""


async def send(
    client: httpx.AsyncClient, url: str, model: str, plan: Plan, seed: int, t0: float
) -> Record:
    path, body = _body(plan, model, seed)
    start = time.monotonic()
    rec = Record(start - t0, 0.0, "error", plan)
    expected = plan.max_tokens * plan.n
    seen_text = False

    async def run() -> None:
        nonlocal seen_text
        async with client.stream("POST", url + path, json=body) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                rec.outcome = "rejected" if r.status_code == 429 else "error"
                rec.reason = f"HTTP {r.status_code}: {_error_message(text)}"
                return
            if not plan.stream:
                data = json.loads(await r.aread())
                rec.tokens = data["usage"]["completion_tokens"]
                rec.outcome = "ok" if rec.tokens == expected else "error"
                if rec.outcome == "error":
                    rec.reason = f"{rec.tokens} of {expected} tokens"
                return
            chunks = 0
            done = False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    rec.reason = f"error event: {chunk['error'].get('message', '')[:80]}"
                    return
                if chunk.get("usage"):
                    rec.tokens = chunk["usage"]["completion_tokens"]
                if _chunk_text(chunk):
                    if not seen_text:
                        seen_text = True
                        rec.ttft = time.monotonic() - start
                    chunks += 1
                    if plan.action == "cancel" and chunks >= plan.after:
                        raise _Left  # leaving the `async with` closes the connection
            if not done:
                rec.reason = "stream ended without [DONE]"
            elif rec.tokens != expected:
                rec.reason = f"{rec.tokens} of {expected} tokens"
            else:
                rec.outcome = "ok"

    try:
        if plan.action == "disconnect":
            # Cancelling the task closes the socket: the server sees the client leave.
            await asyncio.wait_for(run(), plan.delay_s)
        else:
            await run()
    except _Left:
        rec.outcome = "cancelled"
    except TimeoutError:
        # Only a planned disconnect has a deadline: the client left before the answer ended.
        rec.outcome = "cancelled" if seen_text else "disconnected"
    except (httpx.HTTPError, httpx.StreamError, json.JSONDecodeError, KeyError) as e:
        rec.outcome = "error"
        rec.reason = f"{type(e).__name__}: {str(e)[:80]}"
    rec.end = time.monotonic() - t0
    return rec


def _error_message(text: str) -> str:
    with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
        return str(json.loads(text)["error"]["message"])[:80]
    return text[:80]


# -- the server's processes ---------------------------------------------------------------

# Ray's own helpers, not on a request's path: one group, so the plot stays readable.
_RAY_SUPPORT = (
    "dashboard.py",
    "monitor.py",
    "log_monitor.py",
    "ray::DashboardAgent",
    "ray::RuntimeEnvAgent",
)
_DEPLOYMENT_ROLES = {
    "EngineReplica": "engine replica",
    "Ingress": "ingress",
    "MetricsHubDeployment": "metrics hub",
}


def process_role(cmdline: Sequence[str], name: str, parent_role: str | None) -> str:
    """The role of one of the server's processes, from its command line (None parent: the root).

    Ray names its actor processes `ray::Class` (Serve's replicas `ray::ServeReplica:app:
    Deployment`); the engine core is a multiprocessing child of an engine replica.
    """
    if parent_role is None:
        return "pagefleet serve"
    cmd = " ".join(cmdline) or name
    if Path(cmdline[0] if cmdline else name).name == "gcs_server":
        return "ray gcs"
    if Path(cmdline[0] if cmdline else name).name == "raylet":
        return "ray raylet"
    if cmd.startswith("ray::ServeController"):
        return "serve controller"
    if cmd.startswith("ray::ProxyActor"):
        return "serve proxy"
    if cmd.startswith("ray::ServeReplica:"):
        # Ray retitles an actor's process with the method it runs: `...:Ingress.check_health`.
        deployment = cmd.split()[0].rsplit(":", 1)[-1].split(".")[0]
        return _DEPLOYMENT_ROLES.get(deployment, f"serve replica {deployment}")
    if cmd.startswith("ray::IDLE"):
        return "ray idle worker"
    if any(s in cmd for s in _RAY_SUPPORT):
        return "ray support"
    if "multiprocessing.resource_tracker" in cmd:
        return "mp resource tracker"
    if "multiprocessing.spawn" in cmd or "--multiprocessing-fork" in cmd:
        if parent_role == "engine replica":
            return "engine core"
        if parent_role == "engine core":
            return "engine TP rank"
        return f"child of {parent_role}"
    if cmd.startswith("ray::"):
        return "ray actor " + cmd.split()[0][5:]
    return "other " + (Path(cmdline[0]).name if cmdline else name)


@dataclass
class ProcSample:
    pid: int
    role: str
    rss_mib: float


def server_processes(root: int) -> list[ProcSample]:
    """Every live process of the tree under `root`, with its role and RSS."""
    try:
        top = psutil.Process(root)
        procs = [top, *top.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
    seen: dict[int, tuple[int, list[str], str, float]] = {}
    for p in procs:
        try:
            with p.oneshot():
                seen[p.pid] = (p.ppid(), p.cmdline(), p.name(), p.memory_info().rss / 2**20)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    roles: dict[int, str] = {}

    def role(pid: int) -> str:
        # A child's role can depend on its parent's (the engine core under a replica).
        if pid not in roles:
            ppid, cmdline, name, _ = seen[pid]
            parent = None if pid == root else (role(ppid) if ppid in seen else "?")
            roles[pid] = process_role(cmdline, name, parent)
        return roles[pid]

    return [ProcSample(pid, role(pid), rss) for pid, (_, _, _, rss) in seen.items()]


# -- the fleet's metrics ----------------------------------------------------------------


@dataclass
class ReplicaState:
    free: float = math.nan
    total: float = math.nan
    running: float = 0.0
    waiting: float = 0.0


def parse_replicas(text: str) -> tuple[dict[str, ReplicaState], float | None]:
    """Per-replica KV blocks and queue from a /metrics page, and `pagefleet:replicas`."""
    names = {
        "pagefleet:kv_blocks_free": "free",
        "pagefleet:kv_blocks_total": "total",
        "vllm:num_requests_running": "running",
        "vllm:num_requests_waiting": "waiting",
    }
    out: dict[str, ReplicaState] = {}
    replicas = None
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "pagefleet:replicas":
                replicas = (replicas or 0.0) + s.value
            elif s.name in names and "replica" in s.labels:
                setattr(out.setdefault(s.labels["replica"], ReplicaState()), names[s.name], s.value)
    return out, replicas


def leaked_blocks(replicas: dict[str, ReplicaState]) -> int:
    return int(sum(r.total - r.free for r in replicas.values()))


# -- statistics ------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..1); nan for no values."""
    if not values:
        return math.nan
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ys on xs; nan with fewer than 3 points or no spread in xs."""
    if len(xs) < 3:
        return math.nan
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return math.nan
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx


@dataclass
class Sample:
    t: float  # seconds since the load started
    finished: int  # requests finished (any outcome) so far
    procs: list[ProcSample]
    replicas: dict[str, ReplicaState]
    fleet_replicas: float | None
    window: dict[str, int] = field(default_factory=dict)
    e2e_p99: float = math.nan
    ttft_p99: float = math.nan
    e2e_p50: float = math.nan
    dt: float = 0.0  # the window's length (a loaded machine wakes the sampler late)

    @property
    def rate(self) -> float:
        return sum(self.window.values()) / self.dt if self.dt > 0 else 0.0

    def role_rss(self) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for p in self.procs:
            out[p.role] += p.rss_mib
        return dict(out)


@dataclass
class RoleGrowth:
    role: str
    processes: int  # at the last sample
    rss_start: float  # the role's total after the warm-up (MiB)
    rss_end: float
    per_1k: float  # MiB per 1,000 requests, the sum of its processes' slopes
    worst_per_1k: float  # the steepest single process
    churn: int  # processes that started or ended after the warm-up


def rss_growth(samples: Sequence[Sample], warmup_s: float) -> list[RoleGrowth]:
    """Per role, RSS growth per 1,000 finished requests, fitted per process after the warm-up.

    Fitting each process on its own (then summing the role's slopes) keeps a replica that
    the autoscaler adds or removes from reading as growth or shrinkage of the role.
    """
    after = [s for s in samples if s.t >= warmup_s]
    if len(after) < 3:
        after = list(samples)
    if not after:
        return []
    series: dict[int, tuple[str, list[float], list[float]]] = {}
    for s in after:
        for p in s.procs:
            role, xs, ys = series.setdefault(p.pid, (p.role, [], []))
            xs.append(s.finished)
            ys.append(p.rss_mib)
    first_pids = {p.pid for p in after[0].procs}
    last_pids = {p.pid for p in after[-1].procs}
    start, end = after[0].role_rss(), after[-1].role_rss()
    out = []
    for role in sorted({r for r, _, _ in series.values()}):
        slopes = [slope(xs, ys) * 1000 for r, xs, ys in series.values() if r == role]
        slopes = [v for v in slopes if not math.isnan(v)]
        pids = {pid for pid, (r, _, _) in series.items() if r == role}
        out.append(
            RoleGrowth(
                role,
                len(pids & last_pids),
                start.get(role, 0.0),
                end.get(role, 0.0),
                sum(slopes) if slopes else math.nan,
                max(slopes) if slopes else math.nan,
                len(pids - first_pids) + len((pids & first_pids) - last_pids),
            )
        )
    return out


def fifths(records: Sequence[Record], span_s: float) -> tuple[list[Record], list[Record]]:
    """The requests sent in the first and in the last fifth of the load.

    By start, not by end: when the load stops, the long requests still in flight finish
    last, and a fifth chosen by end time would hold more of them than the mix does.
    """
    first = [r for r in records if r.start < span_s / 5]
    last = [r for r in records if r.start >= span_s * 4 / 5]
    return first, last


def window_stats(records: Sequence[Record]) -> tuple[dict[str, int], float, float]:
    counts: dict[str, int] = defaultdict(int)
    for r in records:
        counts[r.outcome] += 1
    ok = [r for r in records if r.outcome == "ok"]
    e2e = percentile([r.end - r.start for r in ok], 0.99)
    ttft = percentile([r.ttft for r in ok if r.ttft is not None], 0.99)
    return dict(counts), e2e, ttft


# -- the server ------------------------------------------------------------------------


def _pick_port() -> int:
    port = first_free_port(PORTS)
    if port is None:
        raise SystemExit(f"no free port in {PORTS.start}-{PORTS.stop - 1}")
    return port


def write_config(config_path: str, workdir: Path, port: int) -> tuple[Path, str, str | None]:
    """The config with our port (the model's path made absolute): (path, model name, key)."""
    from ..config import load_config

    config = load_config(config_path)
    data = config.model_dump(mode="json")
    key = config.resolved_api_key()
    if config.api_key is not None:
        data["api_key"] = config.api_key.get_secret_value()  # json mode masks it
    data.update(port=port, host="127.0.0.1")
    path = workdir / "soak.yaml"
    path.write_text(yaml.safe_dump(data))
    return path, config.model_name, key


def start_server(config: Path, log: Path, url: str, timeout_s: float) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.setdefault("RAY_AUTH_MODE", "disabled")
    env["PYTHONUNBUFFERED"] = "1"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pagefleet.cluster.cli", "serve", str(config)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"pagefleet serve exited with {proc.returncode}:\n{_tail(log)}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return proc
        time.sleep(1)
    stop_server(proc)
    raise RuntimeError(f"pagefleet serve not ready after {timeout_s:.0f} s:\n{_tail(log)}")


def stop_server(proc: subprocess.Popen[bytes]) -> tuple[int | None, list[str]]:
    """Ctrl-C, as a user stops it: (exit code, what of it was left running afterwards)."""
    if proc.poll() is not None:
        return proc.returncode, []
    with contextlib.suppress(psutil.NoSuchProcess):
        tree = psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(signal.SIGINT)
    try:
        code: int | None = proc.wait(120)
    except subprocess.TimeoutExpired:
        code = None
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    deadline = time.monotonic() + 30
    left: list[psutil.Process] = []
    while time.monotonic() < deadline:
        left = [p for p in tree if _alive(p)]
        if not left:
            break
        time.sleep(0.5)
    names = []
    for p in left:
        with contextlib.suppress(psutil.Error):
            names.append(" ".join(p.cmdline())[:60] or p.name())
            p.kill()  # ours: started by this command's server
    return code, names


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _tail(log: Path, lines: int = 30) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    return ""


# -- the run ---------------------------------------------------------------------------


@dataclass
class Run:
    records: list[Record] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    span_s: float = 0.0
    drain_s: float = 0.0
    unfinished: int = 0
    final: dict[str, ReplicaState] = field(default_factory=dict)
    idle: bool = False
    after_ok: bool = False


async def _scrape(
    client: httpx.AsyncClient, url: str
) -> tuple[dict[str, ReplicaState], float | None]:
    try:
        r = await client.get(f"{url}/metrics", timeout=10)
        return parse_replicas(r.text)
    except (httpx.HTTPError, ValueError):
        return {}, None


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


async def soak(
    args: argparse.Namespace, url: str, model: str, key: str | None, root_pid: int
) -> Run:
    run = Run()
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    limits = httpx.Limits(max_connections=args.users + 8, max_keepalive_connections=args.users + 8)
    timeout = httpx.Timeout(args.request_timeout_s)
    duration = args.minutes * 60
    async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers) as client:
        # A warm-up request per endpoint, outside the measurement.
        for plan in (make_plan(random.Random(1), 0, 0), Plan(True, True, 8, 1, 0, 0, "finish")):
            await send(client, url, model, plan, 0, time.monotonic())
        t0 = time.monotonic()
        stop_at = t0 + duration

        async def user(u: int) -> None:
            rng = random.Random(args.seed * 100_003 + u)
            while time.monotonic() < stop_at:
                plan = make_plan(rng, args.cancel_rate, args.disconnect_rate)
                run.records.append(await send(client, url, model, plan, rng.getrandbits(31), t0))

        tasks = [asyncio.create_task(user(u)) for u in range(args.users)]
        seen, prev_t = 0, 0.0
        while True:
            now = time.monotonic()
            next_at = t0 + (len(run.samples) + 1) * args.sample_s
            if next_at > stop_at + 1e-6:
                break
            await asyncio.sleep(max(0.0, next_at - now))
            procs = await asyncio.to_thread(server_processes, root_pid)
            replicas, fleet = await _scrape(client, url)
            new = run.records[seen:]
            seen = len(run.records)
            counts, e2e, ttft = window_stats(new)
            p50 = percentile([r.end - r.start for r in new if r.outcome == "ok"], 0.5)
            t = time.monotonic() - t0
            s = Sample(t, seen, procs, replicas, fleet, counts, e2e, ttft, p50, t - prev_t)
            prev_t = t
            run.samples.append(s)
            print(_progress(s), flush=True)
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
        # Idle and balanced on every replica; a snapshot of a replica that stopped stays in
        # the hub until it is stale (30 s), so wait longer than that before concluding.
        t_idle = time.monotonic()
        while True:
            replicas, _ = await _scrape(client, url)
            run.final = replicas
            run.idle = bool(replicas) and all(
                r.running == 0 and r.waiting == 0 and r.free == r.total for r in replicas.values()
            )
            if run.idle or time.monotonic() - t_idle > args.idle_timeout_s:
                break
            await asyncio.sleep(1.0)
        if run.idle:
            # The replicas push about twice a second: read again once more have arrived.
            await asyncio.sleep(3.0)
            run.final, _ = await _scrape(client, url)
        run.drain_s = time.monotonic() - t_idle
        after = await send(client, url, model, Plan(False, False, 8, 1, 0, 0, "finish"), 1, t0)
        run.after_ok = after.outcome == "ok"
    return run


# -- the report ------------------------------------------------------------------------


def machine() -> dict[str, str]:
    model, bf16 = cpu_info("?")
    versions = {"python": platform.python_version()}
    for dist in ("pagefleet", "torch", "ray", "fastapi", "httpx"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[dist] = metadata.version(dist)
    commit = ""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5
        ).stdout.strip()
    return {
        "cpu": model,
        "cores": str(os.cpu_count()),
        "bf16": ("yes (" + ", ".join(bf16) + ")") if bf16 else "no (no avx512_bf16/amx_bf16)",
        "versions": ", ".join(f"{k} {v}" for k, v in versions.items())
        + (f", commit {commit}" if commit else ""),
    }


def _plot(run: Run, out: str, warmup_s: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(19, 9))
    ts = [s.t / 60 for s in run.samples]
    roles = sorted({p.role for s in run.samples for p in s.procs})
    colors = plt.get_cmap("tab20").colors
    per_role = [s.role_rss() for s in run.samples]
    base_at = next((i for i, s in enumerate(run.samples) if s.t >= warmup_s), 0)
    ax = axes[0][0]
    for i, role in enumerate(roles):
        ax.plot(ts, [r.get(role, math.nan) for r in per_role], label=role, color=colors[i % 20])
    ax.set_title("RSS per process role (MiB, summed over its processes)")
    ax.set_xlabel("minutes")
    ax.legend(fontsize=7, ncol=2)
    # The same, as the change since the warm-up against requests finished: the fit's axes.
    ax = axes[0][1]
    xs = [s.finished for s in run.samples]
    for i, role in enumerate(roles):
        base = per_role[base_at].get(role)
        if base is None:
            continue
        ys = [r.get(role, math.nan) - base for r in per_role]
        ax.plot(xs, ys, label=role, color=colors[i % 20])
    ax.axvline(run.samples[base_at].finished, color="gray", ls=":", lw=1)
    ax.set_title("RSS change since the warm-up (MiB, dotted line) per role")
    ax.set_xlabel("requests finished")
    ax = axes[0][2]
    ax.plot(ts, [s.e2e_p99 for s in run.samples], label="e2e p99")
    ax.plot(ts, [s.e2e_p50 for s in run.samples], label="e2e p50", ls=":")
    ax.plot(ts, [s.ttft_p99 for s in run.samples], label="TTFT p99 (streamed)")
    ax.set_title("latency of the requests finished in each window (s)")
    ax.set_xlabel("minutes")
    ax.legend(fontsize=8)
    ax = axes[1][0]
    for outcome in ("ok", "cancelled", "disconnected", "rejected", "error"):
        ax.plot(ts, [s.window.get(outcome, 0) / s.dt for s in run.samples], label=outcome)
    ax.set_title("requests/s by outcome")
    ax.set_xlabel("minutes")
    ax.legend(fontsize=8)
    ax = axes[1][1]
    ax.plot(ts, [sum(r.total - r.free for r in s.replicas.values()) for s in run.samples])
    ax.set_title("KV blocks in use (all replicas) and engine replicas (red)")
    ax.set_xlabel("minutes")
    ax2 = ax.twinx()
    counts = [s.fleet_replicas or len(s.replicas) for s in run.samples]
    ax2.step(ts, counts, "r--", where="post")
    ax2.set_ylim(0, max([*counts, 1]) + 1)
    ax = axes[1][2]
    ax.plot(ts, [sum(r.values()) / 1024 for r in per_role])
    ax.set_title("RSS of all the server's processes (GiB)")
    ax.set_xlabel("minutes")
    for a in axes.flat:
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(Path(out).with_suffix(".png"), dpi=90)


def _f(v: float, fmt: str = ".2f") -> str:
    return "n/a" if math.isnan(v) else format(v, fmt)


def report(
    run: Run, args: argparse.Namespace, info: dict[str, str], server: dict[str, object]
) -> tuple[Path, int]:
    recs = run.records
    counts: dict[str, int] = defaultdict(int)
    for r in recs:
        counts[r.outcome] += 1
    total = len(recs)
    errors = counts["error"] + run.unfinished
    leaked = leaked_blocks(run.final) if run.final else -1
    first, last = fifths(recs, run.span_s)
    _, e2e_a, ttft_a = window_stats(first)
    _, e2e_b, ttft_b = window_stats(last)

    def drift(a: float, b: float) -> str:
        if math.isnan(a) or math.isnan(b) or a == 0:
            return "n/a"
        return f"{a:.2f} -> {b:.2f} s ({(b / a - 1) * 100:+.0f} %)"

    summary = [
        ["requests finished", f"{total} ({total / max(run.span_s, 1e-9):.1f}/s)"],
        ["ok", counts["ok"]],
        ["cancelled by the client (mid-stream)", counts["cancelled"]],
        ["disconnected by the client (before a token)", counts["disconnected"]],
        [
            "429 (rejected, counted apart)",
            f"{counts['rejected']} ({counts['rejected'] / max(total, 1) * 100:.3f} %)",
        ],
        ["errors (other than the client's own)", errors],
        ["**error rate** (errors / requests)", f"**{errors / max(total, 1) * 100:.3f} %**"],
        ["unfinished when the load stopped (hung)", run.unfinished],
        [
            "**leaked KV blocks** (total - free, every replica, idle)",
            f"**{leaked}**" if leaked >= 0 else "**unknown (no replica reported)**",
        ],
        [
            "fleet idle after the load",
            f"{'yes' if run.idle else 'NO'} after {run.drain_s:.0f} s "
            f"({len(run.final)} replica(s): "
            + ", ".join(f"{int(r.free)}/{int(r.total)} free" for r in run.final.values())
            + ")",
        ],
        ["**p99 e2e latency drift** (first -> last fifth)", f"**{drift(e2e_a, e2e_b)}**"],
        ["p99 TTFT drift, streamed (first -> last fifth)", drift(ttft_a, ttft_b)],
        ["a completion after the soak", "ok" if run.after_ok else "FAILED"],
        [
            "server stopped with SIGINT",
            f"exit code {server['code']}"
            + (f", left running: {server['left']}" if server["left"] else ", nothing left"),
        ],
    ]
    growth = rss_growth(run.samples, args.warmup_s)
    rss_rows = [
        [
            g.role,
            g.processes,
            f"{g.rss_start:.0f}",
            f"{g.rss_end:.0f}",
            _f(g.per_1k),
            _f(g.worst_per_1k),
            g.churn,
        ]
        for g in growth
    ]
    reasons: dict[str, int] = defaultdict(int)
    for r in recs:
        if r.outcome in ("error", "rejected"):
            reasons[r.reason] += 1
    counts_seen = [int(s.fleet_replicas or len(s.replicas)) for s in run.samples]
    ids_seen = {r for s in run.samples for r in s.replicas}
    # A replica the autoscaler removed is gone from /metrics: its blocks cannot be read at
    # the end (its drain is what Serve checks), so the report says how many there were.
    gone = sorted(ids_seen - set(run.final))
    after_warmup = [s for s in run.samples if s.t >= args.warmup_s]
    body = "\n".join(
        [
            f"Config `{args.config}` served by `pagefleet serve` in a subprocess; "
            f"{args.users} users for {args.minutes:g} min (seed {args.seed}), each sending one "
            "request after another: 70 % short (8-32 tokens) / 30 % long (128-384), half "
            "completions / half chat (two shared system prompts: prefix-cache hits), 70 % "
            "streamed, 10 % with n=2, ignore_eos (so every answer's token count is checked); "
            f"{args.cancel_rate:.0%} of streams closed midway by the client (and as many "
            "non-streamed requests abandoned 0.3-1.5 s after sending, while being generated), "
            f"{args.disconnect_rate:.0%} of requests abandoned 0.02-0.3 s after sending "
            "(before the first token or while queued); a new request follows at once. "
            "Samples every "
            f"{args.sample_s:g} s; RSS fits start after a {args.warmup_s:g} s warm-up "
            f"({len(after_warmup)} samples). Engine replicas: "
            + (
                f"{min(counts_seen)}-{max(counts_seen)} over the run"
                if counts_seen
                else "none sampled"
            )
            + (
                f"; {len(gone)} replica(s) left during the run (removed by the autoscaler; "
                "their blocks are not read at the end)."
                if gone
                else "."
            ),
            "",
            f"Machine: {info['cpu']}, {info['cores']} cores, native bf16: {info['bf16']}; "
            f"load average at start {server['load_start']}, at end {server['load_end']} "
            "(a shared machine: other work competes for the cores).",
            f"Versions: {info['versions']}.",
            "",
            markdown_table(["", "value"], summary),
            "",
            "RSS per process role (MiB, summed over the role's processes; growth: each "
            "process's linear fit of RSS on finished requests after the warm-up, summed over "
            "the role, per 1,000 requests; churn: processes that started or ended after the "
            "warm-up, e.g. replicas the autoscaler moved):",
            "",
            markdown_table(
                [
                    "role",
                    "processes",
                    "RSS after warm-up",
                    "RSS at end",
                    "growth MiB / 1k req",
                    "worst process MiB / 1k req",
                    "churn",
                ],
                rss_rows,
            ),
        ]
        + (
            [
                "",
                "Errors and 429s by reason:",
                "",
                markdown_table(["reason", "count"], sorted(reasons.items(), key=lambda kv: -kv[1])),
            ]
            if reasons
            else []
        )
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    _plot(run, args.out, args.warmup_s)
    return write_report(args.out, "Soak: mixed load with cancels and disconnects", body), leaked


def run(args: argparse.Namespace) -> int:
    if args.warmup_s is None:
        args.warmup_s = min(120.0, max(2 * args.sample_s, args.minutes * 60 / 5))
    info = machine()
    workdir = Path(tempfile.mkdtemp(prefix="pagefleet-soak-"))
    port = args.port or _pick_port()
    url = f"http://127.0.0.1:{port}"
    config, model, key = write_config(args.config, workdir, port)
    log = workdir / "serve.log"
    load_start = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"starting pagefleet serve {args.config} on {url} (log {log}) ...", flush=True)
    proc = start_server(config, log, url, args.start_timeout_s)
    try:
        print(
            f"ready; {args.users} users for {args.minutes:g} min, a line every {args.sample_s:g} s",
            flush=True,
        )
        result = asyncio.run(soak(args, url, model, key, proc.pid))
    except BaseException:
        stop_server(proc)
        print(_tail(log), flush=True)
        raise
    code, left = stop_server(proc)
    server = {
        "code": code,
        "left": left,
        "load_start": load_start,
        "load_end": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }
    path, leaked = report(result, args, info, server)
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
