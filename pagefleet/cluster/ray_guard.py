"""Locking down the Ray that `pagefleet serve` starts itself, and checking one it joins.

Ray's control plane (GCS, raylets, workers' gRPC servers, the dashboard agent and its job
API) runs whatever it is asked to: anyone who reaches one of its ports and speaks its
protocol can run code as the server's user. So a Ray of our own always runs with Ray's
token authentication (`RAY_AUTH_MODE=token`), with a fresh random token per server
written to a file only its user can read (`RAY_AUTH_TOKEN_PATH`; an operator's own
`RAY_AUTH_TOKEN` or `RAY_AUTH_TOKEN_PATH` is used instead), which Ray's processes inherit
through the environment. Where the HTTP host is loopback the node is 127.0.0.1 and Ray
binds every port there: Ray resolves a loopback node address to the machine's own
address unless `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` (its single-machine mode), and its
gRPC servers listen on loopback exactly when the node address is. Serve 2.60 binds one
server to `[::]:0` whatever the node (each replica's inter-deployment gRPC server, token
checked): a `worker_process_setup_hook` (`bind_replica_servers_to_node`) binds it to
the node address instead.

A cluster we join keeps its own settings: `cluster_requires_token` asks its GCS, with
no token, for its cluster id, which a cluster with token authentication refuses.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import shutil
import socket
import tempfile
from collections.abc import MutableMapping
from dataclasses import dataclass, field

AUTH_MODE_ENV = "RAY_AUTH_MODE"
TOKEN_ENV = "RAY_AUTH_TOKEN"
TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"
SINGLE_MACHINE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
LOOPBACK_NODE_IP = "127.0.0.1"


def is_loopback(host: str) -> bool:
    """Whether every address `host` names is a loopback one ("0.0.0.0" and "" are not)."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


@dataclass
class OwnRayGuard:
    """The environment a Ray of our own starts in, and the token file it owns."""

    host: str
    token_dir: str | None = None
    env: dict[str, str] = field(default_factory=dict)

    @property
    def loopback(self) -> bool:
        return is_loopback(self.host)

    def init_options(self) -> dict[str, object]:
        """`ray.init`'s options for a loopback host: the node on 127.0.0.1, and every
        worker process's setup hook binding Serve's replica servers there."""
        if not self.loopback:
            return {}
        hook = f"{__name__}.{bind_replica_servers_to_node.__name__}"
        return {
            "_node_ip_address": LOOPBACK_NODE_IP,
            "runtime_env": {"worker_process_setup_hook": hook},
        }

    def apply(self, environ: MutableMapping[str, str]) -> None:
        """Set token authentication (and the loopback node) in `environ`, before Ray starts."""
        self.env = {AUTH_MODE_ENV: "token"}
        if not environ.get(TOKEN_ENV) and not environ.get(TOKEN_PATH_ENV):
            self.env[TOKEN_PATH_ENV] = self._write_token()
        if self.loopback:
            self.env[SINGLE_MACHINE_ENV] = "0"
        environ.update(self.env)

    def _write_token(self) -> str:
        self.token_dir = tempfile.mkdtemp(prefix="pagefleet-ray-")  # mode 0700
        path = os.path.join(self.token_dir, "auth_token")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        return path

    def describe(self) -> str:
        where = "127.0.0.1 only" if self.loopback else "every interface"
        token = self.env.get(TOKEN_PATH_ENV, f"${TOKEN_ENV} / ${TOKEN_PATH_ENV}")
        return f"Ray: token authentication on (token: {token}), its ports on {where}"

    def cleanup(self) -> None:
        """Remove the token file we wrote (after Ray stopped)."""
        if self.token_dir is not None:
            shutil.rmtree(self.token_dir, ignore_errors=True)
            self.token_dir = None


def cluster_requires_token(gcs_address: str, timeout_s: float = 10.0) -> bool | None:
    """True if the GCS at host:port refuses a call without a token, False if it answers,
    None if it cannot tell (unreachable, another error)."""
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    with grpc.insecure_channel(gcs_address) as channel:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        try:
            stub.GetClusterId(gcs_service_pb2.GetClusterIdRequest(), timeout=timeout_s)
        except grpc.RpcError as e:
            return True if e.code() == grpc.StatusCode.UNAUTHENTICATED else None
    return False


def joined_cluster_line(gcs_address: str) -> str:
    """The one line `pagefleet serve` logs about a cluster it joined."""
    try:
        verdict = cluster_requires_token(gcs_address)
    except Exception:  # a courtesy line: never fail a started server for it
        verdict = None
    if verdict is True:
        return f"Ray cluster at {gcs_address}: token authentication on"
    if verdict is False:
        return (
            f"Ray cluster at {gcs_address}: authentication OFF: anyone who reaches its "
            "ports can run code on it (docs/security.md: start it with RAY_AUTH_MODE=token)"
        )
    return f"Ray cluster at {gcs_address}: could not tell whether authentication is on"


def bind_replica_servers_to_node() -> None:
    """Ray's `worker_process_setup_hook` for a loopback node: Serve 2.60 binds each
    replica's inter-deployment gRPC server to `[::]:0` whatever the node address; on a
    loopback node bind it to the node address instead (it is reached there)."""
    import ray
    from ray.serve._private import replica

    node_ip = ray.util.get_node_ip_address()
    if not is_loopback(node_ip):
        return
    add_port = replica.add_port_to_grpc_server

    def add_port_on_node(server: object, address: str) -> int:
        return add_port(server, address.replace("[::]", node_ip, 1))

    replica.add_port_to_grpc_server = add_port_on_node
