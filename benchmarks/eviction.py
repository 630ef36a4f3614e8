"""Prefix-cache hit rates of the engine's eviction (`BlockManager`: plain LRU against its
adaptive segmented LRU capped at two protected shares) on seeded streams, over pool sizes.

    .venv/bin/python benchmarks/eviction.py --out benchmarks/results/eviction

Each stream is replayed through the real `BlockManager` one request at a time, in
arrival order (admission, its prompt and output computed and registered, freed), so
only eviction differs between rows; concurrency, which holds a few running requests'
blocks, is left out. The hit rate is vLLM's: prompt tokens found cached over prompt
tokens looked up. Streams (block size 16, Poisson arrivals, 600 simulated s):

- multi_tenant: llm-d's shape scaled down, tenants' 1,024-token system prompts (a
  tenant chosen uniformly per request) with a unique 256-token query and 32 tokens out;
- chat: conversations, each a 256-token system prompt shared by all, then turns of 64
  user tokens and 64 out, every turn's prompt the whole conversation so far; turns per
  conversation geometric (mean 4), think time between turns exponential (mean 30 s);
- mixed: both at once.

The pool sizes are in blocks. Where the pool holds every stream's reused prefixes many
times over, eviction hardly matters; it decides where it holds about one working set.
"""

from __future__ import annotations

import argparse
import heapq
import random
import shlex
import sys
from collections.abc import Iterator
from dataclasses import dataclass

from pagefleet.bench.report import markdown_table, pyplot, save_png, write_report
from pagefleet.engine import SamplingParams
from pagefleet.engine.block_manager import BlockManager
from pagefleet.engine.sequence import Sequence

BLOCK = 16
VOCAB = 50_000
FRACTIONS = (0.0, 0.5, 0.8)


@dataclass(frozen=True)
class Request:
    at: float
    prompt: list[int]
    output: list[int]
    # For a chat turn: the conversation and the turn's full tokens after it ends.
    conversation: int | None = None


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def multi_tenant(rng: random.Random, rate: float, duration: float) -> Iterator[Request]:
    systems = [_tokens(rng, 1024) for _ in range(64)]
    t = rng.expovariate(rate)
    while t < duration:
        yield Request(t, rng.choice(systems) + _tokens(rng, 256), _tokens(rng, 32))
        t += rng.expovariate(rate)


def chat(rng: random.Random, rate: float, duration: float) -> Iterator[Request]:
    """Turns in time order: a heap of each conversation's next turn."""
    system = _tokens(rng, 256)
    heap: list[tuple[float, int, list[int]]] = []
    start, cid = rng.expovariate(rate), 0
    while heap or start < duration:
        if start < duration and (not heap or start < heap[0][0]):
            heapq.heappush(heap, (start, cid, list(system)))
            start, cid = start + rng.expovariate(rate), cid + 1
            continue
        at, conv, history = heapq.heappop(heap)
        prompt = history + _tokens(rng, 64)
        output = _tokens(rng, 64)
        yield Request(at, prompt, output, conv)
        if rng.random() < 0.75:  # another turn (geometric, mean 4)
            nxt = at + rng.expovariate(1 / 30)
            if nxt < duration:
                heapq.heappush(heap, (nxt, conv, prompt + output))


def stream(name: str, seed: int, rate: float, duration: float) -> list[Request]:
    rng = random.Random(seed)
    if name == "multi_tenant":
        return list(multi_tenant(rng, rate, duration))
    if name == "chat":
        return list(chat(rng, rate / 4, duration))  # ~4 turns each: `rate` turns a second
    if name == "mixed":
        both = [*multi_tenant(rng, rate / 2, duration), *chat(rng, rate / 8, duration)]
        return sorted(both, key=lambda r: r.at)
    raise SystemExit(f"unknown stream {name!r}")


def hit_rate(requests: list[Request], blocks: int, fraction: float) -> float:
    """Prompt tokens found cached over prompt tokens, in %, replayed through one pool."""
    now = [0.0]
    bm = BlockManager(blocks, BLOCK, clock=lambda: now[0], protected_fraction=fraction)
    params = SamplingParams()
    for i, req in enumerate(requests):
        now[0] = req.at
        seq = Sequence(f"r{i}", list(req.prompt), params)
        cached = bm.cached_prefix(seq)
        total = len(req.prompt) + len(req.output)
        if not bm.allocate_prefilled(seq, cached, total):
            raise SystemExit(f"a {total}-token request does not fit {blocks} blocks")
        seq.token_ids.extend(req.output)
        seq.num_computed_tokens = total
        bm.cache_computed_blocks(seq)
        bm.free(seq)
    bm.check_accounting()
    return 100 * bm.prefix_cache_hits / bm.prefix_cache_queries


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", default="multi_tenant,chat,mixed")
    p.add_argument("--pools", default="1024,2048,4096,8192,16384", help="pool sizes (blocks)")
    p.add_argument("--rate", type=float, default=4.0, help="requests a second")
    p.add_argument("--duration", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/eviction")
    args = p.parse_args()
    pools = [int(x) for x in args.pools.split(",")]
    names = args.streams.split(",")
    results: dict[tuple[str, int, float], float] = {}
    rows = []
    for name in names:
        requests = stream(name, args.seed, args.rate, args.duration)
        for blocks in pools:
            row: list[object] = [name, f"{blocks:,}"]
            for fraction in FRACTIONS:
                results[name, blocks, fraction] = hit_rate(requests, blocks, fraction)
                row.append(f"{results[name, blocks, fraction]:.1f}")
            print(f"{name}, {blocks} blocks: " + ", ".join(map(str, row[2:])), flush=True)
            rows.append(row)
    plt = pyplot()
    fig, axes = plt.subplots(1, len(names), figsize=(4.5 * len(names), 3.6), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        for fraction in FRACTIONS:
            label = "plain LRU" if fraction == 0 else f"protected up to {fraction:g}"
            ax.plot(pools, [results[name, b, fraction] for b in pools], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_title(name)
        ax.set_xlabel("pool (blocks of 16 tokens)")
        ax.set_ylabel("prefix hit % (tokens)")
        ax.legend(fontsize=7)
    save_png(fig, args.out, 100)
    header = ["stream", "pool (blocks)"] + [
        "plain LRU" if f == 0 else f"protected up to {f:g}" for f in FRACTIONS
    ]
    body = (
        f"Prefix hit % (prompt tokens found cached), {args.rate:g} requests a second for "
        f"{args.duration:g} s, seed {args.seed}; the module docstring has the streams.\n\n"
        + markdown_table(header, rows)
    )
    command = shlex.join([".venv/bin/python", "benchmarks/eviction.py", *sys.argv[1:]])
    title = "Eviction: plain LRU against the adaptive segmented LRU"
    print(write_report(args.out, title, body, command))


if __name__ == "__main__":
    main()
