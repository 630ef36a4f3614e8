"""What `pagefleet bench` runs. Each benchmark writes a markdown table and a PNG
plot to benchmarks/results/, headed by the command that produced them.

One file per scenario: offline (with paired: pagefleet and vLLM up together, taking
turns), kv_waste, prefix, sharing, serve, router (with router_report), router_cost,
core_message, autoscale, simulate (with sim_fleet, sim_policies, sim_workloads,
sim_step_model), soak (with soak_load, soak_watch, soak_report). What they share, one module per job:

- stats: the one percentile (linear interpolation, numpy's default) and slope
- workloads: seeded request lists (`BenchRequest`)
- client: the streaming client (SSE lines, TTFT / inter-token gaps, closed loop)
- metrics: /metrics pages, counter deltas, waiting for an idle fleet
- launcher: free ports, the one readiness check, `pagefleet serve` / any server
- machine: the machine and versions a result is headed with, the load meanwhile
- report: the markdown + PNG writer
- checkpoint: the checkpoint a benchmark runs on (`ensure_model`)
- vllm_child: vLLM in its own python (a child script, or its API server's command)
- checks: the pytest runner behind the results writers gpu_check and vllm_parity,
  whose checks are tests (tests/gpu, `-m gpu`; tests/vllm, `-m vllm`)
"""

from __future__ import annotations

import argparse


def add_bench_parser(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", required=True)
    off = sub.add_parser("offline", help="LLM.generate vs transformers, fp32 and bf16")
    off.add_argument(
        "--model", default="models/smollm-135m", help="created if missing (smollm-135m preset)"
    )
    off.add_argument("--dtypes", default="float32,bfloat16")
    off.add_argument(
        "--loads",
        default="20x50,64x128",
        help="comma list of REQUESTSxNEW_TOKENS, or REQUESTSxNEW_TOKENS@PROMPT_TOKENS",
    )
    off.add_argument("--threads", type=int, default=2)
    off.add_argument(
        "--pagefleet-modes",
        default="compiled,eager",
        help="comma list of pagefleet runs: compiled (torch.compile, the default engine) "
        "and/or eager (enforce_eager=True)",
    )
    off.add_argument("--max-model-len", type=int, default=256)
    off.add_argument(
        "--kv-gib", type=float, default=2.0, help="KV cache of each engine (vLLM's KV space)"
    )
    off.add_argument(
        "--sequential-cap",
        type=int,
        default=8,
        help="one-at-a-time runs time at most this many requests (a per-request rate); "
        "0 leaves them out",
    )
    off.add_argument(
        "--skip",
        default="",
        help="comma list of systems to leave out, each by its name or leading words "
        "(e.g. transformers, 'pagefleet one at a time', vLLM is --vllm-python's)",
    )
    off.add_argument(
        "--vllm-python",
        default=None,
        help="python of a venv with vLLM's CPU build (BENCHMARKS.md): runs its LLM.generate "
        "on the same prompts in the same run",
    )
    off.add_argument("--out", default="benchmarks/results/offline")
    pre = sub.add_parser("prefix", help="prefix caching on vs off: TTFT and throughput")
    pre.add_argument("--model", default="models/smollm-135m")
    pre.add_argument("--dtype", default="float32")
    pre.add_argument("--requests", type=int, default=32)
    pre.add_argument("--system-tokens", type=int, default=1024)
    pre.add_argument("--question-tokens", type=int, default=32)
    pre.add_argument("--max-tokens", type=int, default=16)
    pre.add_argument("--threads", type=int, default=2)
    pre.add_argument("--out", default="benchmarks/results/prefix")
    sh = sub.add_parser(
        "sharing", help="KV blocks for n samples with and without copy-on-write sharing"
    )
    sh.add_argument("--model", default="models/smollm-135m")
    sh.add_argument("--ns", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4, 8])
    sh.add_argument("--prompt-tokens", type=int, default=200)
    sh.add_argument("--max-tokens", type=int, default=32)
    sh.add_argument("--requests", type=int, default=16)
    sh.add_argument("--budget-blocks", type=int, default=160)
    sh.add_argument("--threads", type=int, default=2)
    sh.add_argument("--out", default="benchmarks/results/sharing")
    kv = sub.add_parser("kv-waste", help="paged vs contiguous KV reservation (seed article)")
    kv.add_argument("--lengths", default="45,128,23,256,67")
    kv.add_argument("--max-model-len", type=int, default=512)
    kv.add_argument("--block-size", type=int, default=16)
    kv.add_argument("--budget-tokens", type=int, default=8192)
    kv.add_argument("--out", default="benchmarks/results/kv_waste")
    from .serve import add_parser as add_serve_parser

    add_serve_parser(sub)
    from .soak import add_parser as add_soak_parser

    add_soak_parser(sub)
    from .router import add_parser as add_router_parser

    add_router_parser(sub)
    from .router_cost import add_parser as add_router_cost_parser

    add_router_cost_parser(sub)
    from .core_message import add_parser as add_core_message_parser

    add_core_message_parser(sub)
    from .autoscale import add_parser as add_autoscale_parser

    add_autoscale_parser(sub)
    from .simulate import add_parser as add_simulate_parser

    add_simulate_parser(sub)
    from .paired import add_parser as add_paired_parser

    add_paired_parser(sub)


def run_bench(args: argparse.Namespace) -> int:
    import importlib

    module = {
        "offline": "offline",
        "kv-waste": "kv_waste",
        "prefix": "prefix",
        "sharing": "sharing",
        "serve": "serve",
        "soak": "soak",
        "router": "router",
        "router-cost": "router_cost",
        "core-message": "core_message",
        "autoscale": "autoscale",
        "simulate": "simulate",
        "paired": "paired",
    }
    return importlib.import_module(f"{__name__}.{module[args.bench]}").run(args)
