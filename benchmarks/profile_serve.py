"""py-spy every process on the serving path while `pagefleet bench serve`'s load runs.

    pip install py-spy   # not a dependency of pagefleet; root or ptrace rights needed
    python benchmarks/profile_serve.py --config configs/smollm-135m.yaml --users 20 \\
        --seconds 20 --out benchmarks/results/profile_serve

Starts `pagefleet serve CONFIG`, warms it up, then runs USERS closed-loop streaming
users (50 tokens each, as `bench serve` does) while py-spy samples each process of the
path at once for SECONDS: Serve's HTTP proxy, the ingress replica, the engine replica
actor and its engine core process (the controller too, for completeness). Writes, per
process, its CPU share (user+sys seconds over the window, from /proc) and its top
functions by self time and by inclusive time (% of its samples), as OUT.md; the raw
collapsed stacks beside it (OUT-<process>.txt) for flame graphs.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import yaml

from pagefleet.bench.client import closed_loop, model_id
from pagefleet.bench.launcher import pagefleet_serve
from pagefleet.bench.machine import machine_description
from pagefleet.bench.report import markdown_table, write_report
from pagefleet.bench.serve import PROMPTS
from pagefleet.bench.workloads import BenchRequest

ROLES = {
    "proxy": "ProxyActor",
    "ingress": "ServeReplica:pagefleet:Ingress",
    "engine replica": "ServeReplica:pagefleet:EngineReplica",
    "controller": "ServeController",
}


def find_processes(root: int) -> dict[str, psutil.Process]:
    found: dict[str, psutil.Process] = {}
    for p in psutil.Process(root).children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            continue
        for role, mark in ROLES.items():
            if mark in cmd and role not in found:
                found[role] = p
    replica = found.get("engine replica")
    if replica is not None:
        for c in replica.children(recursive=True):
            if "spawn_main" in " ".join(c.cmdline()):
                found["engine core"] = c
                break
    return found


def top(stacks: Path, n: int) -> tuple[list[tuple[str, float]], list[tuple[str, float]], int]:
    """(self-time top n, inclusive top n, samples) from py-spy's raw (collapsed) output."""
    own: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    total = 0
    for line in stacks.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        k = int(count)
        frames = [
            f.split(" (")[0] + " (" + f.split(" (")[1].split(":")[0].rsplit("/", 1)[-1] + ")"
            if " (" in f
            else f
            for f in stack.split(";")
        ]
        total += k
        own[frames[-1]] += k
        for f in set(frames):
            incl[f] += k
    pct = lambda c: [(f, 100.0 * v / max(1, total)) for f, v in c.most_common(n)]  # noqa: E731
    return pct(own), pct(incl), total


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/smollm-135m.yaml")
    ap.add_argument("--users", type=int, default=20)
    ap.add_argument("--seconds", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=50)
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    ap.add_argument("--out", default="benchmarks/results/profile_serve")
    args = ap.parse_args()
    pyspy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    config = yaml.safe_load(Path(args.config).read_text())
    model = config["model"]
    if not Path(model).is_absolute():
        config["model"] = str((Path(args.config).parent / model).resolve())
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="pagefleet-profile-"))  # the served config and log
    with pagefleet_serve(config, work, "profile_serve") as server:
        url = server.url
        name = model_id(url)
        warm = [[BenchRequest(PROMPTS[u % len(PROMPTS)], 8)] for u in range(2)]
        asyncio.run(closed_loop(url, name, warm, [0.0, 0.0], timeout_s=300))
        procs = find_processes(server.proc.pid)
        print("profiling:", {r: p.pid for r, p in procs.items()}, flush=True)
        stop = threading.Event()
        done_tokens = [0]

        def load() -> None:
            while not stop.is_set():
                reqs = [
                    [
                        BenchRequest(PROMPTS[(u + k) % len(PROMPTS)], args.max_tokens)
                        for k in range(2)
                    ]
                    for u in range(args.users)
                ]
                results, _ = asyncio.run(
                    closed_loop(url, name, reqs, [0.0] * args.users, timeout_s=600)
                )
                done_tokens[0] += sum(r.tokens for r in results if r.ok)

        t = threading.Thread(target=load, daemon=True)
        t.start()
        time.sleep(5)  # the load reaches its steady state
        cpu0 = {r: p.cpu_times() for r, p in procs.items()}
        tok0, t0 = done_tokens[0], time.monotonic()
        spies = {
            r: subprocess.Popen(
                [
                    pyspy,
                    "record",
                    "-p",
                    str(p.pid),
                    "-d",
                    str(args.seconds),
                    "-r",
                    str(args.rate),
                    "-f",
                    "raw",
                    "-o",
                    f"{args.out}-{r.replace(' ', '_')}.txt",
                    "--nonblocking",
                    "--gil",  # only a thread holding the GIL: the process's Python work
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for r, p in procs.items()
        }
        for s in spies.values():
            s.wait()
        wall = time.monotonic() - t0
        cpu1 = {r: p.cpu_times() for r, p in procs.items()}
        stop.set()
        t.join(600)
        tok_s = (done_tokens[0] - tok0) / max(wall, 1e-9)
    sections, share_rows = [], []
    for r in procs:
        used = (cpu1[r].user + cpu1[r].system) - (cpu0[r].user + cpu0[r].system)
        share_rows.append([r, f"{100 * used / wall:.0f}%"])
        path = Path(f"{args.out}-{r.replace(' ', '_')}.txt")
        if not path.exists():
            sections.append(f"#### {r}\n\n(py-spy wrote nothing)\n")
            continue
        own, incl, total = top(path, args.top)
        rows = [
            [f"`{a}`", f"{pa:.1f}%", f"`{b}`", f"{pb:.1f}%"]
            for (a, pa), (b, pb) in zip(own, incl, strict=False)
        ]
        sections.append(
            f"#### {r} ({total} samples holding the GIL)\n\n"
            + markdown_table(["self time", "%", "inclusive", "%"], rows)
            + "\n"
        )
    body = (
        f"{machine_description()}\n\n{args.users} users streaming {args.max_tokens}-token "
        f"completions; py-spy at {args.rate} Hz on every process for {args.seconds} s "
        f"(`--nonblocking --gil`: samples of the thread holding the GIL, so the % are of the process's Python time). Throughput over the window: "
        f"{tok_s:.1f} tok/s.\n\nCPU per process over the window (of one core):\n\n"
        + markdown_table(["process", "CPU"], share_rows)
        + "\n\n"
        + "\n".join(sections)
    )
    print(write_report(args.out, "Where the serving path's time goes (py-spy)", body))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
