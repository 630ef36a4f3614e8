"""vLLM in its own python: its CPU build lives in a separate venv (it pins other versions
of our dependencies). A script run there that writes JSON back, or its API server's
command line; both in the same environment (offline, KV space pinned to 2 GiB, the
compute threads asked for). vLLM runs at its defaults otherwise: no `enforce_eager`.
`run_child` runs such a script in any python (pagefleet's own too)."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

THREAD_VARS = ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU")


def vllm_thread_env(threads: int | None, cpus: int | None = None) -> dict[str, str]:
    """The variables that give vLLM's CPU build `threads` compute threads on a machine
    of `cpus` cores (default: this one's). None, or one on two cores, is its default
    (auto: it binds one core and reserves the other for its front end): nothing set.
    Otherwise an explicit binding to cores 0..threads-1, none reserved."""
    cpus = cpus or os.cpu_count() or 1
    if threads is None or (threads == 1 and cpus == 2):
        return {}
    bind = "0" if threads == 1 else f"0-{threads - 1}"
    return {"VLLM_CPU_OMP_THREADS_BIND": bind, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def describe_vllm_threads(env: dict[str, str]) -> str:
    """The binding of `vllm_thread_env`'s variables, as a report says it."""
    if not env:
        return "VLLM_CPU_OMP_THREADS_BIND=auto (its default; on 2 cores: one engine core, one reserved)"
    return ", ".join(f"{k}={env[k]}" for k in THREAD_VARS if k in env)


def vllm_env(threads: int | None = None, kv_gib: float = 2) -> dict[str, str]:
    """Offline (HF_HUB_OFFLINE) with vLLM's CPU KV space pinned to `kv_gib` GiB (2 by
    default) and its compute threads as `vllm_thread_env(threads)` sets them (the
    caller's own settings of those variables dropped)."""
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARS}
    env |= {
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": f"{kv_gib:g}",
        **vllm_thread_env(threads),
    }
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    return env


def run_child(python: str, code: str, payload: Any, *argv: str, env: dict[str, str]) -> Any:
    """`python child.py *argv payload.json out.json` in `env`; returns out.json's content.

    The child runs in a temporary directory that it may litter.
    """
    with tempfile.TemporaryDirectory() as tmp:
        child, in_path, out_path = (Path(tmp, n) for n in ("child.py", "in.json", "out.json"))
        child.write_text(code)
        in_path.write_text(json.dumps(payload))
        subprocess.run(
            [python, str(child), *argv, str(in_path), str(out_path)],
            env=env,
            check=True,
            cwd=tmp,
        )
        return json.loads(out_path.read_text())


def run_vllm_child(
    vllm_python: str,
    code: str,
    payload: Any,
    *argv: str,
    threads: int | None = None,
    kv_gib: float = 2,
) -> Any:
    """`run_child` in `vllm_env(threads, kv_gib)`."""
    return run_child(vllm_python, code, payload, *argv, env=vllm_env(threads, kv_gib))


def api_server_command(
    python: str, model: str, port: int, dtype: str, max_model_len: int = 512
) -> list[str]:
    """vLLM's OpenAI-compatible server on 127.0.0.1:PORT, the model served by its
    directory's name (as pagefleet's configs do), at its defaults otherwise."""
    return [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--max-model-len",
        str(max_model_len),
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--dtype",
        dtype,
        "--served-model-name",
        Path(model).name,
    ]
