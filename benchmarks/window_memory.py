"""How many sequences a replica holds at once when every layer slides, against keeping every block.

Two checkpoints of one shape (the tiny preset written as Mistral), one with a
sliding window W on every layer and one without; the same KV pool (blocks of
16 tokens); every sequence a 16-token prompt generating until it is 4W tokens
long (`ignore_eos`). The windowed engine frees each sequence's blocks as they
leave the window (`BlockManager.free_out_of_window`); the other holds all of
them. For each engine:

1. one sequence alone: the most blocks it holds at once (the pool's low point);
2. capacity = pool // that: the most such sequences the pool holds together;
3. `capacity` sequences at once: they must all run to the end with no preemption,
   and `capacity + 1` must preempt (the pool is really full at the figure).

The ratio of the two capacities is the figure. Step counts, not seconds: it is
about the pool, and holds on a loaded machine.

    .venv/bin/python benchmarks/window_memory.py [--window 64] [--blocks 160]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from pagefleet.cluster.make_model import make_model
from pagefleet.engine import LLM, SamplingParams

BLOCK_SIZE = 16
PROMPT = 16


def run(path: Path, blocks: int, n: int, length: int) -> tuple[int, int]:
    """(the most blocks in use at once, preemptions) for n sequences of `length` tokens."""
    llm = LLM(
        model=str(path), dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=blocks,
        max_num_seqs=n, max_model_len=length, enable_prefix_caching=False,
    )  # fmt: skip
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=length - PROMPT, ignore_eos=True)
    for i in range(n):
        prompt = [3 + (i * 7 + j) % 500 for j in range(PROMPT)]
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        stats = engine.stats()
        peak = max(peak, stats.num_total_blocks - stats.num_free_blocks)
    preemptions = engine.stats().num_preemptions
    llm.check_block_accounting()
    llm.close()
    return peak, preemptions


def capacity(path: Path, blocks: int, length: int) -> dict[str, int]:
    per_seq, _ = run(path, blocks, 1, length)
    cap = blocks // per_seq
    _, at_cap = run(path, blocks, cap, length)
    _, over_cap = run(path, blocks, cap + 1, length)
    return {"blocks per sequence": per_seq, "capacity": cap, "preemptions at capacity": at_cap,
            "preemptions at capacity + 1": over_cap}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=160)
    args = parser.parse_args()
    length = 4 * args.window
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, window in (("every block kept", None), (f"window {args.window}", args.window)):
            path = make_model(Path(tmp) / name.replace(" ", "-"), "tiny", "mistral",
                              sliding_window=window, max_position_embeddings=length)  # fmt: skip
            results[name] = capacity(path, args.blocks, length)
    print(f"sequences of {length} tokens (4 x window {args.window}), "
          f"a pool of {args.blocks} blocks of {BLOCK_SIZE}")  # fmt: skip
    for name, r in results.items():
        print(f"  {name:18s} " + ", ".join(f"{k} {v}" for k, v in r.items()))
    kept, slid = results.values()
    print(f"  concurrent sequences, windowed / kept: {slid['capacity'] / kept['capacity']:.2f}x")


if __name__ == "__main__":
    main()
