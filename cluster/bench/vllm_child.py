"""vLLM in its own python: its CPU build lives in a separate venv (it pins other versions
of our dependencies). A script run there that writes JSON back, or its API server's
command line; both in the same environment (offline, KV space pinned to 2 GiB)."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any


def vllm_env() -> dict[str, str]:
    """Offline (HF_HUB_OFFLINE) with vLLM's CPU KV space pinned to 2 GiB."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "2"}
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    return env


def run_vllm_child(vllm_python: str, code: str, payload: Any, *argv: str) -> Any:
    """`vllm_python child.py *argv payload.json out.json`; returns out.json's content.

    The child runs in `vllm_env()`, in a temporary directory that it may litter.
    """
    with tempfile.TemporaryDirectory() as tmp:
        child, in_path, out_path = (Path(tmp, n) for n in ("child.py", "in.json", "out.json"))
        child.write_text(code)
        in_path.write_text(json.dumps(payload))
        subprocess.run(
            [vllm_python, str(child), *argv, str(in_path), str(out_path)],
            env=vllm_env(),
            check=True,
            cwd=tmp,
        )
        return json.loads(out_path.read_text())


def api_server_command(python: str, model: str, port: int, dtype: str) -> list[str]:
    """vLLM's OpenAI-compatible server on 127.0.0.1:PORT, the model served by its
    directory's name (as pagefleet's configs do), max_model_len 512."""
    return [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--max-model-len",
        "512",
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--dtype",
        dtype,
        "--served-model-name",
        Path(model).name,
    ]
