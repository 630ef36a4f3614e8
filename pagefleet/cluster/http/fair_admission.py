"""The fair queue at the ingress: where a request waits while the fleet is saturated.

`FairAdmission` is an `EngineBackend` over another one. Each engine request goes through
`FairQueue` (`pagefleet/cluster/fairness.py`: the order, the counters, what saturated
means) before it reaches the inner backend: with a slot free and nobody waiting it
passes at once, as it would without the queue; otherwise it waits here until the queue
hands it a slot, or is refused with a 429 when its tenant already has
`max_queued_per_tenant` waiting (or the queue its bound in all: the server's
at-capacity 429). Its slot is freed when its stream ends, however it ends;
a request that leaves while waiting (its client went away, its deadline passed) leaves
the queue. Prompt tokens are charged to its tenant as it leaves the queue, output tokens
as its deltas come.

The tenant (`TenantTagger`, an ASGI middleware in front of the routes): the value of the
configured header (`fairness.tenant_header`) when the request carries it, else a short
hash of its bearer token (`key-` and 12 hex digits: never the key itself), else
`anonymous`. The capacity is asked of `capacity` at most every `CAPACITY_PERIOD_S`: as
requests come, and while any wait (a fleet that grows lets them through without waiting
for the next arrival or end). A capacity of 0 holds every request.

Metrics (`pagefleet:` names, labels ingress and tenant): `tenant_queue_depth` (waiting
now), `tenant_queue_time_seconds` (from arrival in the queue to leaving it, for the
requests that waited) and `tenant_rejected_requests` (refused at the cap).
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NamedTuple

from ..config import FairnessSettings
from ..fairness import FairQueue, Refused, Waiting
from ..replica_messages import EngineInfo, ReplicaRequest, RequestDelta
from .backend import EngineBackend
from .errors import RETRY_AFTER_S, APIError, overloaded

logger = logging.getLogger("pagefleet.http")

CAPACITY_PERIOD_S = 1.0
UNKNOWN_CAPACITY = 1 << 30
ANONYMOUS = "anonymous"
MAX_TENANT_CHARS = 64
QUEUE_DEPTH = "pagefleet:tenant_queue_depth"
QUEUE_TIME = "pagefleet:tenant_queue_time_seconds"
REJECTED = "pagefleet:tenant_rejected_requests"
QUEUE_TIME_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class Slots(NamedTuple):
    """The queue's capacity (`fairness.py` says what it means) and the most requests it
    may hold waiting (None: no bound)."""

    in_flight: int
    waiting: int | None = None


# Where the queue asks its `Slots`, every CAPACITY_PERIOD_S while requests come.
Capacity = Callable[[], Awaitable[Slots]]

_tenant: contextvars.ContextVar[str] = contextvars.ContextVar("pagefleet_tenant", default=ANONYMOUS)


def key_tenant(token: str) -> str:
    """The tenant id of an API key: a short hash, never the key."""
    return "key-" + hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()[:12]


def tenant_of(headers: list[tuple[bytes, bytes]], header: str | None) -> str:
    """The request's tenant (module docstring) from its raw ASGI headers."""
    wanted = header.lower().encode("latin-1") if header else None
    token = None
    for name, value in headers:
        if name == wanted and value.strip():
            return value.decode("latin-1").strip()[:MAX_TENANT_CHARS]
        if name == b"authorization":
            scheme, _, rest = value.decode("latin-1").partition(" ")
            token = rest.strip() if scheme.lower() == "bearer" and rest.strip() else token
    return key_tenant(token) if token else ANONYMOUS


class TenantTagger:
    """Pure ASGI middleware: names the request's tenant for the queue (`tenant_of`)."""

    def __init__(self, app: Any, header: str | None) -> None:
        self.app = app
        self._header = header

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            _tenant.set(tenant_of(scope.get("headers", []), self._header))
        await self.app(scope, receive, send)


def _queue_full(refused: Refused) -> APIError:
    if refused.full:
        return overloaded()
    return APIError(
        429,
        f"tenant {refused.tenant} has {refused.limit} requests queued, the limit of its queue "
        f"(fairness.max_queued_per_tenant) while the fleet is saturated; retry after "
        f"{RETRY_AFTER_S} s",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


class _Metrics:
    """The queue's series in prometheus-client's default registry (shared per process)."""

    def __init__(self, ingress: str) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        from ..metrics import registered

        labels = ("ingress", "tenant")
        self.depth = registered(
            Gauge, QUEUE_DEPTH, "Requests waiting in the ingress's fair queue, by tenant.", labels
        )
        self.time = registered(
            Histogram,
            QUEUE_TIME,
            "Seconds a request waited in the ingress's fair queue, by tenant.",
            labels,
            buckets=QUEUE_TIME_BUCKETS,
        )
        self.rejected = registered(
            Counter, REJECTED, "Requests refused because their tenant's queue was full.", labels
        )
        self.ingress = ingress

    def depth_of(self, tenant: str, queued: int) -> None:
        self.depth.labels(ingress=self.ingress, tenant=tenant).set(queued)

    def waited(self, tenant: str, seconds: float) -> None:
        self.time.labels(ingress=self.ingress, tenant=tenant).observe(seconds)

    def refused(self, tenant: str) -> None:
        self.rejected.labels(ingress=self.ingress, tenant=tenant).inc()


class FairAdmission:
    """`EngineBackend` over `backend` with the fair queue in front (module docstring)."""

    def __init__(
        self,
        backend: EngineBackend,
        settings: FairnessSettings,
        capacity: Capacity,
        ingress: str = "local",
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.backend = backend
        self.settings = settings
        self._capacity = capacity
        self._clock = clock or (lambda: asyncio.get_running_loop().time())
        # Until the capacity is first read, no bound: requests pass as without the queue.
        self.queue = FairQueue(
            capacity=UNKNOWN_CAPACITY,
            max_queued_per_tenant=settings.max_queued_per_tenant,
            prompt_weight=settings.prompt_token_weight,
            output_weight=settings.output_token_weight,
            clock=self._clock,
        )
        self._waiters: dict[object, asyncio.Future[None]] = {}
        self._capacity_asked = -1e9
        self._watcher: asyncio.Future[None] | None = None
        self._metrics = _Metrics(ingress)

    async def info(self) -> EngineInfo:
        return await self.backend.info()

    async def metric_snapshots(self) -> list[list[Any]]:
        return await self.backend.metric_snapshots()

    async def healthy(self) -> bool:
        return await self.backend.healthy()

    async def generate(self, request: ReplicaRequest) -> AsyncIterator[RequestDelta]:
        tenant = _tenant.get()
        await self._refresh_capacity()
        await self._enter(tenant, request)
        try:
            async for delta in self.backend.generate(request):
                self.queue.charge(tenant, sum(len(s.token_ids) for s in delta.samples))
                yield delta
        finally:
            self._wake(self.queue.release(tenant))

    async def _enter(self, tenant: str, request: ReplicaRequest) -> None:
        """Return once the request holds a slot; a 429 if its tenant's queue is full."""
        ticket = object()
        placed = self.queue.arrive(
            ticket, tenant, request.params.priority, len(request.prompt_token_ids)
        )
        if isinstance(placed, Refused):
            self._metrics.refused(tenant)
            raise _queue_full(placed)
        if placed is None:
            return
        self._waiters[ticket] = asyncio.get_running_loop().create_future()
        self._metrics.depth_of(tenant, self.queue.queued(tenant))
        self._watch_capacity()
        try:
            await self._waiters[ticket]
        except BaseException:
            self._waiters.pop(ticket, None)
            if self.queue.cancel(ticket):
                self._metrics.depth_of(tenant, self.queue.queued(tenant))
            else:  # the slot was handed over as it left: give it on
                self._wake(self.queue.release(tenant))
            raise
        self._metrics.waited(tenant, self._clock() - placed.arrived)

    def _wake(self, leaving: list[Waiting]) -> None:
        for w in leaving:
            self._metrics.depth_of(w.tenant, self.queue.queued(w.tenant))
            future = self._waiters.pop(w.ticket)
            if not future.done():
                future.set_result(None)

    def _watch_capacity(self) -> None:
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.ensure_future(self._refresh_while_waiting())

    async def _refresh_while_waiting(self) -> None:
        while self.queue.waiting:
            await asyncio.sleep(CAPACITY_PERIOD_S)
            await self._refresh_capacity()

    async def _refresh_capacity(self) -> None:
        now = self._clock()
        if now - self._capacity_asked < CAPACITY_PERIOD_S:
            return
        self._capacity_asked = now
        try:
            slots = await self._capacity()
        except Exception:  # the controller restarts with Serve: keep the last capacity
            logger.warning("could not read the fleet's capacity", exc_info=True)
            return
        self._wake(self.queue.set_capacity(max(0, slots.in_flight), slots.waiting))
