"""The CPU prefill kernel against the torch path it replaced, one layer and one whole step.

    python benchmarks/prefill_attention.py --threads 2 --out benchmarks/results/prefill_attention_2t

Two measurements, both in this process, the two paths alternating rep by rep so that
both see the same disturbances of a shared machine; each figure is the median of REPS:

- one layer's prompt attention (`cpu_paged_attention` over a step of prompt chunks
  already stored in the paged cache; SmolLM-135M's shape: 9 query heads, 3 KV heads,
  head_dim 64, blocks of 16), for a fresh 1,200-token prompt, two 500-token chunks
  over 700 cached tokens each (chunked prefill), and bursts of short prompts;
- one whole model step (the compiled forward and greedy sampling, as
  `profile_step.py` makes it) prefilling one 1,200-token prompt.

"torch path" is what `cpu_attention.py` does where the prefill kernel is not built
(per-chunk flash attention, merged with the cached context by log-sum-exp; the
reference's padded call for steps of short chunks): the kernel's `supports` is
switched off in this process for those reps. Writes OUT.md and OUT.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from profile_step import run_step, step_inputs

from pagefleet.bench.machine import machine_description
from pagefleet.bench.report import markdown_table, write_report
from pagefleet.engine import LLM, SamplingParams
from pagefleet.engine.sampler import SamplingBatch
from pagefleet.kernels import (
    build_attention_metadata,
    cpu_attention,
    cpu_paged_prefill,
    store_kv_cache,
)

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
# name -> (chunk tokens, cached tokens before each chunk), one entry per chunk
LAYER_CASES: dict[str, list[tuple[int, int]]] = {
    "1 prompt of 1,200 tokens": [(1200, 0)],
    "2 chunks of 500 over 700 cached": [(500, 700)] * 2,
    "16 prompts of 16 tokens": [(16, 0)] * 16,
    "4 prompts of 64 tokens": [(64, 0)] * 4,
    "8 chunks of 4 over 300 cached": [(4, 300)] * 8,
}


def layer_step(chunks: list[tuple[int, int]]):
    """A cache holding the chunks' contexts and their own K/V, the step's layout, queries."""
    gen = torch.Generator().manual_seed(0)
    totals = [n + c for n, c in chunks]
    num_blocks = sum(-(-t // BLOCK) for t in totals)
    k_cache = torch.zeros(num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    v_cache = torch.zeros_like(k_cache)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, slots = [], []
    for t in totals:
        table = [order.pop() for _ in range(-(-t // BLOCK))]
        tables.append(table)
        slots += [table[i // BLOCK] * BLOCK + i % BLOCK for i in range(t)]
    k = torch.randn(len(slots), KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(len(slots), KV_HEADS, HEAD_DIM, generator=gen)
    store_kv_cache(k, v, k_cache, v_cache, torch.tensor(slots))
    meta = build_attention_metadata([n for n, _ in chunks], totals, tables, BLOCK)
    query = torch.randn(sum(n for n, _ in chunks), HEADS, HEAD_DIM, generator=gen)
    return query, k_cache, v_cache, meta


def attention_flops(chunks: list[tuple[int, int]]) -> float:
    """Multiply-adds x 2 of QK^T and PV over the causal triangle and the cached context."""
    macs = sum(n * c + n * (n + 1) / 2 for n, c in chunks) * HEADS * HEAD_DIM * 2
    return 2 * macs


def alternate(fns: dict[str, Callable[[], None]], reps: int) -> dict[str, float]:
    """Median seconds of each, the paths taking turns."""
    for fn in fns.values():  # warm
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


class TorchPath:
    """Switches the prefill kernel off in this process while entered."""

    def __enter__(self) -> None:
        self.supports = cpu_paged_prefill.supports
        cpu_paged_prefill.supports = lambda query, k_cache: False

    def __exit__(self, *exc: object) -> None:
        cpu_paged_prefill.supports = self.supports


def on_torch_path(fn: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        with TorchPath():
            fn()

    return run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/smollm-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument("--step-reps", type=int, default=9)
    ap.add_argument("--out", default="benchmarks/results/prefill_attention")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.threads == 1:
        torch._inductor.config.cpp.threads = 1
    assert cpu_paged_prefill.available(torch.float32, HEAD_DIM), "the prefill kernel is not built"

    layer_rows, results = [], {"layer": {}, "step": {}}
    for name, chunks in LAYER_CASES.items():
        query, k_cache, v_cache, meta = layer_step(chunks)

        def attend(q=query, k=k_cache, v=v_cache, m=meta) -> None:
            cpu_attention.cpu_paged_attention(q, k, v, m, HEAD_DIM**-0.5)

        t = alternate({"kernel": attend, "torch path": on_torch_path(attend)}, args.reps)
        flops = attention_flops(chunks)
        results["layer"][name] = t
        layer_rows.append(
            [
                name,
                f"{t['torch path'] * 1e3:.3f}",
                f"{t['kernel'] * 1e3:.3f}",
                f"**{t['torch path'] / t['kernel']:.2f}x**",
                f"{flops / t['torch path'] / 1e9:.0f} / {flops / t['kernel'] / 1e9:.0f}",
            ]
        )
        print(name, t, flush=True)

    llm = LLM(
        model=args.model,
        dtype="float32",
        max_model_len=2048,
        max_num_seqs=20,
        num_kv_blocks=1600,
        enable_prefix_caching=False,
        num_threads=args.threads,
    )
    runner = llm.engine.token_engine.runner
    step_rows = []
    for name, (q, c) in {
        "prefill, one prompt of 1,200 tokens": ([1200], [1200]),
        "prefill, 2 chunks of 500 over 700 cached": ([500, 500], [1200, 1200]),
    }.items():
        inputs = step_inputs(runner, q, c)
        batch = SamplingBatch([SamplingParams(temperature=0.0)] * len(q), [None] * len(q), [])

        def step(i=inputs, b=batch) -> None:
            run_step(runner, i, b)

        t = alternate({"kernel": step, "torch path": on_torch_path(step)}, args.step_reps)
        results["step"][name] = t
        step_rows.append(
            [
                name,
                f"{t['torch path'] * 1e3:.1f}",
                f"{t['kernel'] * 1e3:.1f}",
                f"**{t['torch path'] / t['kernel']:.2f}x**",
                f"{(t['torch path'] - t['kernel']) * 1e3:.1f}",
            ]
        )
        print(name, t, flush=True)
    llm.close()

    info = (
        f"{args.threads} threads, fp32, {machine_description()}. Medians of {args.reps} "
        f"(layer) and {args.step_reps} (step) runs, the two paths alternating."
    )
    body = (
        info
        + "\n\n### One layer's prompt attention (9 heads / 3 KV heads, head_dim 64)\n\n"
        + markdown_table(
            ["step's chunks", "torch path ms", "kernel ms", "speed-up", "GFLOP/s torch / kernel"],
            layer_rows,
        )
        + "\n\n### One compiled model step (SmolLM-135M shape, 30 layers)\n\n"
        + markdown_table(
            ["step", "torch path ms", "kernel ms", "speed-up", "saved ms"],
            step_rows,
        )
    )
    print(body)
    path = write_report(
        args.out,
        "Prompt attention on the CPU: the prefill kernel against the torch path",
        body,
        command="python " + " ".join(sys.argv),
    )
    Path(args.out).with_suffix(".json").write_text(
        json.dumps({**results, "threads": args.threads, "reps": args.reps}, indent=1)
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
