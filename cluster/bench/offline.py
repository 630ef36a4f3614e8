"""`pagefleet bench offline`: LLM.generate against transformers (and, with
`--vllm-python`, vLLM's CPU build), side by side in one run.

Every system generates exactly N new tokens per request (EOS ignored), greedy,
on the same prompts of 5-11 tokens. Throughput is new tokens over wall time;
ratios are to transformers' continuous batching (`generate_batch`) in fp32
on the same load, and to vLLM's `LLM.generate` in the same dtype, measured in
this same run. vLLM runs in a subprocess with its own python (it pins other
versions of our dependencies), after pagefleet and transformers, so the
three never share the cores.
"""

from __future__ import annotations

import argparse
import gc
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .checkpoint import ensure_model
from .report import markdown_table, pyplot, save_png, write_report
from .vllm_child import describe_vllm_threads, run_vllm_child, vllm_thread_env

_TEXT = (
    "def parse(args):\n    options = {}\n    for item in args:\n        key, _, value = item.partition('=')\n"
    "import collections.abc\nclass Registry(dict):\n    'A mapping of names to handlers.'\n"
)
BASELINE = "transformers continuous batching"
VLLM = "vLLM CPU build LLM.generate"

# The vLLM side: standalone, run by the vLLM environment's python. One engine per
# dtype; each load timed after a warm-up, like ours.
_VLLM_CHILD = textwrap.dedent(
    """
    import json, sys, time

    def main(model, dtype, spec_path, out_path):
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        spec = json.load(open(spec_path))
        llm = LLM(model=model, dtype=dtype, max_model_len=256, seed=0)
        warm = [TokensPrompt(prompt_token_ids=p) for p in spec["warm"]]
        llm.generate(warm, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                     use_tqdm=False)
        out = []
        for load in spec["loads"]:
            prompts = [TokensPrompt(prompt_token_ids=p) for p in load["prompts"]]
            params = SamplingParams(temperature=0, max_tokens=load["new"], ignore_eos=True)
            start = time.perf_counter()
            res = llm.generate(prompts, params, use_tqdm=False)
            secs = time.perf_counter() - start
            out.append({"tokens": sum(len(r.outputs[0].token_ids) for r in res), "seconds": secs})
        json.dump({"version": __import__("vllm").__version__, "runs": out}, open(out_path, "w"))

    if __name__ == "__main__":
        main(*sys.argv[1:5])
    """
)


@dataclass
class Result:
    system: str
    dtype: str
    load: str
    tokens: int
    seconds: float
    note: str = ""

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


def make_prompts(tokenizer, count: int) -> list[list[int]]:
    """Prompts of 5-11 tokens, cut from one text at different offsets."""
    ids = tokenizer.encode(_TEXT)
    prompts = []
    for i in range(count):
        length = 5 + i % 7
        start = (i * 3) % (len(ids) - length)
        prompts.append(ids[start : start + length])
    return prompts


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


def _pagefleet_runner(model_dir: str, dtype: str, max_seqs: int):
    from pagefleet.engine import LLM, SamplingParams

    # Room for every request of the largest load at once (256 tokens each).
    llm = LLM(
        model=model_dir,
        dtype=dtype,
        max_num_seqs=max_seqs,
        max_model_len=256,
        num_kv_blocks=max_seqs * 256 // 16,
    )

    def run(prompts: list[list[int]], new: int) -> int:
        params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        llm.check_block_accounting()
        return sum(len(o.outputs[0].token_ids) for o in outs)

    return llm, run


def _run_dtype(
    model_dir: str,
    dtype: str,
    tokenizer,
    loads: list[tuple[int, int]],
    skip: set[str],
    sequential_cap: int,
    bar: tqdm,
) -> list[Result]:
    hf = _Transformers(model_dir, getattr(torch, dtype))
    _llm, pagefleet = _pagefleet_runner(model_dir, dtype, max(n for n, _ in loads))
    warm = make_prompts(tokenizer, 4)
    pagefleet(warm, 4)
    hf.continuous(warm, 4, warmup=True)
    results = []
    for n, new in loads:
        load = f"{n}x{new}"
        prompts = make_prompts(tokenizer, n)
        one_by_one = prompts[:sequential_cap]
        note = f"first {len(one_by_one)} of {n} requests" if len(one_by_one) < n else ""
        runs: list[tuple[str, Callable[..., int], tuple, str]] = [
            ("pagefleet LLM.generate", pagefleet, (prompts, new), ""),
            ("pagefleet one at a time", _each, (pagefleet, one_by_one, new), note),
            ("transformers generate one at a time", hf.one_at_a_time, (one_by_one, new), note),
            ("transformers static batch of 8", hf.static_batch, (prompts, new), ""),
            (BASELINE, hf.continuous, (prompts, new), ""),
        ]
        for system, fn, fn_args, why in runs:
            bar.set_postfix_str(f"{dtype} {load} {system}")
            if system not in skip:
                tokens, secs = _timed(fn, *fn_args)
                results.append(Result(system, dtype, load, tokens, secs, why))
            bar.update(1)
    return results


def _each(
    run_batch: Callable[[list[list[int]], int], int], prompts: list[list[int]], new: int
) -> int:
    return sum(run_batch([p], new) for p in prompts)


def run_vllm(
    vllm_python: str,
    model_dir: str,
    dtype: str,
    tokenizer,
    loads: list[tuple[int, int]],
    threads: int | None = None,
) -> tuple[str, list[Result]]:
    """vLLM's LLM.generate on the same prompts and loads, with `threads` compute
    threads (`vllm_thread_env`): (its version, results)."""
    spec = {
        "warm": make_prompts(tokenizer, 4),
        "loads": [{"prompts": make_prompts(tokenizer, n), "new": new} for n, new in loads],
    }
    model = str(Path(model_dir).resolve())
    got = run_vllm_child(vllm_python, _VLLM_CHILD, spec, model, dtype, threads=threads)
    results = [
        Result(VLLM, dtype, f"{n}x{new}", r["tokens"], r["seconds"])
        for (n, new), r in zip(loads, got["runs"], strict=True)
    ]
    return got["version"], results


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    model_dir, _ = ensure_model(args.model, "smollm-135m")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    loads = [tuple(int(x) for x in spec.split("x")) for spec in args.loads.split(",")]
    dtypes = args.dtypes.split(",")
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    bar = tqdm(total=len(dtypes) * len(loads) * 5, desc="bench offline", unit="run")
    results: list[Result] = []
    for dtype in dtypes:
        results += _run_dtype(model_dir, dtype, tokenizer, loads, skip, args.sequential_cap, bar)
        gc.collect()
    bar.close()
    args.vllm_version = None
    if args.vllm_python:
        for dtype in dtypes:
            print(f"bench offline: vLLM's CPU build, {dtype} (start-up ~40 s) ...", flush=True)
            args.vllm_version, theirs = run_vllm(
                args.vllm_python, model_dir, dtype, tokenizer, loads, args.threads
            )
            results += theirs

    body = _report(results, loads, dtypes, args)
    print(body)
    _plot(results, Path(args.out).with_suffix(".png"))
    path = write_report(args.out, "Offline throughput: pagefleet vs transformers", body)
    print(f"\nwrote {path}")
    return 0


def _report(results: list[Result], loads, dtypes, args: argparse.Namespace) -> str:
    base = {r.load: r.tok_s for r in results if r.system == BASELINE and r.dtype == "float32"}
    single = {
        (r.load, r.dtype): r.tok_s
        for r in results
        if r.system == "transformers generate one at a time"
    }
    vllm = {(r.load, r.dtype): r.tok_s for r in results if r.system == VLLM}
    rows = []
    for r in results:
        vs_cb = f"{r.tok_s / base[r.load]:.2f}x" if r.load in base else "-"
        vs_vllm = f"{r.tok_s / vllm[(r.load, r.dtype)]:.2f}x" if (r.load, r.dtype) in vllm else "-"
        vs_one = (
            f"{r.tok_s / single[(r.load, 'float32')]:.2f}x"
            if r.system == "pagefleet one at a time" and (r.load, "float32") in single
            else ""
        )
        rows.append(
            [
                r.system,
                r.dtype,
                r.load,
                r.tokens,
                f"{r.seconds:.1f}",
                f"{r.tok_s:.1f}",
                vs_cb,
                vs_vllm,
                vs_one,
                r.note,
            ]
        )
    header = [
        "system",
        "dtype",
        "requests x new tokens",
        "tokens",
        "seconds",
        "tok/s",
        "vs transformers CB fp32",
        "vs vLLM same dtype",
        "vs transformers one-at-a-time fp32",
        "note",
    ]
    info = (
        f"Checkpoint: `{args.model}` (SmolLM-135M's shape, seeded random weights), "
        f"{args.threads} threads, greedy, EOS ignored, prompts of 5-11 tokens. "
        "One-at-a-time rows are a per-request rate, so they time a prefix of the load."
    )
    if getattr(args, "vllm_version", None):
        info += (
            f" vLLM: the CPU build {args.vllm_version} (`--vllm-python {args.vllm_python}`), "
            "`LLM(dtype=..., max_model_len=256)` at its defaults (no enforce_eager), "
            "KV space VLLM_CPU_KVCACHE_SPACE=2 GiB, the same threads "
            f"({describe_vllm_threads(vllm_thread_env(args.threads))})."
        )
    if vllm:
        head = [
            f"{r.load} {r.dtype}: pagefleet {r.tok_s:.1f} tok/s = "
            f"{r.tok_s / vllm[(r.load, r.dtype)]:.2f}x vLLM ({vllm[(r.load, r.dtype)]:.1f})"
            for r in results
            if r.system == "pagefleet LLM.generate" and (r.load, r.dtype) in vllm
        ]
        info = "Headline: " + "; ".join(head) + ".\n\n" + info
    return info + "\n\n" + markdown_table(header, rows)


def _plot(results: list[Result], path: Path) -> None:
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
    ax.set_title("Offline generation throughput (SmolLM-135M shape, 2 CPU threads)")
    ax.legend(fontsize=8)
    save_png(fig, path, 110)
