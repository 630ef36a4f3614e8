"""Dynamic token count against static (bucketed) shapes for the compiled CPU forward.

    python benchmarks/compile_shapes.py --model models/smollm-135m --threads 1 \\
        --out benchmarks/results/compile_shapes

A bucketed design compiles the forward for a few static sizes and pads each step up
to the next one; the engine's design compiles one graph with the token count
dynamic. This measures both halves of that choice on one decode step of N sequences
(40 tokens of context each): the dynamic graph at N, a graph compiled for exactly N
(a bucket that fits: the best case for buckets, no padding), and the dynamic graph at
the bucket sizes above N (what padding to them costs). Model forward only (no LM
head, no sampling), the fastest of REPS alternating runs. Writes OUT.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from pagefleet.bench.machine import machine_description
from pagefleet.bench.report import markdown_table, write_report
from pagefleet.engine import LLM
from pagefleet.engine.layers.attention import ForwardContext, forward_context


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/smollm-135m")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=20)
    ap.add_argument("--buckets", default="24,32")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default="benchmarks/results/compile_shapes")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    from profile_step import step_inputs

    torch.set_num_threads(args.threads)
    llm = LLM(
        model=args.model,
        enforce_eager=False,
        max_model_len=256,
        max_num_seqs=64,
        num_kv_blocks=400,
        num_threads=args.threads,
    )
    runner = llm.engine.token_engine.runner
    dynamic = runner.compiled
    start = time.perf_counter()
    static = torch.compile(dynamic._forward, dynamic=False, fullgraph=True)
    sizes = [args.batch, *(int(b) for b in args.buckets.split(","))]
    cases = {}
    for n in sizes:
        inputs = step_inputs(runner, [1] * n, [40] * n)
        ctx = ForwardContext(inputs.meta, runner.kv_caches, runner.packed_weights)
        cases[f"dynamic graph, {n} tokens"] = (dynamic._compiled, inputs, ctx)
        if n == args.batch:
            cases[f"static graph for exactly {n} tokens"] = (static, inputs, ctx)
    with torch.inference_mode():
        for fn, inputs, ctx in cases.values():  # compiles the static graph
            with forward_context(ctx):
                fn(inputs.input_ids, inputs.positions)
    static_compile = time.perf_counter() - start
    best = dict.fromkeys(cases, float("inf"))
    with torch.inference_mode():
        for _ in range(args.reps):
            for name, (fn, inputs, ctx) in cases.items():
                with forward_context(ctx):
                    t = time.perf_counter()
                    fn(inputs.input_ids, inputs.positions)
                    best[name] = min(best[name], time.perf_counter() - t)
    base = best[f"dynamic graph, {args.batch} tokens"]
    rows = [[name, f"{t * 1e3:.1f}", f"{t / base:.3f}x"] for name, t in best.items()]
    body = (
        f"Checkpoint `{args.model}` (fp32), {args.threads} threads, a decode step of the "
        f"given number of sequences x 40 tokens of context, model forward only, best of "
        f"{args.reps}. The static graph took {static_compile:.0f} s to compile beside the "
        f"dynamic one. {machine_description()}\n\n"
        + markdown_table(["graph, tokens in the step", "ms", "vs dynamic at the batch"], rows)
    )
    print(body)
    path = write_report(
        args.out,
        "Compiled forward: dynamic token count vs static buckets",
        body,
        command="python " + " ".join(sys.argv),
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
