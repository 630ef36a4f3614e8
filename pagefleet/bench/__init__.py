"""What `pagefleet bench` runs: the load tools a user points at an engine or a server.

- offline: `LLM.generate` against transformers (and vLLM's, with `--vllm-python`)
- serve: a load test of OpenAI-compatible servers
- fairness: two tenants on a saturated fleet, fair queuing against first come, first served

Each writes a markdown table and a PNG plot, headed by the command that produced them.
The research benchmarks and the fleet simulator are the development-only `pagefleet-lab`
(lab/ in the repository), which imports these. What they share, one module per job:

- stats: the one percentile (linear interpolation, numpy's default) and slope
- workloads: seeded request lists (`BenchRequest`)
- client: the streaming client (SSE lines, TTFT / inter-token gaps, closed loop)
- metrics: /metrics pages, counter deltas, waiting for an idle fleet
- launcher: free ports, the one readiness check, `pagefleet serve` / any server
- machine: the machine and versions a result is headed with, the load meanwhile
- report: the markdown + PNG writer
- checkpoint: the checkpoint a benchmark runs on (`ensure_model`)
- vllm_child: vLLM in its own python (a child script, or its API server's command)
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
    from pagefleet.bench.serve import add_parser as add_serve_parser

    add_serve_parser(sub)
    from pagefleet.bench.fairness import add_parser as add_fairness_parser

    add_fairness_parser(sub)


def run_bench(args: argparse.Namespace) -> int:
    import importlib

    return importlib.import_module(f"{__name__}.{args.bench}").run(args)
