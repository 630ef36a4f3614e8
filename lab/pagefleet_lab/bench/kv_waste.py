"""`pagefleet-lab kv-waste`: how much reserved KV memory holds real tokens.

The seed article's five requests (45, 128, 23, 256, 67 tokens, max length
512) through the real BlockManager, against reserving max_model_len
contiguous slots per request as pre-paging servers did. Then, in a fixed KV
budget, how many such requests each scheme admits at once.
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

from pagefleet.bench.report import markdown_table, pyplot, save_png, write_report
from pagefleet.engine import SamplingParams
from pagefleet.engine.block_manager import BlockManager
from pagefleet.engine.sequence import Sequence


def paged(lengths: list[int], block_size: int) -> tuple[int, int]:
    """(slots reserved, blocks used) for the requests through the BlockManager."""
    total_blocks = sum(-(-n // block_size) for n in lengths)
    bm = BlockManager(total_blocks, block_size, enable_prefix_caching=False)
    for i, n in enumerate(lengths):
        seq = Sequence(f"r{i}", [0] * n, SamplingParams())
        if not bm.allocate_prefilled(seq, [], n):
            raise AssertionError("the pool was sized to fit every request")
    bm.check_accounting()
    return bm.num_used_blocks * block_size, bm.num_used_blocks


def paged_concurrency(lengths: list[int], block_size: int, budget_tokens: int) -> int:
    """Requests admitted (cycling through the mix) before the pool runs out."""
    bm = BlockManager(budget_tokens // block_size, block_size, enable_prefix_caching=False)
    for admitted, n in enumerate(itertools.cycle(lengths)):
        if not bm.allocate_prefilled(Sequence(f"r{admitted}", [0] * n, SamplingParams()), [], n):
            return admitted
    raise AssertionError("unreachable")


def run(args: argparse.Namespace) -> int:
    lengths = [int(x) for x in args.lengths.split(",")]
    bs, max_len = args.block_size, args.max_model_len
    real = sum(lengths)
    contiguous_slots = max_len * len(lengths)
    paged_slots, paged_blocks = paged(lengths, bs)
    rows = [
        [
            "contiguous (max_model_len each)",
            real,
            contiguous_slots,
            contiguous_slots - real,
            f"{100 * real / contiguous_slots:.1f}%",
            args.budget_tokens // max_len,
        ],
        [
            f"paged (blocks of {bs})",
            real,
            paged_slots,
            paged_slots - real,
            f"{100 * real / paged_slots:.1f}%",
            paged_concurrency(lengths, bs, args.budget_tokens),
        ],
    ]
    header = [
        "scheme",
        "tokens stored",
        "slots reserved",
        "slots wasted",
        "utilisation",
        f"requests admitted in {args.budget_tokens} slots",
    ]
    body = (
        f"Requests of {', '.join(map(str, lengths))} tokens, max_model_len {max_len}; "
        f"paged uses {paged_blocks} blocks. Concurrency cycles through the same mix.\n\n"
        + markdown_table(header, rows)
    )
    print(body)
    _plot(rows, Path(args.out).with_suffix(".png"))
    path = write_report(args.out, "KV-cache waste: paged vs contiguous", body)
    print(f"\nwrote {path}")
    return 0


def _plot(rows: list[list[object]], path: Path) -> None:
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    names = [str(r[0]) for r in rows]
    util = [float(str(r[4]).rstrip("%")) for r in rows]
    bars = a.bar(names, util, color=["#c44", "#4a4"])
    a.bar_label(bars, fmt="%.1f%%")
    a.set_ylabel("KV slots holding real tokens (%)")
    a.set_ylim(0, 105)
    bars = b.bar(names, [int(r[5]) for r in rows], color=["#c44", "#4a4"])
    b.bar_label(bars)
    b.set_ylabel("requests admitted at once")
    for ax in (a, b):
        ax.tick_params(axis="x", labelsize=8)
    save_png(fig, path, 110)


def add_parser(sub: argparse._SubParsersAction) -> None:
    kv = sub.add_parser("kv-waste", help="paged vs contiguous KV reservation (seed article)")
    kv.add_argument("--lengths", default="45,128,23,256,67")
    kv.add_argument("--max-model-len", type=int, default=512)
    kv.add_argument("--block-size", type=int, default=16)
    kv.add_argument("--budget-tokens", type=int, default=8192)
    kv.add_argument("--out", default="benchmarks/results/kv_waste")
