"""`pagefleet serve` on 127.0.0.1 exposes nothing of Ray's control plane: every socket its
process tree listens on is a loopback one, and Ray's job API (the dashboard agent's
`/api/job_agent/jobs/`, the dashboard's `/api/jobs/`) refuses an unauthenticated
submission on every port its Ray processes listen on, so the command never runs.
The Serve app still answers a completion under Ray's token authentication. Serve's
proxy refuses a request with too many or too large header fields (431, or a closed
connection), at the defaults of `limits.max_headers` / `max_header_bytes`."""

from __future__ import annotations

import ipaddress
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from pagefleet.bench.launcher import free_port
from pagefleet.cluster.config import Limits
from tests.e2e.served import Served, serving

pytestmark = pytest.mark.e2e

JOB_PATHS = ("/api/job_agent/jobs/", "/api/jobs/")
MARKER_WAIT_S = 20.0  # a submitted job's entrypoint runs within seconds of its submission


@pytest.fixture(scope="module")
def served(llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    config = {
        "model": llama_dir,
        "served_model_name": "tiny",
        "host": "127.0.0.1",
        "port": free_port(),
        "replicas": 1,
        "replica_resources": {"num_cpus": 0.5},
        "engine": {"num_kv_blocks": 32, "block_size": 8, "max_num_seqs": 4},
    }
    with serving(config, tmp_path_factory.mktemp("control-plane")) as s:
        yield s


def tree(served: Served) -> list[psutil.Process]:
    root = psutil.Process(served.proc.pid)
    return [root, *root.children(recursive=True)]


def listening(served: Served) -> list[tuple[str, str, int]]:
    """(process name, address, port) of every TCP socket the server's tree listens on."""
    out = []
    for p in tree(served):
        try:
            conns, name = p.net_connections(kind="tcp"), p.name()
        except psutil.NoSuchProcess:
            continue
        out += [(name, c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN]
    return out


def loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%")[0])
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def machine_addresses() -> list[str]:
    """This machine's own non-loopback IPv4 addresses (where a remote attacker knocks)."""
    return [
        a.address
        for addrs in psutil.net_if_addrs().values()
        for a in addrs
        if a.family.name == "AF_INET" and not ipaddress.ip_address(a.address).is_loopback
    ]


def reachable_at(address: str) -> list[str]:
    """Where a client reaches a socket listening on `address` (a wildcard: everywhere).
    Only the tree's own sockets are knocked on: other servers on this machine may hold
    the same port on another address."""
    ip = ipaddress.ip_address(address.split("%")[0])
    ip = getattr(ip, "ipv4_mapped", None) or ip
    if ip.is_unspecified:
        return ["127.0.0.1", *machine_addresses()]
    return [str(ip)] if ip.version == 4 else [f"[{ip}]"]


def submission_accepted(host: str, port: int, path: str, marker: Path) -> bool:
    """POST a job with no credentials; True if the server said 2xx."""
    body = {"entrypoint": f"touch {marker}"}
    try:
        r = httpx.post(f"http://{host}:{port}{path}", json=body, timeout=5)
    except httpx.HTTPError:  # refused, reset, not HTTP (gRPC), no answer
        return False
    return r.is_success


def test_nothing_listens_beyond_loopback(served: Served) -> None:
    sockets = listening(served)
    assert any(name == "raylet" for name, _, _ in sockets), sockets
    exposed = sorted({(n, f"{a}:{p}") for n, a, p in sockets if not loopback(a)})
    assert exposed == [], f"listening beyond loopback: {exposed}"


def test_unauthenticated_job_submission_is_refused_on_every_port(
    served: Served, tmp_path: Path
) -> None:
    marker = tmp_path / "marker"
    targets = sorted({(h, p) for _, a, p in listening(served) for h in reachable_at(a)})
    accepted = [
        f"{host}:{port}{path}"
        for host, port in targets
        for path in JOB_PATHS
        if submission_accepted(host, port, path, marker)
    ]
    deadline = time.monotonic() + MARKER_WAIT_S
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(1)
    assert (accepted, marker.exists()) == ([], False), f"job accepted at {accepted}"


def test_the_app_answers_under_token_authentication(served: Served) -> None:
    r = httpx.post(
        f"{served.url}/v1/completions",
        json={"model": "tiny", "prompt": "hello", "max_tokens": 4, "temperature": 0},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4
    assert any("token authentication on" in line for line in served.log), "".join(served.log)


def get_health(served: Served, headers: list[tuple[str, str]]) -> httpx.Response | None:
    """GET /health with these header fields; None: the server closed the connection."""
    try:
        return httpx.get(f"{served.url}/health", headers=headers, timeout=60)
    except httpx.HTTPError:
        return None


@pytest.mark.parametrize(
    "headers",
    [
        [("x-big", "a" * (Limits().max_header_bytes + 1))],
        [("x-huge", "a" * 8 * 1024 * 1024)],
        [(f"x-h{i}", "1") for i in range(Limits().max_headers + 1)],
        [(f"x-h{i}", "1") for i in range(20_000)],
    ],
    ids=["one-over-the-bytes", "8MiB", "one-over-the-count", "20000"],
)
def test_oversized_or_too_many_headers_are_refused(
    served: Served, headers: list[tuple[str, str]]
) -> None:
    r = get_health(served, headers)
    if r is not None:
        assert r.status_code == 431, r.status_code
        assert r.json()["error"]["param"] == "headers"


def test_ordinary_headers_pass_through_the_bound(served: Served) -> None:
    client = openai.OpenAI(
        base_url=f"{served.url}/v1",
        api_key="unused",
        max_retries=0,
        default_headers={f"x-h{i}": "v" * 100 for i in range(40)},
    )
    out = client.completions.create(model="tiny", prompt="hi", max_tokens=2, temperature=0)
    assert out.usage is not None and out.usage.completion_tokens == 2
