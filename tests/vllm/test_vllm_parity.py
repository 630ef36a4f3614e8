"""pagefleet's greedy outputs against vLLM's CPU build on one checkpoint: the drop-in
parity check, run with `pytest -m vllm tests/vllm`.

Both engines run the same cases from the same prompt token ids, in fp32: greedy
tokens under repetition / presence / frequency penalties, stop strings cut and kept,
min_tokens against a stop token, top-5 logprobs (within the tolerance), and a stop
token right after a token that holds half of a multi-byte character. Stop strings and
stop tokens are taken from pagefleet's own plain greedy output, so that each case does
stop; the multi-byte case is searched for among prompts full of multi-byte text.

vLLM runs in a subprocess with its own python (a virtual environment with vLLM's CPU
build, BENCHMARKS.md; nothing of pagefleet is imported there), offline, under
`if __name__ == "__main__":` since it spawns a worker process. The environment says:

- PAGEFLEET_VLLM_PYTHON: that python; without it (or without vLLM there) every case
  is skipped.
- PAGEFLEET_PARITY_MODEL: the checkpoint (default models/smollm-135m).
- PAGEFLEET_PARITY_LOGPROB_TOL: the largest logprob difference allowed (default 1e-3).

`python -m pagefleet_lab.bench.vllm_parity` runs these and writes the table to
benchmarks/results/vllm_parity.md: each case records its row (`record_property`).
"""

from __future__ import annotations

import os
import subprocess
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pagefleet.bench.vllm_child import run_vllm_child
from pagefleet.engine import LLM, SamplingParams

pytestmark = pytest.mark.vllm

MODEL = os.environ.get("PAGEFLEET_PARITY_MODEL", "models/smollm-135m")
LOGPROB_TOL = float(os.environ.get("PAGEFLEET_PARITY_LOGPROB_TOL", "1e-3"))
MAX_LEN = 512
MAX_TOKENS = 24

_CODE = "def parse(args):\n    options = {}\n    for item in args:\n"
_PROSE = "The quick brown fox jumps over the lazy dog. The dog sleeps while the fox runs"
# Prompts rich in multi-byte characters: byte-level BPE splits them, so a
# greedy continuation may hold half a character at some position.
_MULTIBYTE = [
    "café crème brûlée, naïve résumé, déjà vu: ",
    "日本語のテキストと中文文本和한국어 텍스트",
    "→ ← ↑ ↓ ⇒ ⇐ ∀ ∃ ∈ ∉ ≤ ≥ ≠ ≈ ∞",
    "emoji: 🎉🚀🔥✨🙂 and more 🎉🚀",
    "Ünïcödé → ñ ß ø å æ œ ł ž č ř",
    "# Copyright © 2024 — “quotes” ‘single’ … µs ± °C",
]

# The vLLM side: standalone, run by the vLLM environment's python.
_VLLM_CHILD = textwrap.dedent(
    """
    import json, sys

    def main(model, max_len, cases_path, out_path):
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        cases = json.load(open(cases_path))
        llm = LLM(model=model, max_model_len=int(max_len), enforce_eager=True, dtype="float32", seed=0)
        prompts = [TokensPrompt(prompt_token_ids=c["prompt_token_ids"]) for c in cases]
        params = [SamplingParams(**c["params"]) for c in cases]
        results = []
        for out in llm.generate(prompts, params, use_tqdm=False):
            comp = out.outputs[0]
            logprobs = None
            if comp.logprobs is not None:
                logprobs = [{str(t): lp.logprob for t, lp in step.items()} for step in comp.logprobs]
            results.append({
                "token_ids": list(comp.token_ids),
                "text": comp.text,
                "finish_reason": comp.finish_reason,
                "stop_reason": comp.stop_reason,
                "logprobs": logprobs,
            })
        json.dump(results, open(out_path, "w"))

    if __name__ == "__main__":
        main(*sys.argv[1:5])
    """
)


@dataclass
class Case:
    key: str  # the test's parameter
    name: str  # the report's row
    prompt_token_ids: list[int]
    params: dict[str, Any]  # SamplingParams keywords, the same on both sides


# One test per case, in the report's order (the last two only where a multi-byte stop
# was found).
CASE_KEYS = [
    "greedy-code",
    "repetition-1.3",
    "repetition-1.02",
    "greedy-prose",
    "presence-1.0",
    "frequency-0.02",
    "three-penalties",
    "stop-cut",
    "stop-kept",
    "stop-token",
    "min-tokens-vs-stop-token",
    "stop-early-min-tokens",
    "logprobs",
    "logprobs-penalties",
    "multibyte-stop",
    "multibyte-stop-kept",
]


def _greedy(**kw: Any) -> dict[str, Any]:
    return {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True, **kw}


def build_cases(llm: LLM) -> list[Case]:
    tok = llm.get_tokenizer()
    code, prose = tok.encode(_CODE), tok.encode(_PROSE)
    plain = llm.generate([{"prompt_token_ids": code}], SamplingParams(**_greedy()), use_tqdm=False)[
        0
    ].outputs[0]
    # A stop string from the middle of the plain continuation: it does occur.
    text = plain.text
    mid = len(text) // 2
    stop_str = text[mid : mid + 3] if text[mid : mid + 3].strip() else text[mid - 3 : mid]
    # A stop token that greedy decoding emits at output position 2.
    stop_tok = plain.token_ids[2]
    # The text of output token 1 (the 2nd): with min_tokens=2 it may not stop there.
    early = tok.decode(plain.token_ids[1:2])
    three = _greedy(repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5)
    kept = _greedy(stop=[stop_str], include_stop_str_in_output=True)
    cases = [
        Case("greedy-code", "greedy (code)", code, _greedy()),
        Case("repetition-1.3", "repetition_penalty=1.3", code, _greedy(repetition_penalty=1.3)),
        # Small enough that the 9th repeat is what tips the choice.
        Case("repetition-1.02", "repetition_penalty=1.02", code, _greedy(repetition_penalty=1.02)),
        Case("greedy-prose", "greedy (prose)", prose, _greedy()),
        Case("presence-1.0", "presence_penalty=1.0", prose, _greedy(presence_penalty=1.0)),
        # Tips after 8 repeats: the count matters, not only presence.
        Case("frequency-0.02", "frequency_penalty=0.02", prose, _greedy(frequency_penalty=0.02)),
        Case("three-penalties", "all three penalties", prose, three),
        Case("stop-cut", f"stop={stop_str!r} (cut)", code, _greedy(stop=[stop_str])),
        Case("stop-kept", f"stop={stop_str!r} (kept)", code, kept),
        Case(
            "stop-token", f"stop_token_ids=[{stop_tok}]", code, _greedy(stop_token_ids=[stop_tok])
        ),
        Case(
            "min-tokens-vs-stop-token",
            f"min_tokens=6 vs stop token {stop_tok}",
            code,
            _greedy(stop_token_ids=[stop_tok], min_tokens=6),
        ),
        Case(
            "stop-early-min-tokens",
            f"stop={early!r}, min_tokens=2",
            code,
            _greedy(stop=[early], min_tokens=2),
        ),
        Case("logprobs", "top-5 logprobs", code, _greedy(logprobs=5)),
        Case(
            "logprobs-penalties",
            "top-5 logprobs, penalties",
            prose,
            _greedy(logprobs=5, repetition_penalty=1.2),
        ),
    ]
    found = find_multibyte_stop(llm)
    if found is not None:
        ids, stop, pos = found
        name = f"stop token after half a char (pos {pos})"
        cases.append(Case("multibyte-stop", name, ids, _greedy(stop_token_ids=[stop])))
        kept_stop = _greedy(stop_token_ids=[stop], include_stop_str_in_output=True)
        cases.append(Case("multibyte-stop-kept", "same, stop token kept", ids, kept_stop))
    return cases


def find_multibyte_stop(llm: LLM) -> tuple[list[int], int, int] | None:
    """(prompt ids, stop token, position) where greedy output token `position` holds half a
    character and the next token, not seen before it, can serve as the stop token."""
    tok = llm.get_tokenizer()
    prompts = [tok.encode(p) for p in _MULTIBYTE]
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(**_greedy()), use_tqdm=False
    )
    for ids, out in zip(prompts, outs, strict=True):
        toks = out.outputs[0].token_ids
        for i in range(len(toks) - 1):
            if tok.decode(toks[: i + 1]).endswith("\ufffd") and toks[i + 1] not in toks[: i + 1]:
                return ids, toks[i + 1], i
    return None


def run_pagefleet(llm: LLM, cases: list[Case]) -> list[dict[str, Any]]:
    outs = llm.generate(
        [{"prompt_token_ids": c.prompt_token_ids} for c in cases],
        [SamplingParams(**c.params) for c in cases],
        use_tqdm=False,
    )
    llm.check_block_accounting()
    results = []
    for out in outs:
        comp = out.outputs[0]
        results.append(
            {
                "token_ids": comp.token_ids,
                "text": comp.text,
                "finish_reason": comp.finish_reason,
                "stop_reason": comp.stop_reason,
                "logprobs": None
                if comp.logprobs is None
                else [{str(t): lp for t, lp in step.items()} for step in comp.logprobs],
            }
        )
    return results


def run_vllm(vllm_python: str, model: str, cases: list[Case]) -> list[dict[str, Any]]:
    payload = [{"prompt_token_ids": c.prompt_token_ids, "params": c.params} for c in cases]
    return run_vllm_child(
        vllm_python, _VLLM_CHILD, payload, str(Path(model).resolve()), str(MAX_LEN)
    )


def compare(
    case: Case, ours: dict[str, Any], theirs: dict[str, Any], tol: float
) -> tuple[bool, list[str]]:
    """(same, table row cells): tokens, text, finish reason, logprobs."""
    same_tokens = ours["token_ids"] == theirs["token_ids"]
    same_text = ours["text"] == theirs["text"]
    ours_finish = (ours["finish_reason"], ours["stop_reason"])
    theirs_finish = (theirs["finish_reason"], theirs["stop_reason"])
    same_finish = ours_finish == theirs_finish
    lp_cell, same_lp = "-", True
    if case.params.get("logprobs") is not None:
        a, b = ours["logprobs"] or [], theirs["logprobs"] or []
        worst = 0.0
        same_lp = len(a) == len(b)
        for x, y in zip(a, b, strict=False):
            if set(x) != set(y):
                same_lp = False
                continue
            worst = max(worst, max(abs(x[t] - y[t]) for t in x))
        same_lp = same_lp and worst <= tol
        lp_cell = f"{'same' if same_lp else 'DIFF'} (max abs diff {worst:.1e})"
    detail = "" if same_text else f"pagefleet {ours['text']!r} / vLLM {theirs['text']!r}"
    ok = same_tokens and same_text and same_finish and same_lp
    return ok, [
        case.name,
        "same" if same_tokens else f"DIFF at {_first_diff(ours['token_ids'], theirs['token_ids'])}",
        "same" if same_text else "DIFF",
        f"{ours_finish[0]}/{ours_finish[1]}"
        + ("" if same_finish else f" vs {theirs_finish[0]}/{theirs_finish[1]}"),
        lp_cell,
        (repr(ours["text"][-24:]) if same_text else detail).replace("|", "\\|"),
    ]


def _first_diff(a: list[int], b: list[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


@pytest.fixture(scope="module")
def vllm_python() -> str:
    python = os.environ.get("PAGEFLEET_VLLM_PYTHON", "")
    if not python:
        pytest.skip("PAGEFLEET_VLLM_PYTHON is not set (a python with vLLM's CPU build)")
    if not os.access(python, os.X_OK):
        pytest.skip(f"PAGEFLEET_VLLM_PYTHON={python}: no such python")
    probe = subprocess.run([python, "-c", "import vllm"], capture_output=True, timeout=300)
    if probe.returncode != 0:
        pytest.skip(f"PAGEFLEET_VLLM_PYTHON={python}: vLLM does not import there")
    return python


@pytest.fixture(scope="module")
def parity(vllm_python: str) -> dict[str, tuple[Case, dict[str, Any], dict[str, Any]]]:
    """Every case through both engines, once: key -> (case, pagefleet's, vLLM's)."""
    if not (Path(MODEL) / "config.json").is_file():
        pytest.skip(f"no checkpoint at {MODEL} (`pagefleet make-model {MODEL}`)")
    with LLM(model=MODEL, max_model_len=MAX_LEN, dtype="float32") as llm:
        cases = build_cases(llm)
        ours = run_pagefleet(llm, cases)
    theirs = run_vllm(vllm_python, MODEL, cases)
    return {c.key: (c, a, b) for c, a, b in zip(cases, ours, theirs, strict=True)}


@pytest.mark.parametrize("key", CASE_KEYS)
def test_same_output_as_vllm(key: str, parity: dict, record_property: Any) -> None:
    record_property("max_tokens", MAX_TOKENS)
    if key not in parity:
        pytest.skip("no greedy output token of the multi-byte prompts holds half a character")
    case, ours, theirs = parity[key]
    ok, row = compare(case, ours, theirs, LOGPROB_TOL)
    record_property("row", row)
    assert ok, f"{case.name}: " + " | ".join(row[1:])
