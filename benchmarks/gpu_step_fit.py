"""The simulator's GPU step model against our engine's real steps on a GPU (issue 22).

`pagefleet-lab simulate` times an H200 fleet by a roofline **model**
(`sim_step_model.RooflineStepModel`: max(bytes / HBM bandwidth, FLOPs / peak) plus a
fixed 2 ms a step), never by a measurement. This script measures: it steps our engine on
the GPU it runs on (bf16, CUDA graphs and the compiled forward as a replica serves,
prefix caching off so that every prompt computes) over batches that span the
simulator's shapes (a 7,000-token prefill, decode batches of 1-256 sequences, contexts
of up to 4,000 tokens, mixed steps), fits the simulator's linear step model to them
(`fit_linear`: t = a + b * prefill + c * decode_seqs + d * attended_kv) and sets each
measured step beside the roofline of the same model shape on an H200
(`llama_on_h200`, the constructor of the simulator's Llama-3.1-8B model, here with the
checkpoint's own shape).

Usage, on the GPU machine (about 2 minutes once the checkpoint exists):

    python benchmarks/gpu_step_fit.py --model models/llama-1b --out benchmarks/results/gpu_step_fit

Writes OUT.md (the fit, the roofline's error by step kind, every shape) and OUT.json.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

from pagefleet.bench.machine import machine_description
from pagefleet.bench.report import markdown_table
from pagefleet_lab.sim.step_model import (
    Batch,
    RooflineStepModel,
    StepShape,
    fit_linear,
    llama_on_h200,
    measure_engine_steps,
)

# (requests, prompt tokens, max tokens, steps between two adds): prefill-bound steps (one
# 7,000-token prompt; four 2,000-token ones in one 8,192-token step), decode-bound ones
# (1-256 sequences, short and 4,000-token contexts) and the mixed steps of a staggered batch.
GPU_FIT_BATCHES: tuple[Batch, ...] = (
    (1, 7000, 8, 0),
    (1, 1024, 16, 0),
    (4, 2000, 16, 0),
    (16, 512, 48, 0),
    (64, 256, 48, 0),
    (128, 512, 32, 0),
    (256, 128, 32, 0),
    (32, 4000, 32, 0),
    (8, 1500, 48, 2),
)


def roofline_for(config_json: dict) -> RooflineStepModel:
    """The simulator's H200 roofline for the checkpoint's shape (bf16)."""
    hidden = config_json["hidden_size"]
    layers = config_json["num_hidden_layers"]
    heads = config_json["num_attention_heads"]
    kv_heads = config_json.get("num_key_value_heads", heads)
    inter = config_json["intermediate_size"]
    vocab = config_json["vocab_size"]
    head_dim = config_json.get("head_dim") or hidden // heads
    per_layer = (
        hidden * head_dim * (heads + 2 * kv_heads)  # q, k, v
        + heads * head_dim * hidden  # o
        + 3 * hidden * inter  # gate, up, down
    )
    embeddings = vocab * hidden * (1 if config_json.get("tie_word_embeddings") else 2)
    params = layers * per_layer + embeddings
    name = f"H200 + {Path(config_json.get('_name_or_path', 'model')).name} bf16 (roofline model)"
    return llama_on_h200(name, params, layers, kv_heads, head_dim, heads)


def write_llama8b(out: Path, seed: int = 0, device: str = "cuda") -> None:
    """A checkpoint of Llama-3.1-8B's shape (the simulator's named model) with seeded
    random bf16 weights (normal, std 0.02; norms 1), generated on the GPU: `pagefleet
    make-model` builds fp32 weights on the CPU, minutes at this size. Its tokenizer and
    config are make-model's (the same 128,256-token vocabulary as the llama-1b preset)."""
    import torch
    from safetensors.torch import save_file
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    from pagefleet.cluster.make_model import hf_config_fields, train_tokenizer
    from pagefleet.cluster.model_presets import PRESETS

    out.mkdir(parents=True, exist_ok=True)
    shape = PRESETS["llama-8b"]
    tokenizer = train_tokenizer(shape.vocab_size)
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = LlamaConfig(
        architectures=["LlamaForCausalLM"],
        torch_dtype="bfloat16",
        **hf_config_fields(shape, eos),  # type: ignore[arg-type]
    )
    with torch.device("meta"):
        names = {k: tuple(v.shape) for k, v in LlamaForCausalLM(config).state_dict().items()}
    gen = torch.Generator(device=device).manual_seed(seed)
    shard: dict[str, torch.Tensor] = {}
    size, index = 0, 0
    for name, dims in names.items():
        if name.endswith("norm.weight"):
            t = torch.ones(dims, dtype=torch.bfloat16)
        else:
            t = (torch.randn(dims, generator=gen, device=device) * 0.02).to(torch.bfloat16)
        shard[name] = t.cpu()
        size += t.numel() * 2
        if size > 4e9:
            save_file(shard, str(out / f"model-{index:05d}.safetensors"), {"format": "pt"})
            shard, size, index = {}, 0, index + 1
    if shard:
        save_file(shard, str(out / f"model-{index:05d}.safetensors"), {"format": "pt"})
    config.save_pretrained(out)
    GenerationConfig(bos_token_id=eos, eos_token_id=eos, pad_token_id=eos).save_pretrained(out)
    tokenizer.save_pretrained(out)


def kind_of(shape: StepShape) -> str:
    if shape.prefill_tokens and shape.decode_seqs:
        return "mixed"
    return "prefill" if shape.prefill_tokens else "decode"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/llama-1b")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cuda", help="cpu: a smoke test of the script itself")
    p.add_argument("--batches", type=int, default=len(GPU_FIT_BATCHES), help="the first N")
    p.add_argument("--num-kv-blocks", type=int, default=16384, help="KV pool (16 tokens each)")
    p.add_argument(
        "--make-llama8b",
        action="store_true",
        help="first write --model as a Llama-3.1-8B-shaped checkpoint (write_llama8b)",
    )
    p.add_argument("--out", default="benchmarks/results/gpu_step_fit")
    args = p.parse_args()

    import torch

    from pagefleet.engine.config import EngineConfig

    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise SystemExit("gpu_step_fit: no CUDA device")
    if args.make_llama8b:
        t0 = time.perf_counter()
        write_llama8b(Path(args.model))
        print(f"wrote {args.model} in {time.perf_counter() - t0:.0f} s", flush=True)
    config = EngineConfig(
        model=args.model,
        dtype="bfloat16" if cuda else "float32",
        device=args.device,
        block_size=16,
        num_kv_blocks=args.num_kv_blocks if cuda else 2048,  # every batch fits: no preemption
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        enable_prefix_caching=False,
    )
    t0 = time.perf_counter()
    info: dict = {}
    shapes, seconds = measure_engine_steps(
        args.model,
        GPU_FIT_BATCHES[: args.batches],
        repeats=args.repeats,
        config=config,
        info=info,
    )
    wall = time.perf_counter() - t0
    device = torch.cuda.get_device_name() if cuda else "cpu"
    fit = fit_linear(shapes, seconds, name=f"{device} fit", engine=info)
    model_json = json.loads((Path(args.model) / "config.json").read_text())
    model_json.setdefault("_name_or_path", args.model)
    roof = roofline_for(model_json)

    rows = []
    ratios: dict[str, list[float]] = {"prefill": [], "decode": [], "mixed": []}
    for shape, t in sorted(
        zip(shapes, seconds, strict=True), key=lambda st: (kind_of(st[0]), st[0])
    ):
        predicted = roof.seconds(shape)
        ratios[kind_of(shape)].append(t / predicted)
        rows.append(
            [
                kind_of(shape),
                shape.prefill_tokens,
                shape.decode_seqs,
                shape.attended_kv_tokens,
                f"{t * 1e3:.2f}",
                f"{fit.model.seconds(shape) * 1e3:.2f}",
                f"{predicted * 1e3:.2f}",
                f"{t / predicted:.2f}",
            ]
        )
    summary = [
        [k, len(v), f"{statistics.median(v):.2f}", f"{min(v):.2f}", f"{max(v):.2f}"]
        for k, v in ratios.items()
        if v
    ]
    m = fit.model
    lines = [
        "# The GPU step model against the engine's real steps",
        "",
        f"Command: `python benchmarks/gpu_step_fit.py {' '.join(sys.argv[1:])}`",
        "",
        f"{machine_description()} Device: {device}, torch {torch.__version__} "
        f"(CUDA {torch.version.cuda}).",
        "",
        f"Engine: {info.get('model')}, {config.dtype}, {info.get('timed')}, each shape's "
        f"{info.get('kept')} of {args.repeats} repeats; {len(shapes)} distinct step shapes "
        f"measured in {wall:.0f} s (start-up and compilation included).",
        "",
        f"Fit: t = {m.a * 1e3:.3f} ms + {m.b * 1e6:.3f} us per prompt token + "
        f"{m.c * 1e6:.2f} us per decoding sequence + {m.d * 1e9:.3f} ns per attended KV "
        f"token; R^2 {fit.r2:.3f}, median |residual| {fit.median_abs_rel:.1%} of the step, "
        f"max |residual| {fit.max_abs_residual_s * 1e3:.2f} ms.",
        "",
        f"Roofline ({roof.name}): {roof.weight_bytes / 1e9:.2f} GB of weights, "
        f"{roof.kv_bytes_per_token:,.0f} KV bytes a token, "
        f"{roof.hbm_bytes_per_s / 1e12:g} TB/s, {roof.peak_flops / 1e12:g} TFLOP/s, "
        f"{roof.overhead_s * 1e3:g} ms a step.",
        "",
        "Measured / roofline, by step kind:",
        "",
        markdown_table(["steps", "shapes", "median", "min", "max"], summary),
        "",
        "Every shape (ms):",
        "",
        markdown_table(
            [
                "kind",
                "prefill tokens",
                "decode seqs",
                "attended KV",
                "measured",
                "fit",
                "roofline",
                "measured / roofline",
            ],
            rows,
        ),
        "",
    ]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text("\n".join(lines))
    out.with_suffix(".json").write_text(
        json.dumps(
            {
                "fit": fit.to_json(),
                "roofline": {
                    k: (v if not isinstance(v, float) or math.isfinite(v) else None)
                    for k, v in vars(roof).items()
                },
                "steps": [[*s, t] for s, t in zip(shapes, seconds, strict=True)],
            },
            indent=1,
        )
    )
    print("\n".join(lines[:14]))


if __name__ == "__main__":
    main()
