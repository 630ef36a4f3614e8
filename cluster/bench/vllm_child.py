"""Run a script under vLLM's own python (its CPU build lives in a separate venv: it pins
other versions of our dependencies) and read back the JSON it writes."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any


def run_vllm_child(vllm_python: str, code: str, payload: Any, *argv: str) -> Any:
    """`vllm_python child.py *argv payload.json out.json`; returns out.json's content.

    The child runs offline (HF_HUB_OFFLINE) with vLLM's KV space pinned to 2 GiB, in a
    temporary directory that it may litter.
    """
    with tempfile.TemporaryDirectory() as tmp:
        child, in_path, out_path = (Path(tmp, n) for n in ("child.py", "in.json", "out.json"))
        child.write_text(code)
        in_path.write_text(json.dumps(payload))
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "2"}
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        subprocess.run(
            [vllm_python, str(child), *argv, str(in_path), str(out_path)],
            env=env,
            check=True,
            cwd=tmp,
        )
        return json.loads(out_path.read_text())
