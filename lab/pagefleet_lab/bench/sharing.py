"""`pagefleet-lab sharing`: KV blocks for n parallel samples, shared vs not.

With sharing, the n samples of a request hold one copy of the prompt's
blocks (copy-on-write); without it, each sample is its own request with its
own copy (prefix caching off). Then, in a fixed KV budget, the throughput
each scheme reaches on the same load.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from pagefleet.bench.checkpoint import ensure_model
from pagefleet.bench.report import markdown_table, pyplot, save_png, write_report
from pagefleet.engine import EngineConfig, LLMEngine, SamplingParams


def _drive(
    engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]]
) -> tuple[int, int, float]:
    """Run to completion; (peak used blocks, generated tokens, seconds)."""
    start = time.perf_counter()
    for i, (ids, params) in enumerate(requests):
        engine.add_request(f"r{i}", {"prompt_token_ids": ids}, params)
    peak = tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += sum(len(c.new_token_ids) for c in out.outputs)
        peak = max(peak, engine.stats().num_used_blocks)
    engine.check_block_accounting()
    return peak, tokens, time.perf_counter() - start


def _load(prompts: list[list[int]], n: int, max_tokens: int, shared: bool) -> list:
    if shared:
        return [
            (
                p,
                SamplingParams(
                    n=n, temperature=1.0, seed=i, max_tokens=max_tokens, ignore_eos=True
                ),
            )
            for i, p in enumerate(prompts)
        ]
    return [
        (p, SamplingParams(temperature=1.0, seed=i * n + j, max_tokens=max_tokens, ignore_eos=True))
        for i, p in enumerate(prompts)
        for j in range(n)
    ]


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    model_dir, vocab = ensure_model(args.model, "smollm-135m")
    g = torch.Generator().manual_seed(0)

    def prompts(count: int) -> list[list[int]]:
        return [
            torch.randint(3, vocab, (args.prompt_tokens,), generator=g).tolist()
            for _ in range(count)
        ]

    def engine(blocks: int, caching: bool, max_seqs: int = 64) -> LLMEngine:
        return LLMEngine(
            EngineConfig(
                model=model_dir,
                num_kv_blocks=blocks,
                block_size=16,
                max_model_len=1024,
                enable_prefix_caching=caching,
                max_num_seqs=max_seqs,
            )
        )

    rows, peaks = [], {}
    one = prompts(1)
    for n in tqdm(args.ns, desc="bench sharing (blocks)"):
        shared, _, _ = _drive(engine(4096, True), _load(one, n, args.max_tokens, True))
        apart, _, _ = _drive(engine(4096, False), _load(one, n, args.max_tokens, False))
        peaks[n] = (shared, apart)
        rows.append([n, shared, apart, f"{100 * (1 - shared / apart):.0f}%"])
    header = ["n", "peak blocks, shared (CoW)", "peak blocks, separate", "KV memory saved"]

    load = prompts(args.requests)
    tp_rows = []
    for shared in (True, False):
        peak, tokens, secs = _drive(
            engine(args.budget_blocks, shared), _load(load, 4, args.max_tokens, shared)
        )
        tp_rows.append(
            [
                "shared (CoW)" if shared else "separate",
                peak,
                tokens,
                f"{secs:.1f}",
                f"{tokens / secs:.1f}",
            ]
        )
    gain = float(tp_rows[0][4]) / float(tp_rows[1][4])
    body = (
        f"One request of {args.prompt_tokens} prompt tokens, {args.max_tokens} new tokens per sample, "
        f"blocks of 16, `{args.model}`.\n\n"
        + markdown_table(header, rows)
        + f"\n\nThroughput in a fixed budget of {args.budget_blocks} blocks: {args.requests} requests x n=4, "
        f"{args.max_tokens} tokens per sample.\n\n"
        + markdown_table(["scheme", "peak blocks", "tokens", "seconds", "tok/s"], tp_rows)
        + f"\n\nSharing gives **{gain:.2f}x** the throughput in the same KV budget."
    )
    print(body)
    _plot(peaks, Path(args.out).with_suffix(".png"))
    print(
        f"\nwrote {write_report(args.out, 'Parallel sampling: shared (copy-on-write) vs separate KV', body)}"
    )
    return 0


def _plot(peaks: dict[int, tuple[int, int]], path: Path) -> None:
    plt = pyplot()
    ns = list(peaks)
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.38
    a = ax.bar(
        [i - width / 2 for i in range(len(ns))],
        [peaks[n][0] for n in ns],
        width,
        label="shared (CoW)",
    )
    b = ax.bar(
        [i + width / 2 for i in range(len(ns))], [peaks[n][1] for n in ns], width, label="separate"
    )
    ax.bar_label(a)
    ax.bar_label(b)
    ax.set_xticks(range(len(ns)))
    ax.set_xticklabels([f"n={n}" for n in ns])
    ax.set_ylabel("peak KV blocks")
    ax.legend()
    save_png(fig, path, 110)


def add_parser(sub: argparse._SubParsersAction) -> None:
    sh = sub.add_parser(
        "sharing", help="KV blocks for n samples with and without copy-on-write sharing"
    )
    sh.add_argument("--model", default="models/smollm-135m")
    sh.add_argument("--ns", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4, 8])
    sh.add_argument("--prompt-tokens", type=int, default=200)
    sh.add_argument("--max-tokens", type=int, default=32)
    sh.add_argument("--requests", type=int, default=16)
    sh.add_argument("--budget-blocks", type=int, default=160)
    sh.add_argument("--threads", type=int, default=2)
    sh.add_argument("--out", default="benchmarks/results/sharing")
