"""The GPU check's own plumbing, rehearsed on the CPU (`gpu_check --dry-run-cpu`).

A lent GPU is rare and short (one H200 for 15 minutes): a check that breaks there for a
reason a CPU could have shown wastes it. This runs the writer end to end on the tiny
model with the offline section only (the Triton kernels and the equality tests have
their own CPU tests), in a child process, since the writer runs pytest in-process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.compile


def test_dry_run_writes_the_offline_rows(llama_dir: str, tmp_path: Path) -> None:
    out = tmp_path / "gpu.md"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagefleet_lab.bench.gpu_check",
            "--dry-run-cpu",
            "--models",
            llama_dir,
            "--skip",
            "kernels,equality,tp",
            "--requests",
            "4",
            "--new-tokens",
            "3",
            "--out",
            str(out),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = out.read_text()
    assert "| model | system | start-up s | tokens | seconds | tok/s |" in report
    name = Path(llama_dir).name
    for system in (
        "pagefleet LLM.generate (compiled + CUDA graphs)",
        "pagefleet LLM.generate (enforce_eager)",
        "transformers continuous batching",
    ):
        row = next(
            line for line in report.splitlines() if line.startswith(f"| {name} | {system} |")
        )
        assert row.split(" | ")[3] == "12", row  # 4 requests x 3 new tokens
    assert "skipped (--skip kernels)" in report
    assert "all checks passed" in report
