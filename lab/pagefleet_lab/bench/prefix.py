"""`pagefleet-lab prefix`: prefix caching on vs off.

32 requests share a 1,024-token system prompt, each with its own 32-token
question. TTFT: the requests arrive one after another (each alone in the
engine), so the first computes the whole prompt and, with caching, every
later one reuses the system prompt's blocks. Throughput: all 32 at once.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from pagefleet.bench.checkpoint import ensure_model
from pagefleet.bench.report import markdown_table, pyplot, save_png, write_report
from pagefleet.bench.stats import percentile
from pagefleet.engine import EngineConfig, LLMEngine, SamplingParams


def _prompts(vocab: int, system_len: int, question_len: int, count: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    system = torch.randint(3, vocab, (system_len,), generator=g).tolist()
    return [
        system + torch.randint(3, vocab, (question_len,), generator=g).tolist()
        for _ in range(count)
    ]


def _ttfts(
    engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, bar: tqdm
) -> list[float]:
    ttfts = []
    for i, ids in enumerate(prompts):
        start = time.perf_counter()
        engine.add_request(f"ttft-{i}", {"prompt_token_ids": ids}, params)
        first = None
        while engine.has_unfinished_requests():
            outs = engine.step()
            if first is None and outs:
                first = time.perf_counter() - start
        ttfts.append(first or 0.0)
        bar.update(1)
    return ttfts


def _throughput(
    engine: LLMEngine, prompts: list[list[int]], params: SamplingParams
) -> tuple[float, float]:
    start = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_request(f"tp-{i}", {"prompt_token_ids": ids}, params)
    tokens = 0
    while engine.has_unfinished_requests():
        tokens += sum(len(o.outputs[0].new_token_ids) for o in engine.step())
    elapsed = time.perf_counter() - start
    return tokens / elapsed, elapsed


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    model_dir, vocab = ensure_model(args.model, "smollm-135m")
    prompts = _prompts(vocab, args.system_tokens, args.question_tokens, args.requests)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    rows = []
    results = {}
    bar = tqdm(total=2 * args.requests, desc="bench prefix (TTFT runs)", unit="req")
    for caching in (True, False):
        engine = LLMEngine(
            EngineConfig(
                model=model_dir,
                dtype=args.dtype,
                enable_prefix_caching=caching,
                max_model_len=2048,
                num_kv_blocks=args.requests * 70 + 64,
                max_num_seqs=args.requests,
            )
        )
        ttft = _ttfts(engine, prompts, params, bar)
        tput, elapsed = _throughput(engine, prompts, params)
        engine.check_block_accounting()
        stats = engine.stats()
        results[caching] = (ttft, tput)
        rows.append(
            [
                "on" if caching else "off",
                f"{ttft[0] * 1000:.0f}",
                f"{percentile(ttft[1:], 0.5) * 1000:.0f}",
                f"{tput:.1f}",
                f"{elapsed:.1f}",
                f"{stats.prefix_cache_hits}/{stats.prefix_cache_queries}",
            ]
        )
        del engine
    bar.close()
    on, off = results[True], results[False]
    ttft_ratio = percentile(off[0][1:], 0.5) / percentile(on[0][1:], 0.5)
    header = [
        "prefix caching",
        "TTFT first (ms)",
        "TTFT later, median (ms)",
        "throughput (tok/s)",
        "throughput run (s)",
        "cache hits / queries (tokens)",
    ]
    body = (
        f"{args.requests} requests = {args.system_tokens}-token shared system prompt + "
        f"{args.question_tokens}-token question, {args.max_tokens} new tokens each, {args.dtype}, "
        f"`{args.model}`, {args.threads} threads.\n\n"
        + markdown_table(header, rows)
        + f"\n\nSecond-and-later TTFT is **{ttft_ratio:.1f}x lower** with caching; "
        f"throughput with all {args.requests} at once is **{on[1] / off[1]:.2f}x**."
    )
    print(body)
    _plot(results, Path(args.out).with_suffix(".png"))
    print(f"\nwrote {write_report(args.out, 'Prefix caching: shared system prompt', body)}")
    return 0


def _plot(results: dict[bool, tuple[list[float], float]], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    for caching, (ttft, _) in results.items():
        ax.plot(
            range(1, len(ttft) + 1),
            [t * 1000 for t in ttft],
            marker="o",
            markersize=3,
            label=f"prefix caching {'on' if caching else 'off'}",
        )
    ax.set_xlabel("request (arriving one after another)")
    ax.set_ylabel("time to first token (ms)")
    ax.set_yscale("log")
    ax.legend()
    ax.set_title("TTFT with a shared 1,024-token system prompt")
    save_png(fig, path, 110)


def add_parser(sub: argparse._SubParsersAction) -> None:
    pre = sub.add_parser("prefix", help="prefix caching on vs off: TTFT and throughput")
    pre.add_argument("--model", default="models/smollm-135m")
    pre.add_argument("--dtype", default="float32")
    pre.add_argument("--requests", type=int, default=32)
    pre.add_argument("--system-tokens", type=int, default=1024)
    pre.add_argument("--question-tokens", type=int, default=32)
    pre.add_argument("--max-tokens", type=int, default=16)
    pre.add_argument("--threads", type=int, default=2)
    pre.add_argument("--out", default="benchmarks/results/prefix")
