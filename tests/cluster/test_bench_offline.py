"""`pagefleet bench offline`: its loads and report, and its pagefleet child on a tiny model."""

from __future__ import annotations

import argparse

from pagefleet.bench.offline import (
    VLLM,
    Load,
    Result,
    _report,
    pagefleet_system,
    run_pagefleet,
    skipped,
)
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


def test_report_gives_ratios_to_vllm_start_up_and_memory(llama_dir: str) -> None:
    args = argparse.Namespace(
        model=llama_dir, threads=1, max_model_len=2048, kv_gib=2.0, vllm_version=None
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


def test_the_pagefleet_child_generates_every_load_and_reports_its_start_up(
    llama_dir: str,
) -> None:
    args = argparse.Namespace(max_model_len=128, kv_gib=1 / 256, threads=1, sequential_cap=2)
    tok = load_tokenizer(llama_dir)
    loads = [Load(3, 5), Load(2, 4, 40)]
    results = run_pagefleet(llama_dir, "float32", tok, loads, "eager", args, True)
    got = [(r.system, r.load, r.tokens) for r in results]
    assert got == [
        (pagefleet_system("eager"), "3x5", 15),
        (pagefleet_system("eager"), "2x4@40", 8),
        ("pagefleet one at a time (eager)", "3x5", 10),
        ("pagefleet one at a time (eager)", "2x4@40", 8),
    ]
    assert results[0].startup_s and results[0].peak_rss


def test_skip_names_a_system_or_its_leading_words_and_cap_zero_drops_one_at_a_time() -> None:
    hf = [
        "transformers generate one at a time",
        "transformers static batch of 8",
        "transformers continuous batching",
    ]
    assert [skipped(s, {"transformers"}, 8) for s in hf] == [True, True, True]
    assert [skipped(s, {"transformers static"}, 8) for s in hf] == [False, True, False]
    assert [skipped(s, {"trans"}, 8) for s in hf] == [False, False, False]  # whole words only
    mine = [pagefleet_system("compiled"), "pagefleet one at a time (eager)"]
    assert [skipped(s, {"pagefleet one at a time"}, 8) for s in mine] == [False, True]
    assert [skipped(s, set(), 0) for s in [*hf, *mine]] == [True, False, False, False, True]
