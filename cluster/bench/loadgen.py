"""What the fleet benchmarks (`bench router`, `bench autoscale`) share.

- Workloads as pure functions of a seed: lists of `BenchRequest` (prompt token
  ids and max_tokens), so that every policy in one run gets exactly the same
  requests. Prompts are token ids, not text: their lengths are exact, which is
  what KV pressure and prefix sharing are about (vLLM's `benchmark_serving`
  "random" dataset does the same).
- A streaming client that measures TTFT on the client, as a user sees it.
- Closed-loop users: each sends its own list of requests one after another.
- `/metrics` scraping, a `pagefleet serve` subprocess on a port in 8500-8599,
  and the machine description each result is headed with.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import platform
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

# Token ids from here up: the tiny and SmolLM tokenizers keep their special
# tokens below it, and a prompt of special tokens is not a realistic prompt.
FIRST_PLAIN_TOKEN = 16


# -- workloads (pure) -----------------------------------------------------------------


@dataclass(frozen=True)
class BenchRequest:
    prompt: tuple[int, ...]
    max_tokens: int
    kind: str = ""  # "long" / "short", or the system prompt's index: for reports only


def percentile(values: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) with linear interpolation between order statistics
    (numpy's default); NaN for no values."""
    if not values:
        return math.nan
    if not 0.0 <= q <= 1.0:
        raise ValueError("q must be in [0, 1]")
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def random_tokens(rng: random.Random, n: int, vocab_size: int) -> tuple[int, ...]:
    return tuple(rng.randrange(FIRST_PLAIN_TOKEN, vocab_size) for _ in range(n))


def skewed_workload(
    num_requests: int,
    long_fraction: float,
    long_prompt: tuple[int, int],
    long_output: tuple[int, int],
    short_prompt: tuple[int, int],
    short_output: tuple[int, int],
    vocab_size: int,
    seed: int,
) -> list[BenchRequest]:
    """A few long requests among many short ones, in a seeded random order.

    Exactly round(num_requests * long_fraction) are long (a fixed count, so
    runs differ only in order when the seed changes); lengths are uniform in
    the inclusive (lo, hi) ranges. Prompts are random tokens: no two share a
    prefix block, so this workload measures KV capacity, not caching.
    """
    if not 0.0 <= long_fraction <= 1.0:
        raise ValueError("long_fraction must be in [0, 1]")
    rng = random.Random(seed)
    num_long = round(num_requests * long_fraction)
    kinds = ["long"] * num_long + ["short"] * (num_requests - num_long)
    rng.shuffle(kinds)
    out = []
    for kind in kinds:
        p, o = (long_prompt, long_output) if kind == "long" else (short_prompt, short_output)
        prompt = random_tokens(rng, rng.randint(*p), vocab_size)
        out.append(BenchRequest(prompt, rng.randint(*o), kind))
    return out


def shared_prefix_workload(
    num_requests: int,
    num_system_prompts: int,
    system_tokens: int,
    question_tokens: tuple[int, int],
    output_tokens: tuple[int, int],
    vocab_size: int,
    seed: int,
) -> list[BenchRequest]:
    """Many users, a few long system prompts: each request is one of
    `num_system_prompts` fixed prefixes followed by its own random question.
    Every system prompt serves an equal share (up to one request), in a seeded
    random order: no run is luckier in its popularity mix than another."""
    rng = random.Random(seed)
    systems = [random_tokens(rng, system_tokens, vocab_size) for _ in range(num_system_prompts)]
    which = [i % num_system_prompts for i in range(num_requests)]
    rng.shuffle(which)
    out = []
    for s in which:
        question = random_tokens(rng, rng.randint(*question_tokens), vocab_size)
        out.append(BenchRequest(systems[s] + question, rng.randint(*output_tokens), f"system{s}"))
    return out


def deal(requests: Sequence[BenchRequest], users: int) -> list[list[BenchRequest]]:
    """User u sends requests u, u + users, u + 2 * users, ... in that order."""
    if users < 1:
        raise ValueError("users must be >= 1")
    return [list(requests[u::users]) for u in range(users)]


# -- the client -----------------------------------------------------------------------


@dataclass
class RequestResult:
    ok: bool
    kind: str = ""
    sent_at: float = 0.0  # seconds since the scenario began
    ttft: float = math.nan
    e2e: float = math.nan
    tokens: int = 0
    error: str = ""


async def sse_lines(r: httpx.Response) -> AsyncIterator[str]:
    """The lines of an event stream. Only CR and LF end a line there: the data is JSON
    written with ensure_ascii=False, whose strings may hold U+2028, U+0085 and the like,
    at which httpx's `aiter_lines` (str.splitlines rules) would cut a chunk in two."""
    buf = ""
    async for text in r.aiter_text():
        buf += text
        *lines, buf = buf.split("\n")
        for line in lines:
            yield line.rstrip("\r")
    if buf:
        yield buf.rstrip("\r")


async def stream_completion(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    req: BenchRequest,
    t0: float,
) -> RequestResult:
    """One streamed completion (ignore_eos: it makes exactly max_tokens tokens).

    TTFT is the time to the first chunk that carries a choice: the API sends one
    only once the replica produced a token. A request is ok when it ended with
    usage.completion_tokens == max_tokens and no error event.
    """
    body = {
        "model": model,
        "prompt": list(req.prompt),
        "max_tokens": req.max_tokens,
        "temperature": 0.8,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    res = RequestResult(ok=False, kind=req.kind, sent_at=start - t0)
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in sse_lines(r):
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = str(chunk["error"].get("message", chunk["error"]))[:200]
                    return res
                if chunk.get("choices") and math.isnan(res.ttft):
                    res.ttft = time.perf_counter() - start
                if chunk.get("usage"):
                    res.tokens = chunk["usage"]["completion_tokens"]
        res.e2e = time.perf_counter() - start
        res.ok = res.tokens == req.max_tokens
        if not res.ok:
            res.error = f"{res.tokens} of {req.max_tokens} tokens"
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"[:200]
    return res


async def closed_loop(
    url: str,
    model: str,
    per_user: Sequence[Sequence[BenchRequest]],
    start_offsets: Sequence[float],
    on_done: Callable[[RequestResult], None] | None = None,
) -> tuple[list[RequestResult], float]:
    """Each user starts at its offset and sends its requests back to back.

    Returns every result and the wall time from the first send to the last
    answer. A fixed number of users keeps the number of requests in flight
    (hence the KV pressure) the same on fast and slow machines.
    """
    n = len(per_user)
    limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0), limits=limits) as client:
        t0 = time.perf_counter()

        async def user(u: int) -> list[RequestResult]:
            await asyncio.sleep(start_offsets[u])
            out = []
            for req in per_user[u]:
                res = await stream_completion(client, url, model, req, t0)
                if on_done is not None:
                    on_done(res)
                out.append(res)
            return out

        per = await asyncio.gather(*(user(u) for u in range(n)))
        return [r for rs in per for r in rs], time.perf_counter() - t0


# -- /metrics -------------------------------------------------------------------------


@dataclass
class Scrape:
    """One /metrics page: (sample name, labels) -> value."""

    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = field(default_factory=dict)

    def total(self, name: str) -> float:
        return sum(v for (n, _), v in self.samples.items() if n == name)

    def by(self, name: str, label: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for (n, labels), v in self.samples.items():
            if n == name:
                key = dict(labels).get(label, "")
                out[key] = out.get(key, 0.0) + v
        return out

    def value(self, name: str) -> float | None:
        values = [v for (n, _), v in self.samples.items() if n == name]
        return values[0] if values else None


def parse_metrics(text: str) -> Scrape:
    from prometheus_client.parser import text_string_to_metric_families

    out = Scrape()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def scrape(url: str, timeout: float = 30.0) -> Scrape:
    r = httpx.get(f"{url}/metrics", timeout=timeout)
    # While the app deploys, Serve's proxy answers 404 with a text body: an HTTPError
    # (callers waiting for readiness retry on it), never a page to parse.
    r.raise_for_status()
    return parse_metrics(r.text)


def counter_delta(before: Scrape, after: Scrape, name: str, label: str) -> dict[str, float]:
    """How far a counter moved per label value (series new in `after` count from 0)."""
    b, a = before.by(name, label), after.by(name, label)
    return {k: v - b.get(k, 0.0) for k, v in a.items() if v - b.get(k, 0.0)}


def wait_idle(url: str, timeout: float = 300.0, settle_s: float = 1.5) -> Scrape:
    """Until no replica runs or queues anything, then `settle_s` more (replicas push
    their series to the metrics hub about twice a second): the scrape then counts
    everything the last requests did."""
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(url)
        if m.total("vllm:num_requests_running") == 0 and m.total("vllm:num_requests_waiting") == 0:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url}: still busy after {timeout:.0f} s")
        time.sleep(0.5)
    time.sleep(settle_s)
    return scrape(url)


# -- a `pagefleet serve` of our own ---------------------------------------------------


def first_free_port(ports: Iterable[int]) -> int | None:
    """The first of `ports` that 127.0.0.1 can bind now (None: none can). Bound and
    released: a server started later may still lose it to someone else."""
    for port in ports:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    return None


def free_port(lo: int = 8500, hi: int = 8599) -> int:
    """A port in [lo, hi] nothing listens on (this project's range for HTTP)."""
    ports = list(range(lo, hi + 1))
    random.shuffle(ports)  # two benchmarks started at once rarely pick the same one
    port = first_free_port(ports)
    if port is None:
        raise RuntimeError(f"no free port in {lo}-{hi}")
    return port


def token_range(text: str) -> list[int]:
    """A command line's LO-HI (or N: N-N) as [lo, hi]."""
    lo, _, hi = text.partition("-")
    return [int(lo), int(hi or lo)]


def ensure_model(model: str, preset: str) -> tuple[str, int]:
    """(absolute checkpoint path, vocabulary size), writing the `preset` checkpoint at
    `model` first if none is there (`pagefleet make-model`)."""
    path = Path(model)
    if not (path / "config.json").is_file():
        from ..make_model import make_model

        print(f"writing the {preset} checkpoint to {path} ...", flush=True)
        make_model(path, preset=preset)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    return str(path.resolve()), vocab


@dataclass
class Fleet:
    url: str
    model: str
    log: Path


@contextlib.contextmanager
def pagefleet_serve(
    config: dict, workdir: Path, tag: str, replicas: int = 1, timeout_s: float = 400.0
) -> Iterator[Fleet]:
    """`pagefleet serve` of `config` (port filled in) in its own process group, until
    `replicas` engine replicas report to /metrics; stopped with Ctrl-C (SIGINT), as
    a user stops it, which also stops the embedded Ray it started."""
    port = free_port()
    cfg = {**config, "host": "127.0.0.1", "port": port}
    path = workdir / f"{tag}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    log = workdir / f"{tag}.log"
    # Its own Ray, never a cluster the caller's environment points at. Without an
    # address ray.init() also joins the last `ray start` cluster on this machine (it
    # finds it through $RAY_TMPDIR/ray/ray_current_cluster, default /tmp): a Ray temp
    # dir of its own hides any. Short, as Ray's socket paths must fit 107 bytes.
    ray_tmp = tempfile.mkdtemp(prefix="pfr-")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env |= {
        "PYTHONUNBUFFERED": "1",
        "RAY_AUTH_MODE": "disabled",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_TMPDIR": ray_tmp,
    }
    url = f"http://127.0.0.1:{port}"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pagefleet.cluster.cli", "serve", str(path)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"pagefleet serve exited with {proc.returncode}:\n{_tail(log)}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    m = scrape(url, timeout=5)
                    if len(m.by("pagefleet:kv_blocks_total", "replica")) >= replicas:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{url}: not ready after {timeout_s:.0f} s:\n{_tail(log)}")
                time.sleep(1.0)
            model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
            yield Fleet(url, model, log)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(120)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(10)
            shutil.rmtree(ray_tmp, ignore_errors=True)


def _tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def exit_on_signals() -> None:
    """Ctrl-C and SIGTERM end a benchmark through its `finally` blocks, which stop the
    servers it started. Set explicitly: a shell starts background jobs with SIGINT
    ignored, and Python's default SIGTERM skips `finally`."""

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)


class LoadMonitor:
    """The machine's 1-minute load average, sampled in a thread while a benchmark runs:
    a shared machine's other work shows in the report, not only in the numbers."""

    def __init__(self, period_s: float = 5.0) -> None:
        self.samples: list[float] = []
        self._period_s = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while True:
            self.samples.append(os.getloadavg()[0])
            if self._stop.wait(self._period_s):
                return

    def __enter__(self) -> LoadMonitor:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def summary(self) -> str:
        if not self.samples:
            return ""
        mean = sum(self.samples) / len(self.samples)
        return (
            f"1-minute load average during the run: mean {mean:.1f}, max "
            f"{max(self.samples):.1f} on {os.cpu_count()} cores"
            + (
                " (other work shared the machine: read the figures with care)."
                if mean > 2.5
                else "."
            )
        )


# -- where it ran ---------------------------------------------------------------------


def cpu_info(unknown: str = "unknown CPU") -> tuple[str, list[str]]:
    """(CPU model, its native bf16 flags among avx512_bf16/amx_bf16) from /proc/cpuinfo."""
    model, flags = platform.processor() or unknown, set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    return model, sorted(flags & {"avx512_bf16", "amx_bf16"})


def machine_description() -> str:
    """CPU model, cores, native bf16, load, versions: what a reader needs to compare."""
    model, bf16 = cpu_info()
    import ray
    import torch

    load = os.getloadavg()
    rev = ""
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).parent,
        ).stdout.strip()
    return (
        f"Machine: {model}, {os.cpu_count()} cores, native bf16: "
        f"{'yes (' + ', '.join(bf16) + ')' if bf16 else 'no'}; load average at start "
        f"{load[0]:.2f}. Versions: pagefleet {rev or '(no git)'}, Python "
        f"{platform.python_version()}, torch {torch.__version__}, Ray {ray.__version__}."
    )
