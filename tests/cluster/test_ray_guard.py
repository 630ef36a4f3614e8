"""`ray_guard`: the environment `pagefleet serve` starts its own Ray in (token
authentication, a private token file, loopback binding), and the line it logs about a
cluster it joins, checked against real Ray clusters with and without authentication."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pagefleet.cluster.ray_guard import (
    AUTH_MODE_ENV,
    SINGLE_MACHINE_ENV,
    TOKEN_ENV,
    TOKEN_PATH_ENV,
    OwnRayGuard,
    is_loopback,
    joined_cluster_line,
)

# A Ray of its own in a child process: prints its GCS address, stops when stdin closes.
CLUSTER = """
import sys, ray
ray.init(address="local", include_dashboard=False, num_cpus=0)
print(ray.get_runtime_context().gcs_address, flush=True)
sys.stdin.read()
ray.shutdown()
"""


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("localhost", True), ("::1", True), ("0.0.0.0", False), ("", False)],
)
def test_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_own_ray_gets_token_auth_a_private_token_file_and_a_loopback_node() -> None:
    environ: dict[str, str] = {AUTH_MODE_ENV: "disabled"}
    guard = OwnRayGuard("127.0.0.1")
    guard.apply(environ)
    try:
        assert environ[AUTH_MODE_ENV] == "token"
        assert environ[SINGLE_MACHINE_ENV] == "0"
        token = Path(environ[TOKEN_PATH_ENV])
        assert len(token.read_text()) == 64
        assert stat.S_IMODE(token.stat().st_mode) == 0o600
        assert stat.S_IMODE(token.parent.stat().st_mode) == 0o700
        options = guard.init_options()
        assert options["_node_ip_address"] == "127.0.0.1"
        assert options["runtime_env"] == {
            "worker_process_setup_hook": "pagefleet.cluster.ray_guard.bind_replica_servers_to_node"
        }
    finally:
        guard.cleanup()
    assert not token.parent.exists()


def test_an_operators_token_is_kept_and_a_public_host_binds_where_ray_picks() -> None:
    environ = {TOKEN_ENV: "operator-token"}
    guard = OwnRayGuard("0.0.0.0")
    guard.apply(environ)
    assert environ == {TOKEN_ENV: "operator-token", AUTH_MODE_ENV: "token"}
    assert guard.init_options() == {}
    assert guard.token_dir is None


@pytest.fixture
def cluster(request: pytest.FixtureRequest) -> Iterator[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env |= {"RAY_USAGE_STATS_ENABLED": "0", AUTH_MODE_ENV: request.param}
    if request.param == "token":
        env[TOKEN_ENV] = "t" * 64
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen(
        [sys.executable, "-c", CLUSTER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    assert proc.stdout is not None and proc.stdin is not None
    try:
        yield proc.stdout.readline().strip()
    finally:
        proc.stdin.close()
        proc.wait(60)


@pytest.mark.parametrize("cluster", ["token"], indirect=True)
def test_a_joined_cluster_with_token_auth_is_reported_on(cluster: str) -> None:
    assert joined_cluster_line(cluster) == (f"Ray cluster at {cluster}: token authentication on")


@pytest.mark.parametrize("cluster", ["disabled"], indirect=True)
def test_a_joined_cluster_without_auth_is_reported_off(cluster: str) -> None:
    line = joined_cluster_line(cluster)
    assert line.startswith(f"Ray cluster at {cluster}: authentication OFF"), line
