"""The decode GEMM (`kernels/cpu_panel_gemm.c`) against oneDNN's packed GEMM, by rows.

A decode step reads every weight of the model once. To time that and not a cache-warm
loop over one matrix, each timed pass runs one GEMM per layer over 30 layers of distinct
random weights in SmolLM-135M's shapes (QKV 576->960, output 576->576, gate/up
576->3,072, down 1,536->576: 424 MB of fp32, half in bf16) and then the LM head
(576->49,152, 113 MB in fp32),
as a step does; the time is the fastest of `--reps` passes. Both sides hold their own
packed copy of the same weights. Reported per rows and threads: ms per pass (layers and
head) and the weight bytes read per second. Writes OUT.md and OUT.png.

    python benchmarks/decode_gemm.py --threads 1,2 --out benchmarks/results/decode_gemm

`--dtype bfloat16` times the bf16 twin (AVX512-BF16's vdpbf16ps) against oneDNN's bf16
GEMM on bf16 weights and inputs.

`--avx2` runs both sides as an AVX2-only CPU would: oneDNN capped at AVX2
(`ONEDNN_MAX_CPU_ISA`), the panel kernel built with `-mno-avx512f` into a scratch cache.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable

import torch

from pagefleet.bench.machine import machine_description
from pagefleet.bench.report import markdown_table, pyplot, save_png, write_report
from pagefleet.kernels import cpu_build, cpu_panel_gemm

LAYERS = 30
SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576))  # (in, out) per layer
HEAD = (576, 49152)
ROWS = (1, 4, 8, 16, 20, 32, 48, 64, 128)


def fastest(fn: Callable[[], object], reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def onednn(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def time_rows(
    rows: int,
    dtype: torch.dtype,
    weights: list[list[torch.Tensor]],
    panels: list[list[torch.Tensor]],
    head: torch.Tensor,
    head_panels: torch.Tensor,
    reps: int,
) -> dict[str, float]:
    """Seconds for a pass of each kind at `rows` rows (fastest of `reps`)."""
    gen = torch.Generator().manual_seed(rows)
    xs = {i: torch.randn(rows, i, generator=gen).to(dtype) for i, _ in SHAPES}
    # oneDNN packs for a batch size: each row count gets its own, as the engine's would.
    dnn = [[torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in layer] for layer in weights]
    dnn_head = torch.ops.mkldnn._reorder_linear_weight(head, rows)

    def layers_dnn() -> None:
        for layer in dnn:
            for (i, _), p in zip(SHAPES, layer, strict=True):
                onednn(xs[i], p)

    def layers_panels() -> None:
        for layer in panels:
            for (i, o), p in zip(SHAPES, layer, strict=True):
                cpu_panel_gemm.linear(xs[i], p, o, None)

    return {
        "layers, oneDNN": fastest(layers_dnn, reps),
        "layers, panels": fastest(layers_panels, reps),
        "head, oneDNN": fastest(lambda: onednn(xs[576], dnn_head), reps),
        "head, panels": fastest(
            lambda: cpu_panel_gemm.linear(xs[576], head_panels, HEAD[1], None), reps
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/decode_gemm")
    parser.add_argument("--avx2", action="store_true", help="both sides as on an AVX2-only CPU")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    if args.avx2:
        # Before oneDNN's first primitive and the library's first build.
        os.environ["ONEDNN_MAX_CPU_ISA"] = "AVX2"
        os.environ[cpu_build.CACHE_ENV] = tempfile.mkdtemp(prefix="pagefleet-avx2-")
        cpu_build.COMPILE_FLAGS = (*cpu_build.COMPILE_FLAGS, "-mno-avx512f")
    if not cpu_panel_gemm.available(dtype):
        raise SystemExit(
            f"the panel GEMM for {args.dtype} is not built here (fp32 needs AVX-512F or "
            "AVX2+FMA, bf16 AVX512-BF16; both gcc)"
        )
    gen = torch.Generator().manual_seed(0)
    weights = [
        [torch.randn(o, i, generator=gen).to(dtype) for i, o in SHAPES] for _ in range(LAYERS)
    ]
    head = torch.randn(HEAD[1], HEAD[0], generator=gen).to(dtype)
    layer_bytes = sum(w.numel() * w.element_size() for layer in weights for w in layer)
    head_bytes = head.numel() * head.element_size()
    panels = [[cpu_panel_gemm.pack(w) for w in layer] for layer in weights]
    head_panels = cpu_panel_gemm.pack(head)

    table, series = [], {}
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for rows in ROWS:
            times = time_rows(rows, dtype, weights, panels, head, head_panels, args.reps)
            gbs = {
                k: (layer_bytes if k.startswith("layers") else head_bytes) / t / 1e9
                for k, t in times.items()
            }
            step_dnn = times["layers, oneDNN"] + times["head, oneDNN"]
            step_panels = times["layers, panels"] + times["head, panels"]
            table.append(
                [
                    threads,
                    rows,
                    *(f"{times[k] * 1e3:.1f} ({gbs[k]:.1f})" for k in times),
                    f"**{step_dnn / step_panels:.2f}x**",
                ]
            )
            for k in ("layers, oneDNN", "layers, panels"):
                series.setdefault((threads, k), []).append(gbs[k])
            print(table[-1], flush=True)

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for (threads, kind), values in series.items():
        style = "-" if "panels" in kind else "--"
        ax.plot(ROWS, values, style, marker="o", label=f"{kind}, {threads} thread(s)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rows (sequences in the decode step)")
    ax.set_ylabel(f"weight GB/s (30 layers, {layer_bytes / 1e6:.0f} MB)")
    ax.set_title(f"decode GEMM: panels vs oneDNN, {args.dtype}")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    save_png(fig, args.out, dpi=110)
    body = (
        f"{machine_description()} Panel width {cpu_panel_gemm.panel_width()} floats"
        + (" (AVX2 on both sides: `--avx2`)" if args.avx2 else "")
        + f". {args.dtype}. Each cell: ms for a pass (fastest of {args.reps}) and, "
        "in brackets, the weight GB/s it read. Step: (layers + head) oneDNN / panels.\n\n"
        + markdown_table(
            [
                "threads",
                "rows",
                "layers, oneDNN",
                "layers, panels",
                "head, oneDNN",
                "head, panels",
                "step speed-up",
            ],
            table,
        )
    )
    write_report(
        args.out,
        "The decode GEMM: panels vs oneDNN",
        body,
        command=f"python benchmarks/decode_gemm.py --threads {args.threads} --out {args.out}"
        + (" --avx2" if args.avx2 else "")
        + (f" --dtype {args.dtype}" if args.dtype != "float32" else ""),
    )


if __name__ == "__main__":
    main()
