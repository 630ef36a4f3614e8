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
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .client import RequestResult, closed_loop, model_id
from .launcher import exit_on_signals, free_port, launch, pagefleet_serve, served_config
from .report import markdown_table, pyplot, save_png, write_report
from .stats import percentile
from .vllm_child import api_server_command, vllm_env
from .workloads import BenchRequest

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


def _level(
    url: str, model: str, users: int, per_user: int, max_tokens: int
) -> tuple[list[RequestResult], float]:
    """`users` users, each sending `per_user` streamed completions back to back."""
    reqs = [
        [BenchRequest(PROMPTS[(u + k) % len(PROMPTS)], max_tokens) for k in range(per_user)]
        for u in range(users)
    ]
    return asyncio.run(closed_loop(url, model, reqs, [0.0] * users, timeout_s=600.0))


def measure(
    name: str, url: str, levels: list[int], per_user: int, max_tokens: int
) -> list[LevelResult]:
    model = model_id(url)
    _level(url, model, 2, 1, 8)  # warm-up
    out = []
    for users in levels:
        results, wall = _level(url, model, users, per_user, max_tokens)
        lr = LevelResult(name, users, results, wall)
        print(
            f"  {name:>28} {users:>3} users: {lr.tok_s:7.1f} tok/s, "
            f"{len(lr.ok)}/{len(results)} ok, TTFT p50 {percentile([r.ttft for r in lr.ok], 0.5):.3f} s",
            flush=True,
        )
        out.append(lr)
    return out


# -- report ----------------------------------------------------------------------------


def _plot(all_levels: list[LevelResult], out: str) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for server in dict.fromkeys(lr.server for lr in all_levels):
        rows = [lr for lr in all_levels if lr.server == server]
        users = [lr.users for lr in rows]
        axes[0].plot(users, [lr.tok_s for lr in rows], marker="o", label=server)
        axes[1].plot(
            users,
            [percentile([r.ttft for r in lr.ok], 0.5) for lr in rows],
            marker="o",
            label=server,
        )
        axes[2].plot(
            users,
            [percentile([g for r in lr.ok for g in r.gaps], 0.5) * 1000 for lr in rows],
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
    save_png(fig, out, 110)


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
                f"{percentile(ttft, 0.5):.3f}",
                f"{percentile(ttft, 0.99):.3f}",
                f"{percentile(gaps, 0.5) * 1000:.1f}",
                f"{percentile(gaps, 0.99) * 1000:.1f}",
                f"{percentile(e2e, 0.5):.2f}",
                f"{percentile(e2e, 0.99):.2f}",
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


def _configs(args: argparse.Namespace) -> tuple[list[tuple[str, dict]], str | None, str]:
    """(name, config) per `--sweep` value of `--config` (or the config alone), its
    checkpoint, and the report's note on it."""
    if not args.config:
        return [], None, ""
    config, base = served_config(args.config)
    if not Path(config.model).is_dir() and config.make_model:
        from ..make_model import make_model

        make_model(config.model, preset=config.make_model)
    configs = [("pagefleet", base)]
    if args.sweep:
        key, _, values = args.sweep.partition("=")
        configs = [
            (f"pagefleet {key}={v}", {**base, "engine": {**base["engine"], key: int(v)}})
            for v in values.split(",")
        ]
    note = (
        f"pagefleet config: `{args.config}` ({config.engine.dtype}, "
        f"{config.replicas} replica(s), max_num_seqs {config.engine.max_num_seqs})"
    )
    return configs, config.model, note


def _measure_vllm(
    args: argparse.Namespace, model: str, workdir: Path, levels: list[int]
) -> tuple[list[LevelResult], str]:
    """vLLM's API server (its CPU build, `--vllm-python`) on `model`: (levels, note)."""
    port = free_port()
    cmd = api_server_command(args.vllm_python, model, port, args.vllm_dtype)
    print("starting vllm serve (vLLM's CPU build) ...", flush=True)
    url = f"http://127.0.0.1:{port}"
    with launch(cmd, url, workdir / "vllm.log", vllm_env(), 600) as server:
        name = "vllm serve (CPU build)"
        got = measure(name, server.url, levels, args.requests_per_user, args.max_tokens)
    note = (
        f"vLLM: `{args.vllm_python} -m vllm.entrypoints.openai.api_server --model "
        f"{model} --max-model-len 512 --dtype {args.vllm_dtype}`, VLLM_CPU_KVCACHE_SPACE=2"
    )
    return got, note


def run(args: argparse.Namespace) -> int:
    exit_on_signals()
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
        configs, model_dir, note = _configs(args)
        notes += [note] if note else []
        for tag, (name, cfg) in enumerate(configs):
            print(f"starting {name} ...", flush=True)
            with pagefleet_serve(cfg, workdir, f"pagefleet-{tag}", timeout_s=300) as server:
                all_levels += measure(
                    name, server.url, levels, args.requests_per_user, args.max_tokens
                )
        if args.vllm_python:
            model = args.vllm_model or model_dir
            if model is None:
                raise SystemExit("--vllm-python needs --vllm-model or --config")
            got, note = _measure_vllm(args, model, workdir, levels)
            all_levels += got
            notes.append(note)
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
