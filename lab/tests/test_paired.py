"""`pagefleet-lab paired`: the child protocol on pagefleet's own engine (vLLM's CPU
build is not installed in CI; `-m vllm` runs it), and the per-round ratios."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import pytest

from pagefleet.bench.offline import PAGEFLEET_ENGINE, PEAK_RSS, Load, child_spec
from pagefleet.engine.loader import load_tokenizer
from pagefleet_lab.bench.paired import (
    _ROUNDS_MAIN,
    PAGEFLEET,
    VLLM,
    Turn,
    _Engine,
    _env_pairs,
    _report,
    ratios,
)


def test_a_child_reports_its_start_up_then_one_result_per_command(
    llama_dir: str, tmp_path: Path
) -> None:
    tok = load_tokenizer(llama_dir)
    loads = [Load(3, 5), Load(2, 4, 40)]
    settings = argparse.Namespace(max_model_len=128, kv_gib=1 / 256, threads=1)
    spec = child_spec(tok, loads, settings) | {"eager": True}
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec))
    engine = _Engine(
        PAGEFLEET,
        sys.executable,
        PEAK_RSS + PAGEFLEET_ENGINE + _ROUNDS_MAIN,
        spec_path,
        llama_dir,
        "float32",
        dict(os.environ),
    )
    try:
        assert engine.info["startup_s"] > 0
        got = [engine.run(i) for i in (0, 1, 0)]
    finally:
        engine.close()
    assert [g["tokens"] for g in got] == [15, 8, 15]
    assert all(g["seconds"] > 0 and g["peak_rss"] > 0 for g in got)
    assert engine.proc.returncode == 0  # closing its commands ends it


def test_each_round_pairs_both_engines_and_the_report_gives_the_median() -> None:
    turns = [
        Turn(0, "20x50", PAGEFLEET, 100, 1.0),
        Turn(0, "20x50", VLLM, 100, 2.0),
        Turn(1, "20x50", VLLM, 100, 1.0),
        Turn(1, "20x50", PAGEFLEET, 100, 1.25),
        Turn(2, "20x50", PAGEFLEET, 100, 1.0),
        Turn(2, "20x50", VLLM, 100, 0.5),
    ]
    assert ratios(turns, "20x50") == [2.0, 0.8, 0.5]
    args = argparse.Namespace(
        model="m",
        dtype="float32",
        threads=1,
        max_model_len=2048,
        kv_gib=2.0,
        rounds=3,
        eager=False,
        pagefleet_env=["OMP_WAIT_POLICY=ACTIVE"],
    )
    info = {PAGEFLEET: {"startup_s": 30.0, "peak_rss": 2 << 30}, VLLM: {"startup_s": 60.0}}
    text = _report(turns, [Load(20, 50)], info, args, "")
    assert "| 20x50 | **0.800x** | 0.500-2.000x | 1 |" in text
    assert "| 20x50 | 1 | vLLM | 80.0 | 100.0 | 0.800x |" in text
    assert "| pagefleet | 30.0 | 2.00 |" in text and "| vLLM | 60.0 | 0.00 |" in text
    assert "pagefleet's environment adds OMP_WAIT_POLICY=ACTIVE." in text


def test_pagefleet_env_items_parse_and_a_bad_one_is_refused() -> None:
    assert _env_pairs(["A=1", "B=x=y"]) == {"A": "1", "B": "x=y"}
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        _env_pairs(["A"])
