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
# router uses, and the engine config an ingress validates.
_PROBE = """
import json, sys
import pagefleet.engine as engine
eager = sorted(set(engine.__all__) - set(engine._LAZY))
namespace = {}
exec("from pagefleet.engine import " + ", ".join(eager), namespace)
import pagefleet.engine.prefix_hash
from pagefleet.engine.prefix_hash import DigestView, PrefixDigest, block_hashes, prefix_hash_salt
from pagefleet.engine import MAX_LOGPROBS, EngineConfig, SamplingParams
params = SamplingParams(max_tokens=4, temperature=0.0, stop="x")
hashes = block_hashes(list(range(8)), 4, prefix_hash_salt("m", 4))
print(json.dumps({
    "eager": eager,
    "torch": sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")),
    "greedy": params.greedy,
    "hashes": len(hashes),
}))
"""


def _probe(tmp_path: Path, source: str = _PROBE, *args: str, timeout_s: float = 120) -> dict:
    """Run a probe script in a fresh interpreter; the JSON of its last line of output."""
    # A folder of its own, so the repository's top folders cannot shadow the package.
    out = subprocess.run(
        [sys.executable, "-c", source, *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


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
    """pagefleet/engine/errors.py is torch-free, and each error class in it is a public name."""
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


_INGRESS_PROBE = """
import asyncio, json, sys
import httpx
import pagefleet.cluster.ingress, pagefleet.cluster.hub, pagefleet.cluster.routing.serve_routers
from pagefleet.cluster.autoscaling import KVCacheAutoscalingPolicy
from pagefleet.cluster.config import ServeConfig
from pagefleet.cluster.http import create_app
from pagefleet.cluster.replica_messages import EngineInfo
from transformers import PreTrainedTokenizerFast

class Backend:
    async def info(self): return EngineInfo(256, 1024, 8, 16)
    def generate(self, request): raise AssertionError
    async def metric_snapshots(self): return []
    async def healthy(self): return True

model = sys.argv[1]
config = ServeConfig.model_validate({"model": model, "engine": {"block_size": 8}})
config.engine_config()  # the engine's own validation, as the ingress runs it
# A fast tokenizer loaded by its own class: AutoTokenizer itself imports torch (it is
# transformers', not ours), and this probe is about pagefleet's modules.
tokenizer = PreTrainedTokenizerFast.from_pretrained(model)
app = create_app(Backend(), tokenizer, "tiny", config.limits)

async def main():
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        tokenized = await c.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
        refused = await c.post("/v1/completions", json={"prompt": "x", "n": 99})
        return tokenized.json()["count"], refused.status_code

count, refused = asyncio.run(main())
print(json.dumps({
    "torch": sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")),
    "count": count,
    "refused": refused,
}))
"""


def test_an_ingress_serves_and_validates_without_torch(tmp_path: Path, llama_dir: str) -> None:
    """What an ingress replica runs of pagefleet: its deployment modules, the app, a
    chat template, request validation and the engine config's checks, with no torch
    loaded (transformers' AutoTokenizer would load it on its own: see load_tokenizer)."""
    found = _probe(tmp_path, _INGRESS_PROBE, llama_dir, timeout_s=180)
    assert found["torch"] == []
    assert found["count"] > 0 and found["refused"] == 400


_CLI_PROBE = """
import contextlib, io, json, sys
from pagefleet.cli import main

err = io.StringIO()
with contextlib.redirect_stderr(err):
    code = main(["serve", sys.argv[1]])
import pagefleet.cluster.app  # what the driver imports next, to bind the deployments
# A replica's own process: its core runs in a child, which alone loads the engine proper.
import pagefleet.engine.async_engine, pagefleet.engine.core_host
print(json.dumps({
    "code": code,
    "error": err.getvalue(),
    "torch": sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")),
    "bench": sorted(m for m in sys.modules if m.startswith("pagefleet.bench")),
}))
"""


def test_pagefleet_serve_drives_ray_without_torch(tmp_path: Path) -> None:
    """`pagefleet serve` parses its command line, checks its config and imports the app
    it deploys with no torch and no bench module loaded, and an engine replica's process
    hosts its core (a child process) without torch: only that child needs the engine
    proper, and every server start (CI's many) would pay seconds of import otherwise
    (the bench parsers load the simulator; the replica loaded the engine)."""
    config = tmp_path / "config.yaml"
    config.write_text(f"model: {tmp_path / 'missing'}\n")
    found = _probe(tmp_path, _CLI_PROBE, str(config))
    assert found["code"] == 1
    assert found["error"].startswith("pagefleet: error: model ") and "missing" in found["error"]
    assert found["torch"] == [] and found["bench"] == []


_HELP_PROBE = """
import contextlib, io, json, sys
from pagefleet.cli import main

out = io.StringIO()
codes = []
for argv in (["--help"], ["bench", "--help"], ["bench", "serve", "--help"]):
    with contextlib.redirect_stdout(out):
        try:
            main(argv)
        except SystemExit as e:
            codes.append(e.code)
print(json.dumps({
    "codes": codes,
    "help": out.getvalue(),
    "torch": sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")),
    "lab": sorted(m for m in sys.modules if m.startswith("pagefleet_lab")),
}))
"""


def test_pagefleet_help_and_bench_help_load_no_torch(tmp_path: Path) -> None:
    """`pagefleet --help`, `pagefleet bench --help` and `pagefleet bench serve --help`
    answer with no torch loaded and nothing of the lab: the bench commands a user has
    are the load tools (offline, serve, fairness)."""
    found = _probe(tmp_path, _HELP_PROBE)
    assert found["codes"] == [0, 0, 0]
    assert "{serve,make-model,generate,bench}" in found["help"]
    assert "{offline,serve,fairness}" in found["help"]
    assert found["torch"] == [] and found["lab"] == []
