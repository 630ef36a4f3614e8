"""Shared fixtures: tiny checkpoints written by `make_model`, and the transformers oracle."""

from __future__ import annotations

import os

# The kernel tests run the Triton kernels in Triton's interpreter on CPU tensors (this must be
# set before triton is imported).
os.environ.setdefault("TRITON_INTERPRET", "1")
# Engines built by tests (and the servers they start) run the model eagerly: compiling
# costs tens of seconds on a fresh machine. Tests about compilation ask for
# enforce_eager=False (tests/engine/test_compile.py, the compiled oracle case).
os.environ.setdefault("PAGEFLEET_ENFORCE_EAGER", "1")
# No test reaches the Hugging Face Hub: a Hub id resolves from a local cache or fails.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import functools
from pathlib import Path

import pytest
import torch

from pagefleet.cluster.make_model import ensure_model

torch.set_num_threads(2)

# Text that tokenizes to prompts of very different lengths.
PROMPT_TEXTS = [
    "def",
    "import os",
    "class Foo(object):\n    pass",
    "x = [i * i for i in range(10)]",
    "return self._cache.get(key, default)",
    "# Copyright (c) Python Software Foundation.\n# All rights reserved.",
    "for name, value in sorted(items):\n    print(f'{name} = {value!r}')",
    "if __name__ == '__main__':\n    main()",
    '"""Helpers for parsing command-line options and arguments."""\n\nimport sys\nimport re\n',
    "try:\n    import _thread\nexcept ImportError:\n    _thread = None\n",
    "while True:\n    line = f.readline()\n    if not line:\n        break\n    yield line.rstrip()",
    "a",
    "def __init__(self, *args, **kwargs):\n    super().__init__(*args, **kwargs)\n"
    "    self._lock = threading.RLock()\n    self._items = {}\n    self._closed = False\n",
    "raise ValueError('bad value: %r' % (value,))",
]


@pytest.fixture(scope="session")
def model_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def llama_dir(model_root: Path) -> str:
    """Llama with grouped-query attention (4 heads, 2 KV heads), tied embeddings."""
    return str(ensure_model(model_root / "tiny-llama", "tiny", "llama", seed=0))


@pytest.fixture(scope="session")
def long_llama_dir(model_root: Path) -> str:
    """The tiny Llama with an 8,192-token context: requests that run for seconds."""
    from pagefleet.cluster.make_model import make_model

    path = model_root / "tiny-long"
    if not (path / "model.safetensors").exists():
        make_model(path, "tiny", max_position_embeddings=8192)
    return str(path)


@pytest.fixture(scope="session")
def qwen2_dir(model_root: Path) -> str:
    """Qwen2: biases on the QKV projection, untied LM head."""
    from pagefleet.cluster.make_model import make_model

    path = model_root / "tiny-qwen2"
    if not (path / "model.safetensors").exists():
        make_model(path, "tiny", "qwen2", seed=1, tie_word_embeddings=False)
    return str(path)


@pytest.fixture(scope="session")
def eos_first_llama(llama_dir: str, model_root: Path) -> str:
    """A copy of the tiny Llama whose EOS is the token it greedily emits first for PROMPT_TEXTS[0]."""
    import json
    import shutil

    path = model_root / "tiny-llama-eos-first"
    if not path.exists():
        eos = hf_greedy(llama_dir, tokenizer_for(llama_dir).encode(PROMPT_TEXTS[0]), 1)[0]
        shutil.copytree(llama_dir, path)
        gen = json.loads((path / "generation_config.json").read_text())
        gen["eos_token_id"] = [eos]
        (path / "generation_config.json").write_text(json.dumps(gen))
    return str(path)


def eos_of(path: str) -> int:
    import json

    return json.loads((Path(path) / "generation_config.json").read_text())["eos_token_id"][0]


@functools.cache
def _hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@functools.cache
def tokenizer_for(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def prompt_ids(path: str, texts: list[str] | None = None) -> list[list[int]]:
    tok = tokenizer_for(path)
    return [tok.encode(t) for t in (texts or PROMPT_TEXTS)]


def hf_greedy(path: str, ids: list[int], max_new_tokens: int) -> list[int]:
    """Transformers' greedy `generate` tokens for one prompt (the oracle)."""
    model = _hf_model(path)
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
        )
    return out[0, len(ids) :].tolist()
