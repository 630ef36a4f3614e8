"""make-model determinism, the kv-waste figures and the CLI's offline demo."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from pagefleet.cli import main
from pagefleet.cluster.make_model import make_model


def _digest(path: Path) -> str:
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


def test_make_model_is_deterministic_per_seed(tmp_path: Path, llama_dir: str) -> None:
    again = make_model(tmp_path / "again", "tiny", "llama", seed=0)
    other = make_model(tmp_path / "other", "tiny", "llama", seed=1)
    assert _digest(again) == _digest(Path(llama_dir))
    assert _digest(other) != _digest(again)
    assert (again / "tokenizer.json").read_text() == (
        Path(llama_dir) / "tokenizer.json"
    ).read_text()
    config = json.loads((again / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)


def test_tokenizer_has_chat_template(llama_dir: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(llama_dir)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_cli_generate_demo(llama_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["generate", "--model", llama_dir, "--max-tokens", "4", "--prompt", "import os"]) == 0
    )
    out = capsys.readouterr().out
    assert "prompt: 'import os'" in out and "4 tokens" in out
    assert main(["generate", "--model", llama_dir, "--max-tokens", "0"]) == 2
