"""One mixture-of-experts layer: pagefleet's grouped experts kernel, its per-expert loop, and
transformers' block.

Shapes: `qwen3-30b-a3b` (128 experts of 768, top 8, hidden 2048) or `qwen3-moe-small` (the
make-model preset's: 64 experts of 384, top 8, hidden 1024). All three hold the same
weights: "kernel" is the layer packed as the engine packs it on this CPU
(`kernels/cpu_moe.py`, one C call), "loop" the same layer packed per expert
(`cpu_gemm.PackedWeight`, the path CPUs without the kernel take), "transformers" its
block at its default experts implementation (`grouped_mm`). Each round times one call of
each, the order rotating every round, so all see the same machine load; the report is the
median time over rounds, the median of the per-round ratios with their range, and the
outputs' largest difference from transformers'.

    python benchmarks/moe_layer.py [--shape qwen3-moe-small] [--dtype float32] \\
        [--threads 1] [--rounds 9] [--tokens 1,16,128]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from transformers import AutoConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from pagefleet.engine.layers.moe import FusedMoE
from pagefleet.kernels import cpu_moe

# hidden, intermediate, experts, top k
SHAPES = {"qwen3-30b-a3b": (2048, 768, 128, 8), "qwen3-moe-small": (1024, 384, 64, 8)}


def layers(shape: str, dtype: torch.dtype) -> tuple[Qwen3MoeSparseMoeBlock, FusedMoE, FusedMoE]:
    hidden, inter, experts, top_k = SHAPES[shape]
    config = AutoConfig.for_model(
        "qwen3_moe",
        hidden_size=hidden,
        num_experts=experts,
        moe_intermediate_size=inter,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
    )
    config._experts_implementation = "grouped_mm"
    theirs = Qwen3MoeSparseMoeBlock(config)
    for p in theirs.parameters():
        p.data.normal_(0, 0.02)
    theirs = theirs.to(dtype).eval()
    ours = []
    for kernel in (True, False):
        layer = FusedMoE(hidden, inter, experts, top_k, True).to(dtype)
        layer.gate.weight.data.copy_(theirs.gate.weight)
        layer.w13.data.copy_(theirs.experts.gate_up_proj.data)
        layer.w2.data.copy_(theirs.experts.down_proj.data)
        available = cpu_moe.available
        if not kernel:
            cpu_moe.available = lambda dtype: False  # type: ignore[assignment]
        try:
            assert layer.pack(16), "the layer did not pack"
        finally:
            cpu_moe.available = available
        assert (layer.panels is not None) == kernel, "no grouped experts kernel on this CPU"
        ours.append(layer)
    return theirs, ours[0], ours[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-moe-small")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--tokens", default="1,16,128")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    theirs, kernel, loop = layers(args.shape, dtype)
    print(f"{args.shape}, {args.dtype}, {args.threads} thread(s), {args.rounds} rounds")
    with torch.inference_mode():
        for n in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(n, SHAPES[args.shape][0], dtype=dtype)
            calls: dict[str, Callable[[], torch.Tensor]] = {
                "kernel": lambda x=x: kernel(x),
                "loop": lambda x=x: loop(x),
                "transformers": lambda x=x: theirs(x[None])[0],
            }
            reference = calls["transformers"]().float()
            diff = max((calls[k]().float() - reference).abs().max().item() for k in calls)
            times: dict[str, list[float]] = {k: [] for k in calls}
            names = list(calls)
            for r in range(args.rounds):
                for name in names[r % 3 :] + names[: r % 3]:
                    start = time.perf_counter()
                    calls[name]()
                    times[name].append(time.perf_counter() - start)
            med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            line = ", ".join(f"{k} {v:.2f} ms" for k, v in med.items())
            for other in ("loop", "transformers"):
                ratios = [a / b for a, b in zip(times[other], times["kernel"], strict=True)]
                line += (
                    f"; {other} / kernel {statistics.median(ratios):.2f}x"
                    f" ({min(ratios):.2f}-{max(ratios):.2f})"
                )
            print(f"{n} tokens: {line}; largest output difference {diff:g}")


if __name__ == "__main__":
    main()
