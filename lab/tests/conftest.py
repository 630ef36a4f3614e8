"""The product's test fixtures (tests/conftest.py: tiny checkpoints written by
`make_model`), for the lab's tests too."""

from tests.conftest import (  # noqa: F401 (fixtures, found by name)
    eos_first_llama,
    llama_dir,
    long_llama_dir,
    model_root,
    qwen2_dir,
)
