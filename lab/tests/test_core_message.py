"""`pagefleet-lab core-message`: the loads parse, and the message it times has the same
bytes whatever the prompt's length and the tokens already generated."""

from __future__ import annotations

import argparse

import pytest

from pagefleet_lab.bench.core_message import measure, parse_load
from tests.conftest import tokenizer_for


def test_loads_parse() -> None:
    assert parse_load("64x8192x500") == (64, 8192, 500, 0)
    assert parse_load("32x4096x4096x20") == (32, 4096, 4096, 20)
    for bad in ("64x8192", "0x1x1", "ax1x1"):
        with pytest.raises((argparse.ArgumentTypeError, ValueError)):
            parse_load(bad)


def test_the_message_does_not_grow_with_the_prompt_or_the_output(llama_dir: str) -> None:
    tok = tokenizer_for(llama_dir)
    short = measure(tok, (3, 20, 2, 2), steps=2)
    long = measure(tok, (3, 2000, 200, 2), steps=2)
    assert short["bytes"] == long["bytes"]
