"""The one server launcher: a `pagefleet serve` (or vLLM's API server) of a benchmark's own.

- `free_port`: a port in this project's HTTP range nothing listens on.
- `launch`: a server command in its own process group, its output in a log, until
  `is_ready` (the one readiness check) says yes; stopped on leaving, as a user
  stops it (Ctrl-C), with what of it was left running afterwards.
- `pagefleet_serve`: `launch` of `pagefleet serve` on a config dict, with an
  embedded Ray of its own.
- `exit_on_signals`: Ctrl-C and SIGTERM reach the `finally` that stops the servers.
"""

from __future__ import annotations

import contextlib
import os
import random
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import yaml

from pagefleet.bench.client import model_id
from pagefleet.bench.metrics import scrape

HTTP_PORTS = range(8500, 8600)  # this project's range for HTTP servers


def first_free_port(ports: Iterable[int]) -> int | None:
    """The first of `ports` that 127.0.0.1 can bind now (None: none can). Bound and
    released: a server started later may still lose it to someone else."""
    for port in ports:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    return None


def free_port(ports: Sequence[int] = HTTP_PORTS) -> int:
    """A port of `ports` nothing listens on, tried in random order (two benchmarks
    started at once rarely pick the same one)."""
    order = list(ports)
    random.shuffle(order)
    port = first_free_port(order)
    if port is None:
        raise RuntimeError(f"no free port in {min(ports)}-{max(ports)}")
    return port


def is_ready(url: str, replicas: int = 0) -> bool:
    """The readiness check: GET /health answers 200 (pagefleet: an engine replica is
    healthy; vLLM's API server: its engine is up) and, for `replicas` > 0, that many
    engine replicas report their KV blocks to /metrics."""
    try:
        if httpx.get(f"{url}/health", timeout=5).status_code != 200:
            return False
        return replicas <= 0 or len(scrape(url, timeout=5).replicas()) >= replicas
    except httpx.HTTPError:
        return False


def tail(log: Path, lines: int = 30) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    return ""


@dataclass
class Server:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path
    model: str = ""  # the first id at /v1/models
    stopped: tuple[int | None, list[str]] | None = field(default=None, repr=False)

    def stop(self) -> tuple[int | None, list[str]]:
        """Ctrl-C (SIGINT), as a user stops it: (exit code, None if it had to be killed;
        what of its process tree was left running afterwards, killed then). Once."""
        if self.stopped is None:
            self.stopped = _stop(self.proc)
        return self.stopped


def _stop(proc: subprocess.Popen[bytes]) -> tuple[int | None, list[str]]:
    if proc.poll() is not None:
        return proc.returncode, []
    tree: list[psutil.Process] = []
    with contextlib.suppress(psutil.NoSuchProcess):
        tree = psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(signal.SIGINT)
    try:
        code: int | None = proc.wait(120)
    except subprocess.TimeoutExpired:
        code = None
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    deadline = time.monotonic() + 30
    left: list[psutil.Process] = []
    while time.monotonic() < deadline:
        left = [p for p in tree if _alive(p)]
        if not left:
            break
        time.sleep(0.5)
    names = []
    for p in left:
        with contextlib.suppress(psutil.Error):
            names.append(" ".join(p.cmdline())[:60] or p.name())
            p.kill()  # ours: started by the server this launcher started
    return code, names


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@contextlib.contextmanager
def launch(
    cmd: list[str],
    url: str,
    log: Path,
    env: dict[str, str],
    timeout_s: float,
    replicas: int = 0,
    api_key: str | None = None,
) -> Iterator[Server]:
    """Run `cmd` (a server that will listen at `url`) until `is_ready(url, replicas)`;
    yields it with its model id, and stops it on leaving (`Server.stop`)."""
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    server = Server(url, proc, log)
    try:
        deadline = time.monotonic() + timeout_s
        while not is_ready(url, replicas):
            if proc.poll() is not None:
                raise RuntimeError(f"{shlex.join(cmd)} exited with {proc.returncode}:\n{tail(log)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url}: not ready after {timeout_s:.0f} s:\n{tail(log)}")
            time.sleep(1.0)
        server.model = model_id(url, api_key)
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def pagefleet_serve(
    config: dict[str, Any],
    workdir: Path,
    tag: str,
    replicas: int = 0,
    timeout_s: float = 400.0,
    port: int | None = None,
    api_key: str | None = None,
) -> Iterator[Server]:
    """`pagefleet serve` of `config` (host and port filled in: `port`, or a free one),
    ready once `replicas` engine replicas report to /metrics (0: once /health is
    ok). Writes WORKDIR/TAG.yaml and TAG.log."""
    port = port or free_port()
    path = workdir / f"{tag}.yaml"
    path.write_text(yaml.safe_dump({**config, "host": "127.0.0.1", "port": port}, sort_keys=False))
    # Its own Ray, never a cluster the caller's environment points at. Without an
    # address ray.init() also joins the last `ray start` cluster on this machine (it
    # finds it through $RAY_TMPDIR/ray/ray_current_cluster, default /tmp): a Ray temp
    # dir of its own hides any. Short, as Ray's socket paths must fit 107 bytes.
    ray_tmp = tempfile.mkdtemp(prefix="pfr-")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env |= {
        "PYTHONUNBUFFERED": "1",
        "RAY_AUTH_MODE": "disabled",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_TMPDIR": ray_tmp,
    }
    cmd = [sys.executable, "-m", "pagefleet.cli", "serve", str(path)]
    try:
        url = f"http://127.0.0.1:{port}"
        with launch(cmd, url, workdir / f"{tag}.log", env, timeout_s, replicas, api_key) as s:
            yield s
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


def served_config(path: str) -> tuple[Any, dict[str, Any]]:
    """(the loaded pagefleet config, the dict to give `pagefleet_serve`): every field,
    JSON-typed, the API key unmasked."""
    from pagefleet.cluster.config import load_config

    config = load_config(path)
    data = config.model_dump(mode="json")
    if config.api_key is not None:
        data["api_key"] = config.api_key.get_secret_value()  # json mode masks it
    return config, data


def exit_on_signals() -> None:
    """Ctrl-C and SIGTERM end a benchmark through its `finally` blocks, which stop the
    servers it started. Set explicitly: a shell starts background jobs with SIGINT
    ignored, and Python's default SIGTERM skips `finally`."""

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
