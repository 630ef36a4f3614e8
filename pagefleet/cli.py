"""The `pagefleet` command.

    pagefleet serve MODEL|CONFIG [--config FILE] [vLLM's flags] [--address RAY_ADDRESS]
    pagefleet make-model DIR [--preset tiny|smollm-135m|...] [--arch llama|qwen2|...] [--seed N]
    pagefleet generate --model DIR [--prompt TEXT ...] [--max-tokens N] [--temperature T]
    pagefleet bench offline|serve|fairness [options]

Heavy imports (torch, transformers) happen inside the commands, so `pagefleet --help`
and `pagefleet bench --help` load no torch and `pagefleet serve` reaches Ray without it.
The bench commands' parsers are built only for `pagefleet bench`.
"""

from __future__ import annotations

import argparse
import logging
import sys

from pagefleet.cluster.model_presets import ARCHS, DEFAULT_PRESET, PRESET_NAMES, preset_arch
from pagefleet.settings import DTYPES

from .cluster.serve_args import add_serve_arguments

DEMO_PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n",
    "class Stack:\n    def __init__(self):",
    "for line in open(path):",
]


def _make_model(args: argparse.Namespace) -> int:
    from pagefleet.cluster.make_model import make_model

    arch = preset_arch(args.preset, args.arch)
    path = make_model(args.dir, preset=args.preset, arch=arch, seed=args.seed, dtype=args.dtype)
    print(f"wrote {args.preset} ({arch}, seed {args.seed}) checkpoint to {path}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from pagefleet.engine import LLM, SamplingParams

    engine_args = {
        "dtype": args.dtype,
        "max_num_seqs": args.max_num_seqs,
        "num_kv_blocks": args.num_kv_blocks,
        "max_model_len": args.max_model_len,
    }
    llm = LLM(model=args.model, **{k: v for k, v in engine_args.items() if v is not None})
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens, seed=args.seed
    )
    prompts = args.prompt or DEMO_PROMPTS
    outputs = llm.generate(prompts, params)
    for out in outputs:
        comp = out.outputs[0]
        print(f"--- prompt: {out.prompt!r}")
        print(f"    output: {comp.text!r}")
        print(f"    {len(comp.token_ids)} tokens, finish_reason={comp.finish_reason}")
    stats = llm.stats()
    print(
        f"KV blocks: {stats.num_free_blocks}/{stats.num_total_blocks} free after the run; "
        f"{stats.generation_tokens_total} tokens generated; {stats.num_preemptions} preemptions"
    )
    llm.check_block_accounting()
    return 0


def _serve(args: argparse.Namespace) -> int:
    from pagefleet.cluster.launcher import serve_main

    return serve_main(args)


def _bench(args: argparse.Namespace) -> int:
    from pagefleet.bench import run_bench

    return run_bench(args)


def build_parser(with_bench: bool = True) -> argparse.ArgumentParser:
    """The command line; with_bench=False leaves `bench`'s own subcommands out."""
    parser = argparse.ArgumentParser(prog="pagefleet", description=__doc__.split("\n\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    sv = sub.add_parser(
        "serve", help="serve a model or a config on Ray Serve (OpenAI-compatible HTTP)"
    )
    add_serve_arguments(sv)  # vLLM's flags (serve_args.py); see configs/README.md
    sv.set_defaults(func=_serve)

    mm = sub.add_parser("make-model", help="write a seeded random Hugging Face checkpoint")
    mm.add_argument("dir")
    mm.add_argument("--preset", default=DEFAULT_PRESET, choices=PRESET_NAMES)
    mm.add_argument(
        "--arch",
        choices=ARCHS,
        help="one of the preset's architectures (default: the preset's own)",
    )
    mm.add_argument("--seed", type=int, default=0)
    mm.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    mm.set_defaults(func=_make_model)

    gen = sub.add_parser("generate", help="offline generation with the engine")
    gen.add_argument("--model", required=True)
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable); default: a demo set")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    # Engine settings left out take EngineConfig's defaults.
    gen.add_argument("--dtype", default=None, choices=("auto", *DTYPES))
    gen.add_argument("--max-num-seqs", type=int, default=None)
    gen.add_argument("--num-kv-blocks", type=int, default=None)
    gen.add_argument("--max-model-len", type=int, default=None)
    gen.set_defaults(func=_generate)

    bench = sub.add_parser("bench", help="benchmarks; results go to benchmarks/results")
    if with_bench:
        from pagefleet.bench import add_bench_parser

        add_bench_parser(bench)
    bench.set_defaults(func=_bench)
    return parser


def _command(argv: list[str]) -> str | None:
    """The subcommand named in argv (its first word that is not an option)."""
    return next((a for a in argv if not a.startswith("-")), None)


def main(argv: list[str] | None = None) -> int:
    """The `pagefleet` command; `argv` None: the process's own arguments (the program)."""
    if argv is None:
        argv = sys.argv[1:]
    args = build_parser(with_bench=_command(argv) == "bench").parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("pagefleet").setLevel(logging.INFO)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"pagefleet: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
