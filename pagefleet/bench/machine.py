"""Where a benchmark ran: the machine and versions each result is headed with, and the
load other work put on the machine meanwhile."""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
import threading
from importlib import metadata
from pathlib import Path

VERSIONED = ("torch", "ray", "fastapi", "httpx")


def cpu_info(unknown: str = "unknown CPU") -> tuple[str, list[str]]:
    """(CPU model, its native bf16 flags among avx512_bf16/amx_bf16) from /proc/cpuinfo."""
    model, flags = platform.processor() or unknown, set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    return model, sorted(flags & {"avx512_bf16", "amx_bf16"})


def git_revision() -> str:
    """The checkout's short commit, "-dirty" after it when tracked files differ from it
    (a figure taken on uncommitted code says so); "" outside a git checkout."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        return subprocess.run(
            ["git", "describe", "--always", "--abbrev=7", "--dirty", "--exclude=*"],
            capture_output=True,
            text=True,
            check=True,
            timeout=5,
            cwd=Path(__file__).parent,
        ).stdout.strip()
    return ""


def versions() -> str:
    """pagefleet's commit, Python and the installed versions of what it runs on."""
    out = [f"pagefleet {git_revision() or '(no git)'}", f"Python {platform.python_version()}"]
    for dist in VERSIONED:
        with contextlib.suppress(metadata.PackageNotFoundError):
            out.append(f"{dist} {metadata.version(dist)}")
    return ", ".join(out)


def machine_description() -> str:
    """CPU model, cores, native bf16, load, versions: what a reader needs to compare."""
    model, bf16 = cpu_info()
    return (
        f"Machine: {model}, {os.cpu_count()} cores, native bf16: "
        f"{'yes (' + ', '.join(bf16) + ')' if bf16 else 'no'}; load average at start "
        f"{os.getloadavg()[0]:.2f}. Versions: {versions()}."
    )


class LoadMonitor:
    """The machine's 1-minute load average, sampled in a thread while a benchmark runs:
    a shared machine's other work shows in the report, not only in the numbers."""

    def __init__(self, period_s: float = 5.0) -> None:
        self.samples: list[float] = []
        self._period_s = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while True:
            self.samples.append(os.getloadavg()[0])
            if self._stop.wait(self._period_s):
                return

    def __enter__(self) -> LoadMonitor:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def summary(self) -> str:
        if not self.samples:
            return ""
        mean = sum(self.samples) / len(self.samples)
        return (
            f"1-minute load average during the run: mean {mean:.1f}, max "
            f"{max(self.samples):.1f} on {os.cpu_count()} cores"
            + (
                " (other work shared the machine: read the figures with care)."
                if mean > 2.5
                else "."
            )
        )
