"""How many constrained samples are valid: at least 1,000 of them, on a model that knows nothing.

    python benchmarks/structured_validity.py --model models/tiny \\
        --out benchmarks/results/structured_validity

The model has random weights, so nothing but the grammar makes an answer valid.
Constraints: the structured serving benchmark's schema (`bench serve --scenario
structured`), a `tool_choice: "required"` call list over two tools (what the HTTP
layer sends the engine, `tools.call_list_schema`), a nested order with an array of
objects, a regex and a choice. Each is sampled at temperature 1.0 for SEEDS seeds x
n=4 samples in one `LLM.generate` call (forks, so every sample's grammar state is
copied from its parent's), with max_tokens far above what a valid answer needs;
every sample is checked with `jsonschema` (or the regex / the choice list). Writes
OUT.md: per constraint, samples, valid, finished by the grammar ("stop"), and the
seconds it took.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from typing import Any

import jsonschema

from pagefleet.bench.report import markdown_table, write_report
from pagefleet.bench.serve import STRUCTURED_SCHEMA
from pagefleet.cluster.http.protocol import ChatTool
from pagefleet.cluster.http.tools import call_list_schema
from pagefleet.engine import LLM, SamplingParams, StructuredOutputsParams

SEEDS = 50
SAMPLES = 4
TOOLS = [
    ChatTool.model_validate(
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "city": {"type": "string", "maxLength": 8},
                        "unit": {"enum": ["c", "f"]},
                    },
                    "required": ["city", "unit"],
                    "additionalProperties": False,
                },
            },
        }
    ),
    ChatTool.model_validate(
        {
            "type": "function",
            "function": {
                "name": "get_time",
                "parameters": {
                    "type": "object",
                    "properties": {"tz": {"type": "string", "maxLength": 5}},
                    "required": ["tz"],
                    "additionalProperties": False,
                },
            },
        }
    ),
]
ORDER = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 6},
                    "qty": {"type": "integer", "minimum": 0, "maximum": 99},
                    "kind": {"enum": ["tool", "part", "kit"]},
                },
                "required": ["name", "qty", "kind"],
                "additionalProperties": False,
            },
        },
        "urgent": {"type": "boolean"},
    },
    "required": ["items", "urgent"],
    "additionalProperties": False,
}
REGEX = r"[A-Z]{2}-[0-9]{2,4}(/[a-z]{1,3})?"
CHOICES = ["approve", "reject", "ask again later"]


def constraints() -> list[tuple[str, StructuredOutputsParams, Any]]:
    """(name, constraint, its check: a JSON schema, or a callable on the text)."""
    calls = call_list_schema(TOOLS, parallel=True)
    return [
        (
            "bench serve's schema",
            StructuredOutputsParams(json=STRUCTURED_SCHEMA),
            STRUCTURED_SCHEMA,
        ),
        ('tool_choice "required"', StructuredOutputsParams(json=calls), calls),
        ("nested order", StructuredOutputsParams(json=ORDER), ORDER),
        ("regex", StructuredOutputsParams(regex=REGEX), lambda t: bool(re.fullmatch(REGEX, t))),
        ("choice", StructuredOutputsParams(choice=CHOICES), lambda t: t in CHOICES),
    ]


def valid(text: str, check: Any) -> bool:
    if callable(check):
        return check(text)
    try:
        jsonschema.validate(json.loads(text), check)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/tiny")
    p.add_argument("--max-tokens", type=int, default=400)
    p.add_argument("--out", default="benchmarks/results/structured_validity")
    args = p.parse_args()
    rows = []
    total = total_valid = 0
    with LLM(model=args.model, num_kv_blocks=4096, block_size=16, max_num_seqs=256) as llm:
        for name, so, check in constraints():
            params = [
                SamplingParams(
                    temperature=1.0,
                    seed=seed,
                    n=SAMPLES,
                    max_tokens=args.max_tokens,
                    structured_outputs=so,
                )
                for seed in range(SEEDS)
            ]
            start = time.perf_counter()
            outs = llm.generate(["Answer:"] * SEEDS, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            samples = [s for o in outs for s in o.outputs]
            ok = sum(valid(s.text, check) for s in samples)
            stopped = sum(s.finish_reason == "stop" for s in samples)
            total, total_valid = total + len(samples), total_valid + ok
            rows.append([name, len(samples), ok, stopped, f"{seconds:.1f}"])
            print(
                f"{name}: {ok}/{len(samples)} valid, {stopped} stopped, {seconds:.1f} s", flush=True
            )
        llm.check_block_accounting()
    body = "\n\n".join(
        [
            f"- Model: `{args.model}` (random weights); temperature 1.0, {SEEDS} seeds x "
            f"n={SAMPLES} per constraint, max_tokens {args.max_tokens}; every sample checked "
            "with jsonschema (or the regex / the choice list).",
            markdown_table(["constraint", "samples", "valid", "stopped by the grammar", "s"], rows),
            f"**{total_valid}/{total}** constrained samples valid.",
        ]
    )
    command = " ".join(["python benchmarks/structured_validity.py", *sys.argv[1:]])
    print(write_report(args.out, "Structured outputs: valid samples", body, command).read_text())


if __name__ == "__main__":
    main()
