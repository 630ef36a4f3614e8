"""`pagefleet-lab paired`: pagefleet and vLLM's CPU build, both started once and then
taking turns, round by round, on the same loads.

Why. On a shared host the same engine's throughput moves 20-35% between runs minutes
apart (BENCHMARKS.md, "After the flush-to-zero fix"), which is as large as the gap to be
measured; `bench offline` runs one system after the other, so each ratio compares two
different stretches of the host's noise. Here both engines stay up (each in its own
process, started one after the other, idle while the other computes) and every round
runs each load on both, back to back, the order flipping every round: a slow stretch
of the host hits both sides of a round, and the ratio per round, then its median over
the rounds, is the figure. Each engine's first pass over each load is untimed (a warm-up
of its shapes), as `bench offline`'s children warm up. The pairing holds only while the
idle engine sleeps, as both do at their defaults: one whose OpenMP threads spin while it
waits (`OMP_WAIT_POLICY=ACTIVE`) takes the cores from the other (BENCHMARKS.md).

Both engines as in `bench offline` (`offline.PAGEFLEET_ENGINE`, `offline.VLLM_ENGINE`):
greedy, EOS ignored, prefix caching off, the same KV cache size and compute threads,
vLLM at its defaults (compiled), pagefleet compiled unless `--eager`.

Protocol. Each child gets two pipes: it writes one JSON line when its engine is up
(start-up seconds, version), then for each command line (`{"load": i}`) one result line
(tokens, seconds, its process tree's peak RSS so far). Closing its command pipe ends it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from tqdm.auto import tqdm

from pagefleet.bench.checkpoint import ensure_model
from pagefleet.bench.machine import LoadMonitor, machine_description
from pagefleet.bench.offline import (
    PAGEFLEET_ENGINE,
    PEAK_RSS,
    VLLM_ENGINE,
    Load,
    checkpoint_shape,
    child_spec,
)
from pagefleet.bench.report import markdown_table, pyplot, save_png, write_report
from pagefleet.bench.vllm_child import describe_vllm_threads, vllm_env, vllm_thread_env

_ROUNDS_MAIN = textwrap.dedent(
    """
    import os

    def main(model, dtype, spec_path, cmd_fd, res_fd):
        rss = PeakRss()
        spec = json.load(open(spec_path))
        commands, results = os.fdopen(int(cmd_fd)), os.fdopen(int(res_fd), "w")
        start = time.perf_counter()
        run, info = make_engine(model, dtype, spec)
        info["startup_s"] = time.perf_counter() - start
        results.write(json.dumps(info) + "\\n")
        results.flush()
        for line in commands:
            load = spec["loads"][json.loads(line)["load"]]
            start = time.perf_counter()
            tokens = run(load["prompts"], load["new"])
            seconds = time.perf_counter() - start
            results.write(json.dumps({"tokens": tokens, "seconds": seconds,
                                      "peak_rss": rss.peak}) + "\\n")
            results.flush()

    if __name__ == "__main__":
        main(*sys.argv[1:6])
    """
)
PAGEFLEET = "pagefleet"
VLLM = "vLLM"


class _Engine:
    """One engine's child process, driven through its two pipes."""

    def __init__(
        self,
        name: str,
        python: str,
        code: str,
        spec_path: Path,
        model: str,
        dtype: str,
        env: dict[str, str],
    ) -> None:
        self.name = name
        child = spec_path.with_name(f"{name}_child.py")
        child.write_text(code)
        cmd_r, self._cmd_w = os.pipe()
        self._res_r, res_w = os.pipe()
        self.proc = subprocess.Popen(
            [python, str(child), model, dtype, str(spec_path), str(cmd_r), str(res_w)],
            env=env,
            cwd=spec_path.parent,
            pass_fds=(cmd_r, res_w),
        )
        os.close(cmd_r)
        os.close(res_w)
        self._commands: IO[str] = os.fdopen(self._cmd_w, "w")
        self._results: IO[str] = os.fdopen(self._res_r)
        self.info = self._read()

    def _read(self) -> dict[str, Any]:
        line = self._results.readline()
        if not line:
            code = self.proc.wait()
            raise SystemExit(f"bench paired: the {self.name} child ended (exit code {code})")
        return json.loads(line)

    def run(self, load: int) -> dict[str, Any]:
        self._commands.write(json.dumps({"load": load}) + "\n")
        self._commands.flush()
        return self._read()

    def close(self) -> None:
        self._commands.close()
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._results.close()


@dataclass(frozen=True)
class Turn:
    """One engine's run of one load in one round."""

    round: int
    load: str
    system: str
    tokens: int
    seconds: float

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


def ratios(turns: list[Turn], load: str) -> list[float]:
    """pagefleet / vLLM tok/s of each round of `load`, in round order."""
    by = {(t.round, t.system): t for t in turns if t.load == load}
    rounds = sorted({r for r, _ in by})
    return [by[r, PAGEFLEET].tok_s / by[r, VLLM].tok_s for r in rounds]


def _env_pairs(items: list[str]) -> dict[str, str]:
    """`--pagefleet-env KEY=VALUE` items as a dict."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--pagefleet-env wants KEY=VALUE, got {item!r}")
        out[key] = value
    return out


def run(args: argparse.Namespace) -> int:
    if args.rounds < 1:
        raise SystemExit("--rounds must be >= 1")
    model_dir, _ = ensure_model(args.model, "smollm-135m")
    model_dir = str(Path(model_dir).resolve())
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    loads = [Load.parse(spec) for spec in args.loads.split(",")]
    spec = child_spec(tokenizer, loads, args) | {"eager": args.eager}
    turns: list[Turn] = []
    with tempfile.TemporaryDirectory() as tmp, LoadMonitor() as monitor:
        spec_path = Path(tmp, "spec.json")
        spec_path.write_text(json.dumps(spec))
        print("bench paired: starting pagefleet, then vLLM (minutes: both compile) ...")
        engines = [
            _Engine(
                PAGEFLEET,
                sys.executable,
                PEAK_RSS + PAGEFLEET_ENGINE + _ROUNDS_MAIN,
                spec_path,
                model_dir,
                args.dtype,
                dict(os.environ) | _env_pairs(args.pagefleet_env),
            )
        ]
        try:
            engines.append(
                _Engine(
                    VLLM,
                    args.vllm_python,
                    PEAK_RSS + VLLM_ENGINE + _ROUNDS_MAIN,
                    spec_path,
                    model_dir,
                    args.dtype,
                    vllm_env(args.threads, args.kv_gib),
                )
            )
            for engine in engines:  # untimed: each load's shapes once
                for i in range(len(loads)):
                    engine.run(i)
            bar = tqdm(total=args.rounds * len(loads) * 2, desc="bench paired", unit="run")
            for r in range(args.rounds):
                order = engines if r % 2 == 0 else engines[::-1]
                for i, load in enumerate(loads):
                    for engine in order:
                        got = engine.run(i)
                        turns.append(Turn(r, str(load), engine.name, got["tokens"], got["seconds"]))
                        engine.info["peak_rss"] = got["peak_rss"]
                        bar.update(1)
            bar.close()
        finally:
            for engine in engines:
                engine.close()
    info = {e.name: e.info for e in engines}
    body = _report(turns, loads, info, args, monitor.summary())
    print(body)
    _plot(turns, loads, Path(args.out).with_suffix(".png"), args)
    Path(args.out).with_suffix(".json").write_text(
        json.dumps(
            {
                "args": {k: v for k, v in vars(args).items() if not callable(v)},
                "engines": info,
                "turns": [t.__dict__ for t in turns],
            },
            indent=1,
        )
    )
    path = write_report(args.out, "pagefleet and vLLM, round by round", body)
    print(f"\nwrote {path}")
    return 0


def _shape(model: str) -> str:
    """make-model's preset and arch, or config.json's architecture ("shape unknown" without)."""
    try:
        return checkpoint_shape(model)
    except FileNotFoundError:
        return "shape unknown"


def _report(
    turns: list[Turn],
    loads: list[Load],
    info: dict[str, dict],
    args: argparse.Namespace,
    load_summary: str,
) -> str:
    mode = "eager (`enforce_eager=True`)" if args.eager else "compiled (its default)"
    text = (
        f"Checkpoint `{args.model}` ({_shape(args.model)}), {args.dtype}, {args.threads} "
        f"compute thread(s) each, greedy, EOS ignored, prefix caching off, max_model_len "
        f"{args.max_model_len}, KV cache {args.kv_gib:g} GiB each. pagefleet {mode}; vLLM "
        f"{info[VLLM].get('version')} at its defaults (compiled), "
        f"{describe_vllm_threads(vllm_thread_env(args.threads))}. "
        + (
            f"pagefleet's environment adds {' '.join(args.pagefleet_env)}. "
            if args.pagefleet_env
            else ""
        )
        + f"{args.rounds} rounds, "
        "each load on both engines back to back, the order flipping every round "
        f"(module docstring). {machine_description()} {load_summary}\n\n"
    )
    header = ["load", "round", "first", "pagefleet tok/s", "vLLM tok/s", "pagefleet / vLLM"]
    rows: list[list[object]] = []
    summary: list[list[object]] = []
    for load in loads:
        name = str(load)
        by = {(t.round, t.system): t for t in turns if t.load == name}
        rs = ratios(turns, name)
        for r in range(args.rounds):
            first = PAGEFLEET if r % 2 == 0 else VLLM
            rows.append(
                [
                    name,
                    r,
                    first,
                    f"{by[r, PAGEFLEET].tok_s:.1f}",
                    f"{by[r, VLLM].tok_s:.1f}",
                    f"{rs[r]:.3f}x",
                ]
            )
        summary.append(
            [
                name,
                f"**{statistics.median(rs):.3f}x**",
                f"{min(rs):.3f}-{max(rs):.3f}x",
                sum(r >= 1.0 for r in rs),
            ]
        )
    text += "Median ratio over the rounds (pagefleet / vLLM tok/s):\n\n"
    text += markdown_table(["load", "median", "range", "rounds pagefleet ahead"], summary)
    text += "\n\n" + markdown_table(header, rows) + "\n\n"
    text += markdown_table(
        ["engine", "start-up s (compilation included)", "peak RSS GiB (process tree)"],
        [
            [name, f"{i['startup_s']:.1f}", f"{i.get('peak_rss', 0) / 2**30:.2f}"]
            for name, i in info.items()
        ],
    )
    return text


def _plot(turns: list[Turn], loads: list[Load], path: Path, args: argparse.Namespace) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for load in loads:
        rs = ratios(turns, str(load))
        ax.plot(
            range(len(rs)), rs, marker="o", label=f"{load} (median {statistics.median(rs):.3f}x)"
        )
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(args.rounds))
    ax.set_xlabel("round (even: pagefleet first)")
    ax.set_ylabel("pagefleet / vLLM tok/s")
    ax.set_title(f"pagefleet vs vLLM round by round ({args.dtype}, {args.threads} thread(s))")
    ax.legend(fontsize=8)
    save_png(fig, path, 110)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "paired", help="pagefleet vs vLLM's CPU build, both up, taking turns round by round"
    )
    p.add_argument("--vllm-python", required=True, help="python of a venv with vLLM's CPU build")
    p.add_argument(
        "--model", default="models/smollm-135m", help="created if missing (smollm-135m preset)"
    )
    p.add_argument("--dtype", default="float32")
    p.add_argument("--loads", default="20x50,16x64@1200", help="as bench offline's --loads")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-gib", type=float, default=2.0)
    p.add_argument("--eager", action="store_true", help="pagefleet with enforce_eager=True")
    p.add_argument(
        "--pagefleet-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an environment variable for pagefleet's process only (repeatable), "
        "e.g. an OpenMP setting to compare",
    )
    p.add_argument("--out", default="benchmarks/results/paired")
