"""`pagefleet-lab served-paired`: the loads, vLLM's client's arguments and the per-round
ratios and report (vLLM's CPU build is not installed in CI: the servers and the client
run only where it is)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from pagefleet.bench.launcher import Server
from pagefleet_lab.bench.served_paired import (
    PAGEFLEET,
    VLLM,
    Load,
    Turn,
    client_args,
    ratios,
    report,
)


def test_a_load_is_read_from_in_out_users_prompts() -> None:
    assert Load.parse("1024/64x16:48") == Load(1024, 64, 16, 48)
    with pytest.raises(SystemExit, match="IN/OUTxUSERS:PROMPTS"):
        Load.parse("1024x16")


def test_the_client_is_asked_for_the_load_on_the_server(tmp_path: Path) -> None:
    server = Server("http://127.0.0.1:8501", None, tmp_path / "log")  # type: ignore[arg-type]
    server.model = "smollm-135m"
    args = client_args(server, "/m", Load(256, 128, 32, 160), 160, 3, tmp_path / "r.json")
    flags = dict(zip(args[::2], args[1::2], strict=False))
    assert flags["--base-url"] == "http://127.0.0.1:8501"
    assert flags["--model"] == "smollm-135m" and flags["--tokenizer"] == "/m"
    assert (flags["--random-input-len"], flags["--random-output-len"]) == ("256", "128")
    assert (flags["--num-prompts"], flags["--max-concurrency"]) == ("160", "32")
    assert "--ignore-eos" in args and args[-1] == "r.json"
    assert args[args.index("--seed") + 1] == "3"


def _result(tok_s: float, p99_s: float) -> dict[str, float]:
    return {
        "output_throughput": tok_s,
        "p99_ttft_ms": p99_s * 1e3,
        "median_ttft_ms": p99_s * 500,
        "median_tpot_ms": 100.0,
        "completed": 8,
        "num_prompts": 8,
    }


def test_ratios_pair_the_servers_round_by_round() -> None:
    load = str(Load(64, 16, 4, 8))
    turns = [
        Turn(0, load, PAGEFLEET, _result(110.0, 1.0)),
        Turn(0, load, VLLM, _result(100.0, 2.0)),
        Turn(1, load, VLLM, _result(50.0, 2.0)),
        Turn(1, load, PAGEFLEET, _result(45.0, 3.0)),
    ]
    assert ratios(turns, load, "output_throughput") == pytest.approx([1.1, 0.9])
    args = argparse.Namespace(config="c.yaml", dtype="bfloat16", threads=1, rounds=2)
    text = report(turns, [Load(64, 16, 4, 8)], args, "/m", "")
    assert "**1.000x** (0.900-1.100)" in text  # the median of the two rounds, their range
    assert "**2.00 / 2.00**" in text  # TTFT p99: the median over rounds of each server
