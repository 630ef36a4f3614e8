"""`pagefleet bench offline`'s loads and report, without running an engine."""

from __future__ import annotations

import argparse

from pagefleet.cluster.bench.offline import VLLM, Load, Result, _report, pagefleet_system
from pagefleet.engine.loader import load_tokenizer


def test_loads_parse_short_and_long_prompts(llama_dir: str) -> None:
    assert Load.parse("20x50") == Load(20, 50)
    long = Load.parse("16x64@1200")
    assert (long.requests, long.new, long.prompt_len, str(long)) == (16, 64, 1200, "16x64@1200")
    prompts = long.prompts(load_tokenizer(llama_dir))
    assert len(prompts) == 16 and {len(p) for p in prompts} == {1200}
    assert len({tuple(p[:8]) for p in prompts}) == 16  # no two start alike
    short = Load.parse("20x50").prompts(load_tokenizer(llama_dir))
    assert {len(p) for p in short} <= set(range(5, 12))


def test_report_gives_ratios_to_vllm_start_up_and_memory() -> None:
    args = argparse.Namespace(
        model="m", threads=1, max_model_len=2048, kv_gib=2.0, vllm_version=None
    )
    results = [
        Result(pagefleet_system("compiled"), "float32", "20x50", 1000, 5.0, "", 30.0, 2 << 30),
        Result(pagefleet_system("eager"), "float32", "20x50", 1000, 8.0, "", 5.0, 1 << 30),
        Result(VLLM, "float32", "20x50", 1000, 10.0, "", 60.0, 4 << 30),
    ]
    text = _report(results, [Load(20, 50)], ["float32"], args)
    assert "20x50 float32 compiled: 200.0 tok/s = 2.00x vLLM (100.0)" in text
    assert "20x50 float32 eager: 125.0 tok/s = 1.25x vLLM" in text
    assert "| 30.0 | 2.00 |" in text and "| 60.0 | 4.00 |" in text
