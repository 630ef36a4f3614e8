"""What every pagefleet router on Ray Serve shares: reading a handle call's request
(`prompt_of`, `samples_of`, `carries_prompt`), the replica's label (`replica_key`), the
routing metrics (`RouterMetrics`) and the mix-in that counts routes and forgets departed
replicas (`CountsRoutes`). The contract with the caller is in `serve_routers`."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Sequence
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RunningReplica

from pagefleet.cluster.leaving import offered


def ingress_id() -> str:
    """The `ingress` label: the id of the Serve replica this process is (the router runs
    in the process holding the handle, an ingress replica), else one stable per process
    (a driver's handle, tests)."""
    try:
        from ray import serve

        return str(serve.get_replica_context().replica_id.unique_id)
    except Exception:  # not inside a replica: Serve raises
        return f"{socket.gethostname()}-{os.getpid()}"


class RouterMetrics:
    """The router's two counters (prometheus_client), or no-ops where it is missing.

    `registry` (default: the process's) and `ingress` (default: `ingress_id()`) are
    injectable so tests can play several ingresses in one process."""

    def __init__(self, registry: Any = None, ingress: str | None = None) -> None:
        self.ingress = ingress if ingress is not None else ingress_id()
        from prometheus_client import REGISTRY, Counter, Gauge

        from pagefleet.cluster.metrics import registered

        registry = REGISTRY if registry is None else registry

        self._routed = registered(
            Counter,
            "pagefleet:routed_requests",
            "Requests routed to each engine replica, by ingress replica and routing policy.",
            ("ingress", "replica", "policy"),
            registry,
        )
        self._hits = registered(
            Counter,
            "pagefleet:router_prefix_hit_blocks",
            "Prompt blocks the router found in the chosen replica's prefix cache, by ingress "
            "replica.",
            ("ingress",),
            registry,
        )
        self._view = registered(
            Gauge,
            "pagefleet:router_shared_view",
            "1 while the router's last exchange merged the other ingress replicas' sends and "
            "prompt owners, 0 while it routes on its own view (the hub unreachable).",
            ("ingress",),
            registry,
        )

    def shared_view(self, shared: bool) -> None:
        if self._view is not None:
            self._view.labels(ingress=self.ingress).set(1 if shared else 0)

    def routed(self, replica: str, policy: str, hit_blocks: int = 0) -> None:
        if self._routed is not None:
            self._routed.labels(ingress=self.ingress, replica=replica, policy=policy).inc()
        if self._hits is not None:
            # Created at the first routed request, so the series exists from 0 on.
            hits = self._hits.labels(ingress=self.ingress)
            if hit_blocks:
                hits.inc(hit_blocks)

    def forget(self, replica: str, policy: str) -> None:
        """Drop a departed replica's series (its id never comes back)."""
        if self._routed is not None:
            with contextlib.suppress(KeyError):  # older prometheus_client: never counted
                self._routed.remove(self.ingress, replica, policy)


def router_metrics() -> RouterMetrics:
    """The process's router counters (registered once; later calls find them).

    Deliberately no module-level cache: Serve pickles this module by value
    with the router class, and a cached Counter (it holds a lock) would make
    every later `RequestRouterConfig` in this process unpicklable.
    """
    return RouterMetrics()


def replica_key(replica_id: ReplicaID) -> str:
    """The replica's label in routing state and metrics."""
    return replica_id.unique_id


def request_of(pending_request: PendingRequest | None) -> Any:
    """The call's `ReplicaRequest` (duck-typed), or None for a call without one."""
    args = pending_request.args if pending_request is not None else None
    first = args[0] if args else None
    ids = getattr(first, "prompt_token_ids", None)
    if not isinstance(ids, Sequence) or isinstance(ids, str | bytes):
        return None
    return first


def count_of(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def prompt_of(pending_request: PendingRequest | None) -> tuple[Sequence[int], int]:
    """(prompt token ids, max_tokens) of a handle call, per the module's contract."""
    request = request_of(pending_request)
    if request is None:
        return (), 0
    max_tokens = count_of(getattr(request.params, "max_tokens", None))
    return request.prompt_token_ids, max_tokens if max_tokens and max_tokens > 0 else 0


def cache_salt_of(pending_request: PendingRequest | None) -> str | None:
    """The call's `cache_salt` (a str), or None."""
    salt = getattr(request_of(pending_request), "cache_salt", None)
    return salt if isinstance(salt, str) else None


def samples_of(pending_request: PendingRequest | None) -> int:
    """The sequences the engine generates for a handle call: `best_of` if set (it is at
    least n), else `n`, else 1."""
    request = request_of(pending_request)
    if request is None:
        return 1
    for name in ("best_of", "n"):
        value = count_of(getattr(request.params, name, None))
        if value is not None and value >= 1:
            return value
    return 1


def carries_prompt(pending_request: PendingRequest | None) -> bool:
    """A generation request: the others (engine info, health) are neither counted
    nor reserved for."""
    return bool(prompt_of(pending_request)[0])


class CountsRoutes:
    """The routing metrics of every pagefleet router, and forgetting the replicas Serve
    no longer offers (mixed in before Serve's router class)."""

    policy_name = ""

    def _init_metrics(self) -> None:
        self._metrics = router_metrics()
        self._counted: set[str] = set()  # replicas with a routed_requests series here

    def _count(self, replica: str, hit_blocks: int = 0) -> None:
        self._metrics.routed(replica, self.policy_name, hit_blocks)
        self._counted.add(replica)

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult
    ) -> None:
        if carries_prompt(pending_request):
            self._count(replica_key(replica_id))

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)  # type: ignore[misc]
        live = {replica_key(r.replica_id) for r in replicas}
        offered(live)  # the ingress hands off a leaver's streams (`migration.py`)
        self.retain_replicas(live)

    def retain_replicas(self, live: set[str]) -> None:
        """Forget every replica not in `live` (module docstring: Replicas that leave)."""
        for gone in self._counted - live:
            self._metrics.forget(gone, self.policy_name)
        self._counted &= live
