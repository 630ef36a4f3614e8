"""Where one model step's time goes: eager against compiled, by layer part, with torch's profiler.

    python benchmarks/profile_step.py --model models/smollm-135m --threads 2 \\
        --out benchmarks/results/profile_step

Builds two engines on the same checkpoint in this process (`enforce_eager=True` and
the compiled forward) and times, alternating between them, three steps made by
hand: a decode step of 20 sequences of 40 tokens of context (the short load
midway), a decode step of 16 sequences of 1,230 tokens (the long load), and a prefill
step of one 1,200-token prompt. Each is the model runner's `forward` (the model and
the LM head on the sampled rows) plus greedy sampling; the figure is the fastest of
REPS runs (the machine is shared: the fastest is the least disturbed).

Then each step runs once under `torch.profiler`, and its time is put in parts:

- eager: every module of a layer is wrapped in a `record_function` range (norms,
  the QKV and output projections, rotary, attention, the MLP's GEMMs and SiLU-and-mul),
  plus embedding, final norm, LM head and sampling; a part's time is its ranges' total;
- compiled: inductor's generated kernels are named after the operations they fuse
  (`cpp_fused_..._rsqrt_...` is a norm with its residual add), the custom ops
  (`pagefleet::packed_linear`, `pagefleet::attention`) are found in layer order.

"Kernels" is the summed self time of the operators that compute (aten ops, oneDNN
GEMMs, inductor kernels); "Python and dispatch overhead" is the rest of the step's
wall time under the profiler: interpreter, module calls, dispatcher, guards.
Writes OUT.md (a table per step) and OUT.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from pagefleet.bench.machine import machine_description
from pagefleet.bench.report import markdown_table, write_report
from pagefleet.engine import LLM, SamplingParams
from pagefleet.engine.model_runner import ModelRunner, StepInputs
from pagefleet.engine.sampler import SamplingBatch
from pagefleet.kernels import build_attention_metadata

PARTS = [
    "embedding",
    "norms (+ residual add)",
    "QKV + output projections",
    "rotary",
    "attention (K/V store + paged attention)",
    "MLP (gate/up + down GEMMs)",
    "MLP SiLU-and-mul",
    "LM head",
    "sampling",
    "other fused elementwise",
]


def step_inputs(runner: ModelRunner, query_lens: list[int], context_lens: list[int]) -> StepInputs:
    """A step of sequences with these query and context lengths, in disjoint blocks."""
    bs = runner.capacity.block_size
    tables, next_block = [], 0
    for c in context_lens:
        used = -(-c // bs)
        tables.append(list(range(next_block, next_block + used)))
        next_block += used
    assert next_block <= runner.capacity.num_kv_blocks, "KV cache too small for the step"
    ids, pos, rows = [], [], []
    for q, c in zip(query_lens, context_lens, strict=True):
        ids += [(7 * i) % 1000 + 1 for i in range(q)]
        pos += list(range(c - q, c))
        rows.append(len(ids) - 1)
    meta = build_attention_metadata(query_lens, context_lens, tables, bs, padded=True)
    return StepInputs(
        input_ids=torch.tensor(ids),
        positions=torch.tensor(pos),
        meta=meta,
        blocks_to_copy=[],
        logit_rows=torch.tensor(rows),
    )


STEPS: dict[str, tuple[list[int], list[int]]] = {
    "decode, 20 seqs x 40 tokens of context": ([1] * 20, [40] * 20),
    "decode, 16 seqs x 1,230 tokens of context": ([1] * 16, [1230] * 16),
    "prefill, one prompt of 1,200 tokens": ([1200], [1200]),
}


def run_step(runner: ModelRunner, inputs: StepInputs, batch: SamplingBatch) -> None:
    with torch.inference_mode():
        logits, _ = runner.forward(inputs)
        with record_function("part: sampling"):
            runner.sampler(logits, batch)


def best_of(fn: Callable[[], None], reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def label_eager(model: torch.nn.Module) -> None:
    """Wrap each part of the eager model in a record_function range."""
    from pagefleet.engine.models import llama

    def wrap(module: torch.nn.Module, part: str) -> None:
        inner = module.forward

        def forward(*args, **kwargs):
            with record_function(f"part: {part}"):
                return inner(*args, **kwargs)

        module.forward = forward

    wrap(model.embed_tokens, "embedding")
    wrap(model.norm, "norms (+ residual add)")
    for layer in model.layers:
        wrap(layer.input_layernorm, "norms (+ residual add)")
        wrap(layer.post_attention_layernorm, "norms (+ residual add)")
        wrap(layer.self_attn.qkv_proj, "QKV + output projections")
        wrap(layer.self_attn.o_proj, "QKV + output projections")
        wrap(layer.self_attn.attn, "attention (K/V store + paged attention)")
        wrap(layer.mlp.gate_up_proj, "MLP (gate/up + down GEMMs)")
        wrap(layer.mlp.down_proj, "MLP (gate/up + down GEMMs)")
        wrap(layer.mlp.act, "MLP SiLU-and-mul")
    rotary = llama.apply_rotary

    def apply_rotary(x, rope):
        with record_function("part: rotary"):
            return rotary(x, rope)

    llama.apply_rotary = apply_rotary
    label_head(model)


def label_head(model: torch.nn.Module) -> None:
    """The LM head runs outside the compiled graph on both sides: label it on both."""
    head = model.compute_logits

    def compute_logits(hidden):
        with record_function("part: LM head"):
            return head(hidden)

    model.compute_logits = compute_logits


def _is_kernel(name: str) -> bool:
    return (
        name.startswith(("aten::", "mkldnn::", "mkl::")) or "cpp_fused" in name
    ) and name not in ("aten::linear", "aten::matmul")  # wrappers of the GEMM calls below


def _compiled_part(name: str) -> str | None:
    """The part an inductor kernel (graph_N_cpp_fused_<ops>_K) computes, by the ops it fuses."""
    if "cpp_fused" not in name:
        return None
    if "rsqrt" in name or "mean" in name:
        return "norms (+ residual add)"  # the first one also looks up the embedding
    if "silu" in name or "sigmoid" in name:
        return "MLP SiLU-and-mul"
    if any(op in name for op in ("cos", "sin", "cat", "neg", "sub", "index")):
        return "rotary"
    return "other fused elementwise"


def breakdown(prof, compiled: bool, wall: float) -> dict[str, float]:
    """Seconds per part, kernels, and overhead from one profiled step."""
    events = [e for e in prof.events() if e.device_type.name == "CPU"]
    parts: dict[str, float] = defaultdict(float)
    kernels = sum(e.self_cpu_time_total for e in events if _is_kernel(e.name)) / 1e6
    labelled = [e for e in events if e.name.startswith("part: ")]
    for e in labelled:
        parts[e.name.removeprefix("part: ")] += e.cpu_time_total / 1e6
    if compiled:
        # Custom ops in call order: per layer packed_linear (QKV), attention, then
        # packed_linear x3 (output projection, gate/up, down); the LM head is outside.
        ops = sorted(
            (e for e in events if e.name in ("pagefleet::packed_linear", "pagefleet::attention")),
            key=lambda e: e.time_range.start,
        )
        since_attention = None
        for e in ops:
            if e.name == "pagefleet::attention":
                parts["attention (K/V store + paged attention)"] += e.cpu_time_total / 1e6
                since_attention = 0
                continue
            if since_attention is None or since_attention >= 3:
                part = "QKV + output projections"  # a layer's first projection: QKV
            elif since_attention == 0:
                part = "QKV + output projections"
            else:
                part = "MLP (gate/up + down GEMMs)"
            if since_attention is not None:
                since_attention += 1
            parts[part] += e.cpu_time_total / 1e6
        for e in events:
            part = _compiled_part(e.name)
            if part is not None:
                parts[part] += e.self_cpu_time_total / 1e6
    parts["kernels (compute, summed)"] = kernels
    parts["Python and dispatch overhead"] = max(0.0, wall - kernels)
    parts["step (profiled wall)"] = wall
    return dict(parts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/smollm-135m")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/profile_step")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.threads == 1:
        torch._inductor.config.cpp.threads = 1
    torch._inductor.config.cpp.enable_kernel_profile = True  # names inductor's kernels
    engines = {}
    startup = {}
    for name, eager in (("eager", True), ("compiled", False)):
        start = time.perf_counter()
        engines[name] = LLM(
            model=args.model,
            dtype=args.dtype,
            enforce_eager=eager,
            max_model_len=2048,
            max_num_seqs=20,
            num_kv_blocks=1600,
            enable_prefix_caching=False,
            num_threads=args.threads,
        )
        startup[name] = time.perf_counter() - start
    runners = {n: llm.engine.token_engine.runner for n, llm in engines.items()}
    greedy = SamplingParams(temperature=0.0)
    best: dict[tuple[str, str], float] = {}
    for step, (q, c) in STEPS.items():
        inputs = step_inputs(runners["eager"], q, c)
        batch = SamplingBatch([greedy] * len(q), [None] * len(q), [])
        for _ in range(args.reps):  # alternating, so both see the same disturbances
            for name, runner in runners.items():
                t = best_of(lambda r=runner, i=inputs, b=batch: run_step(r, i, b), 1)
                best[(step, name)] = min(best.get((step, name), t), t)
    label_eager(runners["eager"].model)
    label_head(runners["compiled"].model)
    profiles: dict[tuple[str, str], dict[str, float]] = {}
    for step, (q, c) in STEPS.items():
        inputs = step_inputs(runners["eager"], q, c)
        batch = SamplingBatch([greedy] * len(q), [None] * len(q), [])
        for name, runner in runners.items():
            run_step(runner, inputs, batch)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                start = time.perf_counter()
                run_step(runner, inputs, batch)
                wall = time.perf_counter() - start
            profiles[(step, name)] = breakdown(prof, name == "compiled", wall)

    sections = []
    for step in STEPS:
        e, c = best[(step, "eager")], best[(step, "compiled")]
        rows = []
        keys = [*PARTS, "kernels (compute, summed)", "Python and dispatch overhead"]
        pe, pc = profiles[(step, "eager")], profiles[(step, "compiled")]
        for k in keys:
            a, b = pe.get(k, 0.0), pc.get(k, 0.0)
            rows.append(
                [
                    k,
                    f"{a * 1e3:.2f}",
                    f"{100 * a / pe['step (profiled wall)']:.0f}%",
                    f"{b * 1e3:.2f}",
                    f"{100 * b / pc['step (profiled wall)']:.0f}%",
                ]
            )
        rows.append(
            [
                "**step, profiled**",
                f"{pe['step (profiled wall)'] * 1e3:.1f}",
                "",
                f"{pc['step (profiled wall)'] * 1e3:.1f}",
                "",
            ]
        )
        rows.append(
            [
                f"**step, not profiled (best of {args.reps})**",
                f"{e * 1e3:.1f}",
                "",
                f"{c * 1e3:.1f}",
                f"{e / c:.2f}x",
            ]
        )
        header = ["part", "eager ms", "eager %", "compiled ms", "compiled %"]
        sections.append(f"### {step}\n\n" + markdown_table(header, rows))
    info = (
        f"Checkpoint `{args.model}` ({args.dtype}), {args.threads} threads, "
        f"{machine_description()}. Start-up in this process: eager {startup['eager']:.1f} s, "
        f"compiled {startup['compiled']:.1f} s (inductor cache as found). Parts under the "
        "profiler (its own cost inflates the eager side, which has more operator calls); "
        "part times of the eager side include their own Python; a compiled part is its "
        "kernels' or custom op's time."
    )
    body = info + "\n\n" + "\n\n".join(sections)
    print(body)
    path = write_report(
        args.out,
        "One model step, eager vs compiled, by layer part",
        body,
        command="python " + " ".join(sys.argv),
    )
    Path(args.out).with_suffix(".json").write_text(
        json.dumps(
            {
                "best_s": {f"{s} | {n}": t for (s, n), t in best.items()},
                "parts_s": {f"{s} | {n}": p for (s, n), p in profiles.items()},
                "startup_s": startup,
                "threads": args.threads,
                "dtype": args.dtype,
            },
            indent=1,
        )
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
