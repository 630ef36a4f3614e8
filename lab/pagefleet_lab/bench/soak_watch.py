"""What `bench soak` watches on the server: every process of it (its role, from the
command line, and its RSS), and each engine replica's KV blocks and queue."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

from pagefleet.bench.metrics import Scrape, parse_metrics, scrape_async

# Ray's own helpers, not on a request's path: one group, so the plot stays readable.
_RAY_SUPPORT = (
    "dashboard.py",
    "monitor.py",
    "log_monitor.py",
    "ray::DashboardAgent",
    "ray::RuntimeEnvAgent",
)
_DEPLOYMENT_ROLES = {
    "EngineReplica": "engine replica",
    "Ingress": "ingress",
    "MetricsHubDeployment": "metrics hub",
}


def process_role(cmdline: Sequence[str], name: str, parent_role: str | None) -> str:
    """The role of one of the server's processes, from its command line (None parent: the root).

    Ray names its actor processes `ray::Class` (Serve's replicas `ray::ServeReplica:app:
    Deployment`); the engine core is a multiprocessing child of an engine replica.
    """
    if parent_role is None:
        return "pagefleet serve"
    cmd = " ".join(cmdline) or name
    if Path(cmdline[0] if cmdline else name).name == "gcs_server":
        return "ray gcs"
    if Path(cmdline[0] if cmdline else name).name == "raylet":
        return "ray raylet"
    if cmd.startswith("ray::ServeController"):
        return "serve controller"
    if cmd.startswith("ray::ProxyActor"):
        return "serve proxy"
    if cmd.startswith("ray::ServeReplica:"):
        # Ray retitles an actor's process with the method it runs: `...:Ingress.check_health`.
        deployment = cmd.split()[0].rsplit(":", 1)[-1].split(".")[0]
        return _DEPLOYMENT_ROLES.get(deployment, f"serve replica {deployment}")
    if cmd.startswith("ray::IDLE"):
        return "ray idle worker"
    if any(s in cmd for s in _RAY_SUPPORT):
        return "ray support"
    if "multiprocessing.resource_tracker" in cmd:
        return "mp resource tracker"
    if "multiprocessing.spawn" in cmd or "--multiprocessing-fork" in cmd:
        if parent_role == "engine replica":
            return "engine core"
        if parent_role == "engine core":
            return "engine TP rank"
        return f"child of {parent_role}"
    if cmd.startswith("ray::"):
        return "ray actor " + cmd.split()[0][5:]
    return "other " + (Path(cmdline[0]).name if cmdline else name)


@dataclass
class ProcSample:
    pid: int
    role: str
    rss_mib: float


def server_processes(root: int) -> list[ProcSample]:
    """Every live process of the tree under `root`, with its role and RSS."""
    try:
        top = psutil.Process(root)
        procs = [top, *top.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
    seen: dict[int, tuple[int, list[str], str, float]] = {}
    for p in procs:
        try:
            with p.oneshot():
                seen[p.pid] = (p.ppid(), p.cmdline(), p.name(), p.memory_info().rss / 2**20)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    roles: dict[int, str] = {}

    def role(pid: int) -> str:
        # A child's role can depend on its parent's (the engine core under a replica).
        if pid not in roles:
            ppid, cmdline, name, _ = seen[pid]
            parent = None if pid == root else (role(ppid) if ppid in seen else "?")
            roles[pid] = process_role(cmdline, name, parent)
        return roles[pid]

    return [ProcSample(pid, role(pid), rss) for pid, (_, _, _, rss) in seen.items()]


@dataclass
class ReplicaState:
    free: float = math.nan
    total: float = math.nan
    running: float = 0.0
    waiting: float = 0.0


_REPLICA_SERIES = {
    "pagefleet:kv_blocks_free": "free",
    "pagefleet:kv_blocks_total": "total",
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
}


def replica_states(m: Scrape) -> tuple[dict[str, ReplicaState], float | None]:
    """Per-replica KV blocks and queue from a /metrics page, and `pagefleet:replicas`."""
    out: dict[str, ReplicaState] = {}
    for name, attr in _REPLICA_SERIES.items():
        for replica, value in m.by(name, "replica").items():
            if replica:
                setattr(out.setdefault(replica, ReplicaState()), attr, value)
    fleet = m.total("pagefleet:replicas") if m.value("pagefleet:replicas") is not None else None
    return out, fleet


def parse_replicas(text: str) -> tuple[dict[str, ReplicaState], float | None]:
    return replica_states(parse_metrics(text))


async def scrape_replicas(
    client: httpx.AsyncClient, url: str
) -> tuple[dict[str, ReplicaState], float | None]:
    """`replica_states` of the fleet now; nothing when /metrics does not answer."""
    try:
        return replica_states(await scrape_async(client, url))
    except (httpx.HTTPError, ValueError):
        return {}, None


def leaked_blocks(replicas: dict[str, ReplicaState]) -> int:
    return int(sum(r.total - r.free for r in replicas.values()))
