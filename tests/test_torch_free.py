"""The engine's public, torch-free surface loads no torch; the import contracts hold.

An ingress or a router imports `pagefleet.engine` for its parameters, outputs, stats,
errors and prefix hashes; torch (a gigabyte of address space, seconds of start-up)
loads only with the engine proper, on first use of one of its names. The checks run
in a fresh interpreter, since this one has torch already (tests/conftest.py).
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest

import pagefleet.engine
from pagefleet.engine import errors

REPO = Path(__file__).resolve().parents[1]

# What a fresh interpreter imports: every eager public name, the prefix-hash module the
# router uses, and the transitional `sampling` module that cluster/ still names.
_PROBE = """
import json, sys
import pagefleet.engine as engine
eager = sorted(set(engine.__all__) - set(engine._LAZY))
namespace = {}
exec("from pagefleet.engine import " + ", ".join(eager), namespace)
import pagefleet.engine.prefix_hash
from pagefleet.engine.prefix_hash import DigestView, PrefixDigest, block_hashes, prefix_hash_salt
from pagefleet.engine.sampling import MAX_LOGPROBS, SamplingParams
params = SamplingParams(max_tokens=4, temperature=0.0, stop="x")
hashes = block_hashes(list(range(8)), 4, prefix_hash_salt("m", 4))
print(json.dumps({
    "eager": eager,
    "torch": sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")),
    "greedy": params.greedy,
    "hashes": len(hashes),
}))
"""


def _probe(tmp_path: Path) -> dict:
    # A folder of its own, so the repository's top folders cannot shadow the package.
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_public_names_and_prefix_hash_load_no_torch(tmp_path: Path) -> None:
    found = _probe(tmp_path)
    assert found["torch"] == []
    assert {
        "SamplingParams",
        "MAX_LOGPROBS",
        "RequestOutput",
        "CompletionOutput",
        "RequestMetrics",
        "EngineStats",
        "StepFailedError",
        "EngineBrokenError",
        "block_hashes",
        "prefix_hash_salt",
        "DigestView",
    } <= set(found["eager"])
    assert found["greedy"] is True and found["hashes"] == 2


def test_heavy_names_resolve_lazily_to_their_modules() -> None:
    from pagefleet.engine import async_engine, config, llm_engine

    assert pagefleet.engine.LLM is llm_engine.LLM
    assert pagefleet.engine.LLMEngine is llm_engine.LLMEngine
    assert pagefleet.engine.AsyncLLMEngine is async_engine.AsyncLLMEngine
    assert pagefleet.engine.EngineConfig is config.EngineConfig
    for name in pagefleet.engine.__all__:
        assert getattr(pagefleet.engine, name) is not None, name
    assert set(pagefleet.engine.__all__) <= set(dir(pagefleet.engine))
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = pagefleet.engine.no_such_name
    # Submodules still import by name through the package.
    from pagefleet.engine import step_codec

    assert step_codec.__name__ == "pagefleet.engine.step_codec"


def test_lazy_table_names_only_real_submodules() -> None:
    for name, module in pagefleet.engine._LAZY.items():
        assert name in pagefleet.engine.__all__, name
        assert hasattr(importlib.import_module(f"pagefleet.engine.{module}"), name), name


def test_every_engine_error_is_public_and_eager() -> None:
    """engine/errors.py is torch-free, and each error class in it is a public name."""
    classes = [
        name
        for name, obj in vars(errors).items()
        if inspect.isclass(obj)
        and issubclass(obj, BaseException)
        and obj.__module__ == errors.__name__
    ]
    assert classes
    for name in classes:
        assert name in pagefleet.engine.__all__, f"export {name} from pagefleet.engine"
        assert name not in pagefleet.engine._LAZY, name
        assert getattr(pagefleet.engine, name) is getattr(errors, name)


@pytest.mark.skipif(
    importlib.util.find_spec("importlinter") is None, reason="import-linter not installed"
)
def test_import_contracts_hold() -> None:
    """import-linter's contracts of pyproject.toml, as `make test` runs them."""
    out = subprocess.run(
        [sys.executable, str(REPO / "tools" / "lint_imports.py")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 broken" in out.stdout
