"""Run `pagefleet serve CONFIG` as a user does, and stop it with Ctrl-C, checking nothing is left."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import yaml
from prometheus_client.parser import text_string_to_metric_families


class Served:
    def __init__(self, proc: subprocess.Popen[str], url: str, log: list[str]) -> None:
        self.proc = proc
        self.url = url
        self.log = log
        self.descendants: list[psutil.Process] = []

    def scrape(self) -> dict[str, dict[str, float]]:
        """{metric sample name: {replica (None: fleet-wide): value}} for the tiny model (no finish reasons)."""
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        out: dict[str, dict[str, float]] = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.labels.get("model_name") == "tiny" and "finished_reason" not in s.labels:
                    out.setdefault(s.name, {})[s.labels.get("replica")] = s.value
        return out

    def total(self, name: str) -> float:
        return sum(self.scrape().get(name, {}).values())


def start_served(config: Path, timeout_s: float = 240, env: dict[str, str] | None = None) -> Served:
    """`pagefleet serve CONFIG` in its own session, returned once it printed its URL.

    env: extra environment variables for it (e.g. PAGEFLEET_API_KEY, RAY_TMPDIR).
    """
    port = yaml.safe_load(config.read_text())["port"]
    return start_serve_command([str(config)], port, timeout_s, env)


def start_serve_command(
    argv: list[str], port: int, timeout_s: float = 240, env: dict[str, str] | None = None
) -> Served:
    """`pagefleet serve ARGV...` (a model and flags, or a config) listening on `port`, in its
    own session, returned once it printed its URL."""
    env = (
        {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        | {"PYTHONUNBUFFERED": "1"}
        | (env or {})
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagefleet.cli", "serve", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    log: list[str] = []
    ready = threading.Event()

    def reader() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            log.append(line)
            if "ready in" in line:
                ready.set()

    threading.Thread(target=reader, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while not ready.wait(0.5):
        if proc.poll() is not None or time.monotonic() > deadline:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError("pagefleet serve did not come up:\n" + "".join(log))
    return Served(proc, f"http://127.0.0.1:{port}", log)


@contextlib.contextmanager
def serving(
    config: dict[str, Any], workdir: Path, env: dict[str, str] | None = None
) -> Iterator[Served]:
    """`pagefleet serve` of `config` (written to workdir/config.yaml); stopped with Ctrl-C
    at the end, and checked to leave nothing behind, unless a test stopped it already."""
    path = workdir / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    served = start_served(path, env=env)
    try:
        yield served
    finally:
        if served.proc.poll() is None:
            stop_served(served)


def children_now() -> set[int]:
    """The pids of this test process's descendants, to compare with after a cluster stops."""
    return {p.pid for p in psutil.Process().children(recursive=True)}


def assert_none_left_since(before: set[int], timeout_s: float = 60) -> None:
    """Every descendant started after `before` has exited within `timeout_s`. The one
    exception is multiprocessing's resource tracker: the test process starts it on first
    use of a semaphore and it lives until that process exits, whatever the cluster does."""

    def left() -> list[psutil.Process]:
        return [
            p
            for p in psutil.Process().children(recursive=True)
            if p.pid not in before
            and p.is_running()
            and p.status() != psutil.STATUS_ZOMBIE
            and "multiprocessing.resource_tracker" not in " ".join(p.cmdline())
        ]

    deadline = time.monotonic() + timeout_s
    while alive := left():
        assert time.monotonic() < deadline, [p.cmdline()[:3] for p in alive]
        time.sleep(0.5)


def stop_served(served: Served) -> None:
    """Ctrl-C: it must exit 0 and leave none of its processes (Ray's included) running."""
    if served.proc.poll() is not None:
        return
    descendants = psutil.Process(served.proc.pid).children(recursive=True)
    assert any("raylet" in " ".join(p.cmdline()) for p in descendants if p.is_running())
    served.proc.send_signal(signal.SIGINT)
    try:
        code = served.proc.wait(120)
    except subprocess.TimeoutExpired:
        os.killpg(served.proc.pid, signal.SIGKILL)
        raise
    assert code == 0, "".join(served.log)
    deadline = time.monotonic() + 30
    while alive := [
        p for p in descendants if p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    ]:
        if time.monotonic() > deadline:
            for p in alive:
                p.kill()
            raise AssertionError(f"left running: {[p.cmdline()[:3] for p in alive]}")
        time.sleep(0.5)
