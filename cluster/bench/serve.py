"""`pagefleet bench serve`: the seed article's load test, for any OpenAI-compatible URL.

At each concurrency level, that many users each send `--requests-per-user`
streaming completions one after another (max_tokens 50, ignore_eos, so every
request makes exactly 50 tokens). Per level and server: success rate, output
tokens/s over the level's wall time, TTFT and inter-token latency p50/p99,
end-to-end latency p50/p99. Servers are measured one after another in one run
(side by side), never at the same time: they share the CPU.

Servers: `--url` (any number, e.g. a running `vllm serve`), `--config` (a
pagefleet config this command serves itself on a free port, once per
`--sweep` value), and `--vllm-python` (a venv with vLLM's CPU build; this
command starts `vllm.entrypoints.openai.api_server` on the same checkpoint).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from .report import markdown_table, write_report

PROMPTS = [
    "Write a short story about a robot learning to paint.",
    "Explain how a hash table works.",
    "def quicksort(items):",
    "The three most important ideas in distributed systems are",
    "Translate to French: the weather is nice today.",
    "List five uses for a paperclip:",
    "import numpy as np\n\n# compute the moving average",
    "Once upon a time in a small village,",
    "Summarize the plot of a detective novel.",
    "class LRUCache:\n    def __init__(self, capacity):",
]


@dataclass
class RequestResult:
    ok: bool
    tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    gaps: list[float] = field(default_factory=list)


@dataclass
class LevelResult:
    server: str
    users: int
    results: list[RequestResult]
    wall_s: float

    @property
    def ok(self) -> list[RequestResult]:
        return [r for r in self.results if r.ok]

    @property
    def tok_s(self) -> float:
        return sum(r.tokens for r in self.ok) / self.wall_s

    def pct(self, values: list[float], q: float) -> float:
        if not values:
            return float("nan")
        values = sorted(values)
        return values[min(len(values) - 1, round(q * (len(values) - 1)))]


async def _one(
    client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int
) -> RequestResult:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.8,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    res = RequestResult(ok=False)
    last = None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    res.tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    now = time.perf_counter()
                    if last is None:
                        res.ttft = now - start
                    else:
                        res.gaps.append(now - last)
                    last = now
        res.e2e = time.perf_counter() - start
        res.ok = res.tokens == max_tokens
    except (httpx.HTTPError, json.JSONDecodeError):
        pass
    return res


async def _level(
    url: str, model: str, users: int, per_user: int, max_tokens: int
) -> tuple[list[RequestResult], float]:
    limits = httpx.Limits(max_connections=users + 4, max_keepalive_connections=users + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:

        async def user(u: int) -> list[RequestResult]:
            return [
                await _one(client, url, model, PROMPTS[(u + k) % len(PROMPTS)], max_tokens)
                for k in range(per_user)
            ]

        start = time.perf_counter()
        per = await asyncio.gather(*(user(u) for u in range(users)))
        return [r for rs in per for r in rs], time.perf_counter() - start


def _model_of(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]


def measure(
    name: str, url: str, levels: list[int], per_user: int, max_tokens: int
) -> list[LevelResult]:
    model = _model_of(url)
    asyncio.run(_level(url, model, 2, 1, 8))  # warm-up
    out = []
    for users in levels:
        results, wall = asyncio.run(_level(url, model, users, per_user, max_tokens))
        lr = LevelResult(name, users, results, wall)
        print(
            f"  {name:>28} {users:>3} users: {lr.tok_s:7.1f} tok/s, "
            f"{len(lr.ok)}/{len(results)} ok, TTFT p50 {lr.pct([r.ttft for r in lr.ok], 0.5):.3f} s",
            flush=True,
        )
        out.append(lr)
    return out


# -- servers this command starts ------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(proc: subprocess.Popen[bytes], url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/v1/models", timeout=5).status_code == 200:
                return
        time.sleep(1)
    raise RuntimeError(f"{url} not ready after {timeout:.0f} s")


@contextlib.contextmanager
def _process(
    cmd: list[str], url: str, env: dict[str, str], log: Path, timeout: float
) -> Iterator[str]:
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            _wait_ready(proc, url, timeout)
            yield url
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(90)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(10)


def pagefleet_server(
    config: dict, workdir: Path, tag: str
) -> contextlib.AbstractContextManager[str]:
    port = _free_port()
    path = workdir / f"pagefleet-{tag}.yaml"
    path.write_text(yaml.safe_dump({**config, "port": port, "host": "127.0.0.1"}))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    cmd = [sys.executable, "-m", "pagefleet.cluster.cli", "serve", str(path)]
    return _process(cmd, f"http://127.0.0.1:{port}", env, workdir / f"pagefleet-{tag}.log", 300)


def vllm_server(
    python: str, model: str, workdir: Path, dtype: str
) -> contextlib.AbstractContextManager[str]:
    port = _free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "2"}
    cmd = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--max-model-len",
        "512",
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--dtype",
        dtype,
        "--served-model-name",
        Path(model).name,
    ]
    return _process(cmd, f"http://127.0.0.1:{port}", env, workdir / "vllm.log", 600)


# -- report ----------------------------------------------------------------------------


def _plot(all_levels: list[LevelResult], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for server in dict.fromkeys(lr.server for lr in all_levels):
        rows = [lr for lr in all_levels if lr.server == server]
        users = [lr.users for lr in rows]
        axes[0].plot(users, [lr.tok_s for lr in rows], marker="o", label=server)
        axes[1].plot(
            users, [lr.pct([r.ttft for r in lr.ok], 0.5) for lr in rows], marker="o", label=server
        )
        axes[2].plot(
            users,
            [lr.pct([g for r in lr.ok for g in r.gaps], 0.5) * 1000 for lr in rows],
            marker="o",
            label=server,
        )
    for ax, title in zip(
        axes, ["output tokens/s", "TTFT p50 (s)", "inter-token latency p50 (ms)"], strict=True
    ):
        ax.set_xlabel("concurrent users")
        ax.set_title(title)
        ax.set_xscale("log")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(Path(out).with_suffix(".png"), dpi=110)


def report(all_levels: list[LevelResult], args: argparse.Namespace, notes: list[str]) -> Path:
    header = [
        "server",
        "users",
        "success",
        "output tok/s",
        "TTFT p50 (s)",
        "TTFT p99 (s)",
        "ITL p50 (ms)",
        "ITL p99 (ms)",
        "e2e p50 (s)",
        "e2e p99 (s)",
    ]
    rows = []
    for lr in all_levels:
        ok = lr.ok
        ttft = [r.ttft for r in ok]
        gaps = [g for r in ok for g in r.gaps]
        e2e = [r.e2e for r in ok]
        rows.append(
            [
                lr.server,
                lr.users,
                f"{len(ok)}/{len(lr.results)}",
                f"{lr.tok_s:.1f}",
                f"{lr.pct(ttft, 0.5):.3f}",
                f"{lr.pct(ttft, 0.99):.3f}",
                f"{lr.pct(gaps, 0.5) * 1000:.1f}",
                f"{lr.pct(gaps, 0.99) * 1000:.1f}",
                f"{lr.pct(e2e, 0.5):.2f}",
                f"{lr.pct(e2e, 0.99):.2f}",
            ]
        )
    summary = []
    servers = list(dict.fromkeys(lr.server for lr in all_levels))
    by = {(lr.server, lr.users): lr for lr in all_levels}
    for s in servers:
        lo, hi = by.get((s, 1)), by.get((s, 20))
        if lo and hi and lo.tok_s > 0:
            summary.append(
                f"- {s}: 1 -> 20 users throughput factor **{hi.tok_s / lo.tok_s:.1f}x** "
                f"({lo.tok_s:.1f} -> {hi.tok_s:.1f} tok/s)"
            )
    vllm = [s for s in servers if "vllm" in s]
    for s in servers:
        if s in vllm or not vllm:
            continue
        for v in vllm:
            a, b = by.get((s, 20)), by.get((v, 20))
            if a and b and b.tok_s > 0:
                summary.append(f"- at 20 users {s} / {v}: **{a.tok_s / b.tok_s:.2f}x**")
    body = (
        f"{args.requests_per_user} streaming requests per user, max_tokens {args.max_tokens}, "
        "ignore_eos; prompts: 10 short texts. Servers run one after another in this run.\n\n"
        + "\n".join(notes)
        + "\n\n"
        + markdown_table(header, rows)
        + "\n\n"
        + "\n".join(summary)
    )
    _plot(all_levels, args.out)
    return write_report(args.out, "Serving load test (OpenAI streaming completions)", body)


def run(args: argparse.Namespace) -> int:
    levels = [int(x) for x in args.concurrency.split(",")]
    names = args.name or []
    all_levels: list[LevelResult] = []
    notes: list[str] = []
    workdir = Path(tempfile.mkdtemp(prefix="pagefleet-bench-serve-"))
    try:
        for i, url in enumerate(args.url or []):
            name = names[i] if i < len(names) else url
            print(f"measuring {name} at {url}", flush=True)
            all_levels += measure(
                name, url.rstrip("/"), levels, args.requests_per_user, args.max_tokens
            )
        configs: list[tuple[str, dict]] = []
        model_dir = None
        if args.config:
            from ..config import load_config

            config = load_config(args.config)
            if not Path(config.model).is_dir() and config.make_model:
                from ..make_model import make_model

                make_model(config.model, preset=config.make_model)
            model_dir = config.model
            base = config.model_dump()
            if args.sweep:
                key, _, values = args.sweep.partition("=")
                for v in values.split(","):
                    engine = {**base["engine"], key: int(v)}
                    configs.append((f"pagefleet {key}={v}", {**base, "engine": engine}))
            else:
                configs.append(("pagefleet", base))
            notes.append(
                f"pagefleet config: `{args.config}` ({config.engine.dtype}, "
                f"{config.replicas} replica(s), max_num_seqs {config.engine.max_num_seqs})"
            )
        for tag, (name, cfg) in enumerate(configs):
            print(f"starting {name} ...", flush=True)
            with pagefleet_server(cfg, workdir, str(tag)) as url:
                all_levels += measure(name, url, levels, args.requests_per_user, args.max_tokens)
        if args.vllm_python:
            model = args.vllm_model or model_dir
            if model is None:
                raise SystemExit("--vllm-python needs --vllm-model or --config")
            print("starting vllm serve (vLLM's CPU build) ...", flush=True)
            with vllm_server(args.vllm_python, model, workdir, args.vllm_dtype) as url:
                all_levels += measure(
                    "vllm serve (CPU build)", url, levels, args.requests_per_user, args.max_tokens
                )
            notes.append(
                f"vLLM: `{args.vllm_python} -m vllm.entrypoints.openai.api_server --model "
                f"{model} --max-model-len 512 --dtype {args.vllm_dtype}`, VLLM_CPU_KVCACHE_SPACE=2"
            )
        if not all_levels:
            raise SystemExit("nothing to measure: give --url, --config or --vllm-python")
        path = report(all_levels, args, notes)
        print(path.read_text())
        return 0
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="load test of OpenAI-compatible servers (seed article)")
    p.add_argument("--url", action="append", help="a running server (repeatable)")
    p.add_argument("--name", action="append", help="a label per --url, in order")
    p.add_argument("--config", help="serve this pagefleet config and measure it")
    p.add_argument(
        "--sweep", help="KEY=V1,V2: rerun --config per engine setting, e.g. max_num_seqs=8,256"
    )
    p.add_argument(
        "--vllm-python", help="python of a venv with vLLM's CPU build: start and measure it"
    )
    p.add_argument("--vllm-model", help="checkpoint for vLLM (default: the --config model)")
    p.add_argument("--vllm-dtype", default="float32")
    p.add_argument("--concurrency", default="1,5,10,20,50")
    p.add_argument("--requests-per-user", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=50)
    p.add_argument("--out", default="benchmarks/results/serve")
