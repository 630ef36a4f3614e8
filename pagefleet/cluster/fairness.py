"""Per-tenant fair queuing at the ingress, only while the fleet is saturated.

One decision, written once: `FairQueue` is a pure object over explicit state (the slots
in flight, the waiting requests, each tenant's virtual token counter) with an injected
clock. The ingress drives it through `http/fair_admission.py`; the lab's simulator drives
the same object (`pagefleet_lab.sim.fairness`).

Saturation. The queue has `capacity` slots: engine requests it lets through that have not
ended (one slot each, whatever its `n`). A request arriving while a slot is free and nobody waits takes a slot and passes
straight through, as if there were no queue (the counters are still kept). Otherwise the
fleet is saturated and the request waits here. The ingress sets the capacity from what it
knows: `fairness.max_in_flight` when given, else `engine.max_num_seqs` plus a few ready
requests (`fairness.ready_per_replica`) times the engine replicas running (Serve's
controller; the configured count until it answers), divided among the ingress replicas.
Every slot full means every replica's batch is full and its next requests are ready:
what would enter the engines now would only wait in their queues, first come, first
served.

Order among the waiting (a request leaves when a slot frees, `release`):

1. Priority band: the lowest `priority` value first (vLLM's meaning: lower is sooner).
2. Tenant: within the band, the tenant whose virtual token counter is least (ties: the
   tenant whose head request came first).
3. Arrival: a tenant's requests in a band leave in the order they came.

Virtual token counters (the Virtual Token Counter of Sheng et al., "Fairness in Serving
Large Language Models", OSDI 2024): a tenant's counter grows by `prompt_weight` per prompt
token when its request leaves the queue and by `output_weight` per output token as it is
served (`charge`). A tenant that becomes active (nothing queued or in flight before) has
its counter lifted to the least counter among the active tenants, so an idle tenant
cannot bank credit and a new one does not start at zero. An inactive tenant whose counter
is at or below that floor is forgotten (it would be lifted anyway).

Caps: a tenant holds at most `max_queued_per_tenant` waiting requests, and the queue at
most `max_waiting` in all (None: no bound); one more is refused (`Refused`), never
queued.

Invariants: `in_flight <= capacity` except when the capacity is lowered under it (no
slot is taken back; new ones wait); a request is queued only while every slot is taken
or someone already waits; `release` hands out exactly the freed slots.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Refused:
    """A request the queue will not hold: its tenant has `limit` waiting already, or
    (`full`) the queue holds its `max_waiting` requests."""

    tenant: str
    limit: int
    full: bool = False


@dataclass
class Waiting:
    """A queued request: its ticket (the caller's key), tenant, band and arrival."""

    ticket: Hashable
    tenant: str
    priority: int
    prompt_tokens: int
    arrived: float
    order: int = 0


@dataclass
class _Tenant:
    counter: float = 0.0
    queued: int = 0
    in_flight: int = 0

    @property
    def active(self) -> bool:
        return self.queued > 0 or self.in_flight > 0


@dataclass
class FairQueue:
    """The fair queue's state and decisions (module docstring)."""

    capacity: int
    max_queued_per_tenant: int
    prompt_weight: float = 1.0
    output_weight: float = 2.0
    clock: Callable[[], float] = field(default=lambda: 0.0, repr=False)
    max_waiting: int | None = None
    in_flight: int = 0
    _tenants: dict[str, _Tenant] = field(default_factory=dict, repr=False)
    # band -> tenant -> its waiting requests of that band, in arrival order
    _bands: dict[int, dict[str, collections.deque[Waiting]]] = field(
        default_factory=dict, repr=False
    )
    _tickets: dict[Hashable, Waiting] = field(default_factory=dict, repr=False)
    _order: itertools.count[int] = field(default_factory=itertools.count, repr=False)

    @property
    def waiting(self) -> int:
        return len(self._tickets)

    @property
    def saturated(self) -> bool:
        return self.in_flight >= self.capacity or bool(self._tickets)

    def counter(self, tenant: str) -> float:
        t = self._tenants.get(tenant)
        return 0.0 if t is None else t.counter

    def queued(self, tenant: str) -> int:
        t = self._tenants.get(tenant)
        return 0 if t is None else t.queued

    def queued_by_tenant(self) -> dict[str, int]:
        return {name: t.queued for name, t in self._tenants.items() if t.queued}

    def arrive(
        self, ticket: Hashable, tenant: str, priority: int = 0, prompt_tokens: int = 0
    ) -> Waiting | Refused | None:
        """A request comes: None when it passes now (a slot is its), its `Waiting` when it
        queues, `Refused` when its tenant's queue is full."""
        if not self.saturated:
            self._activate(tenant)
            self._take_slot(tenant, prompt_tokens)
            return None
        if self.max_waiting is not None and self.waiting >= self.max_waiting:
            return Refused(tenant, self.max_waiting, full=True)
        if self.queued(tenant) >= self.max_queued_per_tenant:
            return Refused(tenant, self.max_queued_per_tenant)
        self._activate(tenant)
        w = Waiting(ticket, tenant, priority, prompt_tokens, self.clock(), next(self._order))
        self._bands.setdefault(priority, {}).setdefault(tenant, collections.deque()).append(w)
        self._tickets[ticket] = w
        self._tenants[tenant].queued += 1
        return w

    def release(self, tenant: str) -> list[Waiting]:
        """A passed request of `tenant` ended: its slot frees; the requests that leave the
        queue now, in order (each holds a slot)."""
        self.in_flight -= 1
        t = self._tenants[tenant]
        t.in_flight -= 1
        self._forget_if_idle(tenant)
        return self.dispatch()

    def cancel(self, ticket: Hashable) -> bool:
        """A queued request leaves without being served (its client went away, its
        deadline passed); False if it is not waiting."""
        w = self._tickets.pop(ticket, None)
        if w is None:
            return False
        tenants = self._bands[w.priority]
        tenants[w.tenant].remove(w)
        self._drop_empty(w.priority, w.tenant)
        self._tenants[w.tenant].queued -= 1
        self._forget_if_idle(w.tenant)
        return True

    def charge(self, tenant: str, output_tokens: int) -> None:
        """`output_tokens` more were served to `tenant`."""
        t = self._tenants.get(tenant)
        if t is not None:
            t.counter += self.output_weight * output_tokens

    def set_capacity(self, capacity: int, max_waiting: int | None = None) -> list[Waiting]:
        """The fleet's slots (and the bound on waiting) changed; the requests that leave
        the queue now. Nobody already waiting is refused by a lower bound."""
        self.capacity = capacity
        self.max_waiting = max_waiting
        return self.dispatch()

    def dispatch(self) -> list[Waiting]:
        """While a slot is free, the next waiting request takes it (module docstring)."""
        out: list[Waiting] = []
        while self.in_flight < self.capacity and self._tickets:
            w = self._next()
            out.append(w)
            self._leave(w)
        return out

    def _next(self) -> Waiting:
        tenants = self._bands[min(self._bands)]
        name = min(tenants, key=lambda n: (self._tenants[n].counter, tenants[n][0].order))
        return tenants[name][0]

    def _leave(self, w: Waiting) -> None:
        self._bands[w.priority][w.tenant].popleft()
        self._drop_empty(w.priority, w.tenant)
        del self._tickets[w.ticket]
        self._tenants[w.tenant].queued -= 1
        self._take_slot(w.tenant, w.prompt_tokens)

    def _take_slot(self, tenant: str, prompt_tokens: int) -> None:
        t = self._tenants[tenant]
        t.in_flight += 1
        t.counter += self.prompt_weight * prompt_tokens
        self.in_flight += 1

    def _drop_empty(self, band: int, tenant: str) -> None:
        tenants = self._bands[band]
        if not tenants[tenant]:
            del tenants[tenant]
        if not tenants:
            del self._bands[band]

    def _floor(self, besides: str) -> float | None:
        """The least counter among active tenants other than `besides` (None: none)."""
        counters = [t.counter for n, t in self._tenants.items() if t.active and n != besides]
        return min(counters, default=None)

    def _activate(self, tenant: str) -> None:
        """`tenant` has a request: if it was inactive, its counter is lifted to the floor."""
        t = self._tenants.setdefault(tenant, _Tenant())
        if t.active:
            return
        floor = self._floor(tenant)
        if floor is not None:
            t.counter = max(t.counter, floor)

    def _forget_if_idle(self, tenant: str) -> None:
        t = self._tenants[tenant]
        if t.active:
            return
        floor = self._floor(tenant)
        if floor is None or t.counter <= floor:
            del self._tenants[tenant]
