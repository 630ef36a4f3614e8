"""`pagefleet bench offline`: LLM.generate against transformers (and, with
`--vllm-python`, vLLM's CPU build), side by side in one run.

Every system generates exactly N new tokens per request (EOS ignored), greedy,
on the same prompts: of 5-11 tokens, or of exactly P tokens for a load written
`NxNEW@P` (`16x64@1200`: 16 prompts of 1,200 tokens, 64 new tokens each).
Throughput is new tokens over wall time; ratios are to transformers'
continuous batching (`generate_batch`) in fp32 on the same load, and to
vLLM's `LLM.generate` in the same dtype, measured in this same run.

pagefleet runs once per `--pagefleet-modes` entry (`compiled`: its default,
torch.compile at start-up; `eager`: `enforce_eager=True`), each in a child
process of this python, and vLLM in a child with its own python (it pins
other versions of our dependencies), one after the other, so no two systems
share the cores. Each child reports its start-up time (constructing `LLM`,
compilation included) and its peak resident memory, summed over its process
tree (vLLM runs its engine core in a second process), sampled every 50 ms.
Both get the same KV cache size (`--kv-gib`, vLLM's VLLM_CPU_KVCACHE_SPACE),
prefix caching off, and the same number of compute threads.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from pagefleet.bench.checkpoint import ensure_model
from pagefleet.bench.machine import machine_description
from pagefleet.bench.report import markdown_table, pyplot, save_png, write_report
from pagefleet.bench.vllm_child import (
    describe_vllm_threads,
    run_child,
    run_vllm_child,
    vllm_thread_env,
)

_TEXT = (
    "def parse(args):\n    options = {}\n    for item in args:\n        key, _, value = item.partition('=')\n"
    "import collections.abc\nclass Registry(dict):\n    'A mapping of names to handlers.'\n"
)
BASELINE = "transformers continuous batching"
VLLM = "vLLM CPU build LLM.generate"

# Both children sample their process tree's resident memory in a thread.
PEAK_RSS = """
import threading, psutil

class PeakRss:
    def __init__(self):
        self.peak = 0
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        me = psutil.Process()
        while True:
            try:
                total = me.memory_info().rss + sum(
                    c.memory_info().rss for c in me.children(recursive=True))
            except psutil.Error:
                total = 0
            self.peak = max(self.peak, total)
            threading.Event().wait(0.05)
"""

# The vLLM side: standalone, run by the vLLM environment's python. `make_engine` builds
# one engine and warms it up; `run(prompts, new)` generates and returns the new tokens.
VLLM_ENGINE = textwrap.dedent(
    """
    import json, sys, time

    def make_engine(model, dtype, spec):
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        llm = LLM(model=model, dtype=dtype, max_model_len=spec["max_model_len"], seed=0,
                  enable_prefix_caching=False)

        def run(prompts, new):
            params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
            res = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                               use_tqdm=False)
            return sum(len(r.outputs[0].token_ids) for r in res)

        run(spec["warm"], 4)
        return run, {"version": __import__("vllm").__version__}
    """
)

# The pagefleet side, in a child of this python: the same two calls.
PAGEFLEET_ENGINE = textwrap.dedent(
    """
    import json, sys, time

    def make_engine(model, dtype, spec):
        import torch
        torch.set_num_threads(spec["threads"])
        from pagefleet.engine import LLM, SamplingParams

        llm = LLM(model=model, dtype=dtype, max_num_seqs=spec["max_seqs"],
                  max_model_len=spec["max_model_len"],
                  kv_cache_memory_bytes=spec["kv_bytes"], enable_prefix_caching=False,
                  enforce_eager=spec["eager"], num_threads=spec["threads"])

        def run(prompts, new):
            params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                use_tqdm=False)
            llm.check_block_accounting()
            return sum(len(o.outputs[0].token_ids) for o in outs)

        run(spec["warm"], 4)
        return run, {}
    """
)

# Either engine's child for `bench offline`: start-up (imports, weights, compilation and
# the warm-up, timed), then each load once, and for pagefleet the one-at-a-time runs.
_OFFLINE_MAIN = textwrap.dedent(
    """
    def main(model, dtype, spec_path, out_path):
        rss = PeakRss()
        spec = json.load(open(spec_path))
        start = time.perf_counter()
        run, info = make_engine(model, dtype, spec)
        startup = time.perf_counter() - start
        out = []
        for load in spec["loads"]:
            start = time.perf_counter()
            tokens = run(load["prompts"], load["new"])
            out.append({"tokens": tokens, "seconds": time.perf_counter() - start})
        single = []
        for load in spec.get("one_at_a_time", []):
            start = time.perf_counter()
            tokens = sum(run([p], load["new"]) for p in load["prompts"])
            single.append({"tokens": tokens, "seconds": time.perf_counter() - start})
        json.dump(info | {"runs": out, "one_at_a_time": single, "startup_s": startup,
                          "peak_rss": rss.peak}, open(out_path, "w"))

    if __name__ == "__main__":
        main(*sys.argv[1:5])
    """
)
_VLLM_CHILD = PEAK_RSS + VLLM_ENGINE + _OFFLINE_MAIN
_PAGEFLEET_CHILD = PEAK_RSS + PAGEFLEET_ENGINE + _OFFLINE_MAIN


@dataclass
class Result:
    system: str
    dtype: str
    load: str
    tokens: int
    seconds: float
    note: str = ""
    startup_s: float | None = None
    peak_rss: int | None = None  # bytes, over the system's process tree

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


def make_prompts(tokenizer, count: int, length: int | None = None) -> list[list[int]]:
    """Prompts of 5-11 tokens (or of exactly `length`), cut from one text at different
    offsets (a long prompt: from the text repeated, each starting elsewhere)."""
    ids = tokenizer.encode(_TEXT)
    prompts = []
    for i in range(count):
        if length is not None:
            reps = -(-(length + i * 3) // len(ids)) + 1
            prompts.append((ids * reps)[i * 3 : i * 3 + length])
            continue
        size = 5 + i % 7
        start = (i * 3) % (len(ids) - size)
        prompts.append(ids[start : start + size])
    return prompts


@dataclass(frozen=True)
class Load:
    """`NxNEW` (prompts of 5-11 tokens) or `NxNEW@P` (prompts of P tokens)."""

    requests: int
    new: int
    prompt_len: int | None = None

    @classmethod
    def parse(cls, spec: str) -> Load:
        head, _, plen = spec.partition("@")
        n, new = (int(x) for x in head.split("x"))
        return cls(n, new, int(plen) if plen else None)

    def __str__(self) -> str:
        return f"{self.requests}x{self.new}" + (f"@{self.prompt_len}" if self.prompt_len else "")

    def prompts(self, tokenizer) -> list[list[int]]:
        return make_prompts(tokenizer, self.requests, self.prompt_len)


def _timed(fn: Callable[..., int], *fn_args: object) -> tuple[int, float]:
    start = time.perf_counter()
    tokens = fn(*fn_args)
    return tokens, time.perf_counter() - start


class _Transformers:
    """The three ways transformers generates, each exactly `new` tokens per request."""

    def __init__(self, model_dir: str, dtype: torch.dtype) -> None:
        from transformers import AutoModelForCausalLM, GenerationConfig

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        self._gen_config = GenerationConfig

    def one_at_a_time(self, prompts: list[list[int]], new: int) -> int:
        total = 0
        with torch.inference_mode():
            for p in prompts:
                out = self.model.generate(
                    torch.tensor([p]),
                    attention_mask=torch.ones(1, len(p), dtype=torch.long),
                    max_new_tokens=new,
                    min_new_tokens=new,
                    do_sample=False,
                    pad_token_id=0,
                )
                total += out.shape[1] - len(p)
        return total

    def static_batch(self, prompts: list[list[int]], new: int, batch: int = 8) -> int:
        total = 0
        with torch.inference_mode():
            for i in range(0, len(prompts), batch):
                group = prompts[i : i + batch]
                width = max(len(p) for p in group)
                ids = torch.tensor([[0] * (width - len(p)) + p for p in group])
                mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
                out = self.model.generate(
                    ids,
                    attention_mask=mask,
                    max_new_tokens=new,
                    min_new_tokens=new,
                    do_sample=False,
                    pad_token_id=0,
                )
                total += (out.shape[1] - width) * len(group)
        return total

    def continuous(self, prompts: list[list[int]], new: int, warmup: bool = False) -> int:
        config = self._gen_config(
            max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0
        )
        with torch.inference_mode():
            res = self.model.generate_batch(
                inputs=prompts, generation_config=config, progress_bar=False, warmup=warmup
            )
        return sum(len(r.generated_tokens) for r in res.values())


def pagefleet_system(mode: str) -> str:
    return f"pagefleet LLM.generate ({mode})"


def _one_at_a_time_system(mode: str) -> str:
    return f"pagefleet one at a time ({mode})"


def skipped(system: str, skip: set[str], sequential_cap: int) -> bool:
    """Whether `--skip` leaves `system` out: an entry names a system whole or its leading
    words ("transformers" is all three of transformers' runs, "pagefleet one at a time"
    both modes'). A `--sequential-cap` of 0 leaves out every one-at-a-time run."""
    if sequential_cap <= 0 and " one at a time" in system:
        return True
    return any(system == s or system.startswith(f"{s} ") for s in skip)


def child_spec(tokenizer, loads: list[Load], args: argparse.Namespace) -> dict:
    """What either engine's child reads: the warm-up, the loads and the engine settings."""
    return {
        "warm": make_prompts(tokenizer, 4),
        "loads": [{"prompts": load.prompts(tokenizer), "new": load.new} for load in loads],
        "max_model_len": args.max_model_len,
        "max_seqs": max(load.requests for load in loads),
        "kv_bytes": int(args.kv_gib * 2**30),
        "threads": args.threads,
    }


def _child_results(system: str, dtype: str, loads: list[Load], got: dict) -> list[Result]:
    """One Result per load from a child process's report (its runs, start-up, peak RSS)."""
    return [
        Result(
            system,
            dtype,
            str(load),
            r["tokens"],
            r["seconds"],
            "",
            got["startup_s"],
            got["peak_rss"],
        )
        for load, r in zip(loads, got["runs"], strict=True)
    ]


def run_pagefleet(
    model_dir: str,
    dtype: str,
    tokenizer,
    loads: list[Load],
    mode: str,
    args: argparse.Namespace,
    one_at_a_time: bool,
) -> list[Result]:
    """pagefleet's LLM.generate in a child process of this python, `mode` "compiled" or
    "eager"; with `one_at_a_time`, also the first `--sequential-cap` requests of each load
    one by one."""
    spec = child_spec(tokenizer, loads, args) | {"eager": mode == "eager"}
    spec["one_at_a_time"] = [
        {"prompts": load.prompts(tokenizer)[: args.sequential_cap], "new": load.new}
        for load in (loads if one_at_a_time else [])
    ]
    got = run_child(sys.executable, _PAGEFLEET_CHILD, spec, model_dir, dtype, env=dict(os.environ))
    results = _child_results(pagefleet_system(mode), dtype, loads, got)
    for load, r in zip(loads, got["one_at_a_time"], strict=False):  # empty unless asked
        count = min(load.requests, args.sequential_cap)
        note = f"first {count} of {load.requests} requests" if count < load.requests else ""
        results.append(
            Result(_one_at_a_time_system(mode), dtype, str(load), r["tokens"], r["seconds"], note)
        )
    return results


def _run_transformers(
    model_dir: str,
    dtype: str,
    tokenizer,
    loads: list[Load],
    skip: set[str],
    sequential_cap: int,
    bar: tqdm,
) -> list[Result]:
    systems = [
        "transformers generate one at a time",
        "transformers static batch of 8",
        BASELINE,
    ]
    if all(skipped(system, skip, sequential_cap) for system in systems):
        return []
    hf = _Transformers(model_dir, getattr(torch, dtype))
    hf.continuous(make_prompts(tokenizer, 4), 4, warmup=True)
    results = []
    for load in loads:
        prompts = load.prompts(tokenizer)
        one_by_one = prompts[:sequential_cap]
        note = (
            f"first {len(one_by_one)} of {load.requests} requests"
            if len(one_by_one) < load.requests
            else ""
        )
        runs: list[tuple[str, Callable[..., int], tuple, str]] = [
            (systems[0], hf.one_at_a_time, (one_by_one, load.new), note),
            (systems[1], hf.static_batch, (prompts, load.new), ""),
            (BASELINE, hf.continuous, (prompts, load.new), ""),
        ]
        for system, fn, fn_args, why in runs:
            bar.set_postfix_str(f"{dtype} {load} {system}")
            if not skipped(system, skip, sequential_cap):
                tokens, secs = _timed(fn, *fn_args)
                results.append(Result(system, dtype, str(load), tokens, secs, why))
            bar.update(1)
    return results


def run_vllm(
    vllm_python: str,
    model_dir: str,
    dtype: str,
    tokenizer,
    loads: list[Load],
    args: argparse.Namespace,
) -> tuple[str, list[Result]]:
    """vLLM's LLM.generate on the same prompts and loads, with `args.threads` compute
    threads (`vllm_thread_env`): (its version, results)."""
    spec = child_spec(tokenizer, loads, args)
    model = str(Path(model_dir).resolve())
    got = run_vllm_child(
        vllm_python, _VLLM_CHILD, spec, model, dtype, threads=args.threads, kv_gib=args.kv_gib
    )
    results = _child_results(VLLM, dtype, loads, got)
    return got["version"], results


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    model_dir, _ = ensure_model(args.model, "smollm-135m")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    loads = [Load.parse(spec) for spec in args.loads.split(",")]
    dtypes = args.dtypes.split(",")
    modes = [m.strip() for m in args.pagefleet_modes.split(",") if m.strip()]
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    bar = tqdm(total=len(dtypes) * len(loads) * 3, desc="bench offline", unit="run")
    results: list[Result] = []
    for dtype in dtypes:
        for i, mode in enumerate(modes):
            bar.set_postfix_str(f"{dtype} pagefleet ({mode})")
            one = i == 0 and not skipped(_one_at_a_time_system(mode), skip, args.sequential_cap)
            results += run_pagefleet(model_dir, dtype, tokenizer, loads, mode, args, one)
        results += _run_transformers(
            model_dir, dtype, tokenizer, loads, skip, args.sequential_cap, bar
        )
        gc.collect()
    bar.close()
    args.vllm_version = None
    if args.vllm_python:
        for dtype in dtypes:
            print(f"bench offline: vLLM's CPU build, {dtype} (start-up ~60 s) ...", flush=True)
            args.vllm_version, theirs = run_vllm(
                args.vllm_python, model_dir, dtype, tokenizer, loads, args
            )
            results += theirs

    body = _report(results, loads, dtypes, args)
    print(body)
    _plot(results, Path(args.out).with_suffix(".png"), args.threads)
    path = write_report(args.out, "Offline throughput: pagefleet vs transformers and vLLM", body)
    Path(args.out).with_suffix(".json").write_text(
        json.dumps(
            {
                "threads": args.threads,
                "vllm": args.vllm_version,
                "cpu": machine_description(),
                "results": [asdict(r) | {"tok_s": r.tok_s} for r in results],
            },
            indent=1,
        )
    )
    print(f"\nwrote {path}")
    return 0


def checkpoint_shape(model_dir: str) -> str:
    """What the checkpoint is: make-model's preset and arch, or config.json's architecture."""
    marker = Path(model_dir) / "pagefleet_model.json"
    if marker.is_file():
        info = json.loads(marker.read_text())
        return f"make-model preset {info['preset']}, arch {info['arch']}"
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return ", ".join(config.get("architectures") or [config.get("model_type", "unknown")])


def _gib(n: int | None) -> str:
    return f"{n / 2**30:.2f}" if n else "-"


def _report(results: list[Result], loads, dtypes, args: argparse.Namespace) -> str:
    base = {r.load: r.tok_s for r in results if r.system == BASELINE and r.dtype == "float32"}
    vllm = {(r.load, r.dtype): r for r in results if r.system == VLLM}
    rows = []
    for r in results:
        theirs = vllm.get((r.load, r.dtype))
        rows.append(
            [
                r.system,
                r.dtype,
                r.load,
                r.tokens,
                f"{r.seconds:.1f}",
                f"{r.tok_s:.1f}",
                f"{r.tok_s / base[r.load]:.2f}x" if r.load in base else "-",
                f"{r.tok_s / theirs.tok_s:.2f}x" if theirs else "-",
                f"{r.startup_s:.1f}" if r.startup_s is not None else "-",
                _gib(r.peak_rss),
                r.note,
            ]
        )
    header = [
        "system",
        "dtype",
        "requests x new tokens [@ prompt tokens]",
        "tokens",
        "seconds",
        "tok/s",
        "vs transformers CB fp32",
        "vs vLLM same dtype",
        "start-up s",
        "peak RSS GiB",
        "note",
    ]
    info = (
        f"Checkpoint: `{args.model}` ({checkpoint_shape(args.model)}, seeded random weights), "
        f"{args.threads} compute threads each, greedy, EOS ignored, prefix caching off, "
        f"max_model_len {args.max_model_len}, KV cache {args.kv_gib:g} GiB each; prompts "
        "of 5-11 tokens unless the load says `@P` (P tokens). pagefleet: `compiled` is its "
        "default (torch.compile at start-up), `eager` is `enforce_eager=True`. Start-up: "
        "constructing `LLM` in a fresh process (imports, weights, compilation, warm-up). "
        "Peak RSS: resident memory summed over the system's processes, sampled every 50 ms. "
        f"{machine_description()}."
    )
    if getattr(args, "vllm_version", None):
        info += (
            f" vLLM: the CPU build {args.vllm_version} (`--vllm-python {args.vllm_python}`), "
            f"`LLM(dtype=..., max_model_len={args.max_model_len}, enable_prefix_caching=False)` "
            f"at its defaults otherwise (compiled, no enforce_eager), "
            f"VLLM_CPU_KVCACHE_SPACE={args.kv_gib:g}, the same threads "
            f"({describe_vllm_threads(vllm_thread_env(args.threads))})."
        )
    if vllm:
        head = []
        for r in results:
            theirs = vllm.get((r.load, r.dtype))
            if r.system.startswith("pagefleet LLM.generate") and theirs:
                mode = r.system.removeprefix("pagefleet LLM.generate ").strip("()")
                head.append(
                    f"{r.load} {r.dtype} {mode}: {r.tok_s:.1f} tok/s = "
                    f"{r.tok_s / theirs.tok_s:.2f}x vLLM ({theirs.tok_s:.1f})"
                )
        info = "Headline: " + "; ".join(head) + ".\n\n" + info
    return info + "\n\n" + markdown_table(header, rows)


def _plot(results: list[Result], path: Path, threads: int) -> None:
    plt = pyplot()
    groups = sorted({(r.load, r.dtype) for r in results}, key=lambda g: (g[0], g[1]))
    systems = list(dict.fromkeys(r.system for r in results))
    fig, ax = plt.subplots(figsize=(11, 5))
    width = 0.8 / max(1, len(systems))
    for s_idx, system in enumerate(systems):
        xs, ys = [], []
        for g_idx, (load, dtype) in enumerate(groups):
            match = [r for r in results if (r.system, r.load, r.dtype) == (system, load, dtype)]
            if match:
                xs.append(g_idx + s_idx * width)
                ys.append(match[0].tok_s)
        bars = ax.bar(xs, ys, width, label=system)
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))])
    ax.set_xticklabels([f"{load}\n{dtype}" for load, dtype in groups])
    ax.set_ylabel("new tokens / s")
    ax.set_title(f"Offline generation throughput ({threads} CPU threads)")
    ax.legend(fontsize=8)
    save_png(fig, path, 110)
