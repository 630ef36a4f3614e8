"""One mixture-of-experts layer, pagefleet's against transformers', at Qwen3-30B-A3B's shape.

Both layers hold the same bf16 weights (128 experts of 768, top 8, hidden 2048);
transformers' block runs its default experts implementation (`grouped_mm`).
Each round times one call of each, alternating, so both see the same machine
load; the report is the median over rounds, and the outputs' largest difference.

    python benchmarks/moe_layer.py [--threads 2] [--rounds 5] [--tokens 16,128]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import AutoConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from pagefleet.engine.layers.moe import FusedMoE

HIDDEN, INTER, EXPERTS, TOP_K = 2048, 768, 128, 8


def layers() -> tuple[Qwen3MoeSparseMoeBlock, FusedMoE]:
    config = AutoConfig.for_model(
        "qwen3_moe",
        hidden_size=HIDDEN,
        num_experts=EXPERTS,
        moe_intermediate_size=INTER,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=True,
    )
    config._experts_implementation = "grouped_mm"
    theirs = Qwen3MoeSparseMoeBlock(config)
    for p in theirs.parameters():
        p.data.normal_(0, 0.02)
    theirs = theirs.to(torch.bfloat16).eval()
    ours = FusedMoE(HIDDEN, INTER, EXPERTS, TOP_K, True).to(torch.bfloat16)
    ours.gate.weight.data.copy_(theirs.gate.weight)
    ours.w13.data.copy_(theirs.experts.gate_up_proj.data)
    ours.w2.data.copy_(theirs.experts.down_proj.data)
    return theirs, ours


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", default="16,128")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    theirs, ours = layers()
    with torch.inference_mode():
        for n in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(n, HIDDEN, dtype=torch.bfloat16)
            diff = (ours(x).float() - theirs(x.unsqueeze(0))[0].float()).abs().max().item()
            times: dict[str, list[float]] = {"pagefleet": [], "transformers": []}
            for _ in range(args.rounds):
                for name, layer, inputs in (
                    ("pagefleet", ours, x),
                    ("transformers", theirs, x[None]),
                ):
                    start = time.perf_counter()
                    layer(inputs)
                    times[name].append(time.perf_counter() - start)
            ours_s, theirs_s = (statistics.median(times[k]) for k in ("pagefleet", "transformers"))
            print(
                f"{n} tokens: pagefleet {ours_s * 1e3:.1f} ms, transformers {theirs_s * 1e3:.1f} ms, "
                f"pagefleet {theirs_s / ours_s:.2f}x; largest output difference {diff:g}"
            )


if __name__ == "__main__":
    main()
