"""One mixture-of-experts layer: pagefleet's grouped experts kernel, its per-expert loop, and
transformers' block.

Shapes: `qwen3-30b-a3b` (128 experts of 768, top 8, hidden 2048), `qwen3-moe-small` (the
make-model preset's: 64 experts of 384, top 8, hidden 1024) or `gpt-oss-20b` (gpt-oss-20b's
layer: 32 experts of 2880, top 4, hidden 2880, biased experts with the clamped SwiGLU). All
three hold the same weights: "kernel" is the layer packed as the engine packs it on this
CPU (`kernels/cpu_moe.py`, one C call), "loop" the path CPUs without the kernel take (the
Qwen3-MoE layer packed per expert, `cpu_gemm.PackedWeight`; gpt-oss's torch loop,
`clamped_swiglu_experts`), "transformers" its block at its default experts implementation
(`grouped_mm`; gpt-oss's `GptOssMLP` with its gate/up columns interleaved, loaded into
ours as the engine loads a checkpoint). Each round times one call of each, the order
rotating every round, so all see the same machine load; the report is the median time over
rounds, the median of the per-round ratios with their range, and the outputs' largest
difference from transformers'.

    python benchmarks/moe_layer.py [--shape qwen3-moe-small] [--dtype float32] \\
        [--threads 1] [--rounds 9] [--tokens 1,16,128]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn
from transformers import AutoConfig, PretrainedConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from pagefleet.engine.layers.moe import ClampedSwigluMoE, FusedMoE
from pagefleet.kernels import cpu_moe

# hidden, intermediate, experts, top k
SHAPES = {
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "qwen3-moe-small": (1024, 384, 64, 8),
    "gpt-oss-20b": (2880, 2880, 32, 4),
}
Layer = Callable[[torch.Tensor], torch.Tensor]


def transformers_block(
    cls: type[nn.Module], dtype: torch.dtype, model_type: str, **fields: object
) -> tuple[nn.Module, PretrainedConfig]:
    """transformers' MoE block `cls` with random weights, at its default experts implementation."""
    config = AutoConfig.for_model(model_type, **fields)
    config._experts_implementation = "grouped_mm"
    block = cls(config)
    for p in block.parameters():
        p.data.normal_(0, 0.02)
    return block.to(dtype).eval(), config


def layers(shape: str, dtype: torch.dtype) -> tuple[Layer, nn.Module, nn.Module]:
    """(transformers' block as a [tokens, hidden] call, the kernel's layer, the loop's)."""
    if shape.startswith("gpt-oss"):
        return gpt_oss_layers(shape, dtype)
    hidden, inter, experts, top_k = SHAPES[shape]
    theirs, _ = transformers_block(
        Qwen3MoeSparseMoeBlock,
        dtype,
        model_type="qwen3_moe",
        hidden_size=hidden,
        num_experts=experts,
        moe_intermediate_size=inter,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
    )
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
    return lambda x: theirs(x[None])[0], ours[0], ours[1]


def gpt_oss_layers(
    shape: str, dtype: torch.dtype
) -> tuple[Layer, ClampedSwigluMoE, ClampedSwigluMoE]:
    hidden, inter, experts, top_k = SHAPES[shape]
    theirs, config = transformers_block(
        GptOssMLP,
        dtype,
        model_type="gpt_oss",
        hidden_size=hidden,
        intermediate_size=inter,
        num_local_experts=experts,
        num_experts_per_tok=top_k,
    )
    ours = []
    for kernel in (True, False):
        layer = ClampedSwigluMoE(
            hidden, inter, experts, top_k, config.swiglu_limit, config.swiglu_alpha
        ).to(dtype)
        layer.gate.weight.data.copy_(theirs.router.weight)
        layer.gate.bias.data.copy_(theirs.router.bias)
        e = theirs.experts
        for param, loaded in (
            (layer.w13, e.gate_up_proj),
            (layer.b13, e.gate_up_proj_bias),
            (layer.w2, e.down_proj),
            (layer.b2, e.down_proj_bias),
        ):
            layer.weight_loader(param, loaded.data, None)
        if kernel:
            assert layer.pack(16), "no grouped experts kernel on this CPU"
        ours.append(layer)
    return lambda x: theirs(x[None])[0][0], ours[0], ours[1]


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
    transformers, kernel, loop = layers(args.shape, dtype)
    print(f"{args.shape}, {args.dtype}, {args.threads} thread(s), {args.rounds} rounds")
    with torch.inference_mode():
        for n in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(n, SHAPES[args.shape][0], dtype=dtype)
            calls: dict[str, Callable[[], torch.Tensor]] = {
                "kernel": lambda x=x: kernel(x),
                "loop": lambda x=x: loop(x),
                "transformers": lambda x=x: transformers(x),
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
