"""The fair queue's decisions (`pagefleet.cluster.fairness.FairQueue`), exactly, with an
injected clock: pass-through while there is room, priority bands, virtual token counters
(and their lift on arrival), the per-tenant cap, cancellation and capacity changes."""

from __future__ import annotations

from pagefleet.cluster.fairness import FairQueue, Refused, Waiting


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def queue(capacity: int = 1, cap: int = 8, clock: Clock | None = None) -> FairQueue:
    return FairQueue(capacity, cap, prompt_weight=1.0, output_weight=2.0, clock=clock or Clock())


def tickets(leaving: list[Waiting]) -> list[object]:
    return [w.ticket for w in leaving]


def drain(q: FairQueue, tenant_of: dict[object, str], first: str) -> list[object]:
    """Release one request at a time (its tenant's), starting with a running one of
    `first`, until nobody waits: the order the queue hands out slots."""
    order: list[object] = []
    running = first
    while q.waiting:
        (w,) = q.release(running)
        order.append(w.ticket)
        running = tenant_of[w.ticket]
    return order


def test_passes_straight_through_while_there_is_room() -> None:
    q = queue(capacity=3)
    assert [q.arrive(i, "a", priority=5) for i in range(3)] == [None, None, None]
    assert q.in_flight == 3 and q.waiting == 0 and q.saturated
    placed = q.arrive(3, "a")
    assert isinstance(placed, Waiting) and q.waiting == 1
    assert tickets(q.release("a")) == [3]
    assert q.in_flight == 3 and q.waiting == 0


def test_a_request_queues_behind_waiting_ones_even_with_a_free_slot() -> None:
    q = queue(capacity=1)
    assert q.arrive("r", "a") is None
    assert isinstance(q.arrive("w1", "a"), Waiting)
    q.capacity = 2  # a slot frees without a dispatch yet: nobody jumps the queue
    assert isinstance(q.arrive("w2", "b"), Waiting)
    assert tickets(q.dispatch()) == ["w1"]


def test_lower_priority_value_leaves_first_then_arrival_within_a_tenant() -> None:
    q = queue(capacity=1)
    q.arrive("running", "a")
    for ticket, priority in (("low-1", 5), ("low-2", 5), ("urgent", -1), ("mid", 0)):
        assert isinstance(q.arrive(ticket, "a", priority=priority), Waiting)
    assert drain(q, dict.fromkeys(["low-1", "low-2", "urgent", "mid"], "a"), "a") == [
        "urgent",
        "mid",
        "low-1",
        "low-2",
    ]


def test_priority_band_beats_a_lighter_tenant() -> None:
    q = queue(capacity=1)
    q.arrive("running", "heavy", prompt_tokens=1000)
    q.arrive("light-low", "light", priority=1)
    q.arrive("heavy-urgent", "heavy", priority=0)
    assert tickets(q.release("heavy")) == ["heavy-urgent"]
    assert tickets(q.release("heavy")) == ["light-low"]


def test_the_tenant_with_fewer_virtual_tokens_goes_first() -> None:
    q = queue(capacity=1)
    q.arrive("h0", "heavy", prompt_tokens=100)
    for i in range(1, 4):
        q.arrive(f"h{i}", "heavy", prompt_tokens=100)
    for i in range(2):
        q.arrive(f"l{i}", "light", prompt_tokens=10)
    # light was lifted to heavy's counter (100) when it arrived: a tie, which heavy's
    # earlier head wins; then each request of light's adds 10, each of heavy's 100.
    assert q.counter("light") == 100.0
    owners = {f"h{i}": "heavy" for i in range(4)} | {f"l{i}": "light" for i in range(2)}
    assert drain(q, owners, "heavy") == ["h1", "l0", "l1", "h2", "h3"]
    assert q.counter("heavy") == 400.0
    # light is idle now at 120, below the floor (heavy's 400): forgotten, as it would be
    # lifted to the floor on its return anyway.
    assert q.counter("light") == 0.0


def test_output_tokens_are_charged_with_their_weight() -> None:
    q = queue(capacity=2)
    q.arrive("a0", "a", prompt_tokens=10)
    q.arrive("b0", "b", prompt_tokens=10)
    q.charge("a", 50)  # a's request has been served 50 tokens, b's none
    # b came while a was active: lifted to a's 10 before its own prompt.
    assert (q.counter("a"), q.counter("b")) == (110.0, 20.0)
    q.arrive("a1", "a", prompt_tokens=1)
    q.arrive("b1", "b", prompt_tokens=1)
    assert tickets(q.release("a")) == ["b1"]


def test_ties_go_to_the_tenant_whose_head_came_first() -> None:
    q = queue(capacity=1)
    q.arrive("run", "x")
    q.arrive("b", "b")
    q.arrive("a", "a")
    assert q.counter("a") == q.counter("b") == 0.0
    assert tickets(q.release("x")) == ["b"]


def test_an_idle_tenant_cannot_bank_credit() -> None:
    q = queue(capacity=1)
    q.arrive("h0", "heavy", prompt_tokens=500)
    q.arrive("h1", "heavy", prompt_tokens=500)
    # "idle" had no request all along: it comes in at heavy's counter, not at 0.
    q.arrive("i0", "idle", prompt_tokens=1)
    assert q.counter("idle") == q.counter("heavy") == 500.0
    assert tickets(q.release("heavy")) == ["h1"]  # tie at 500: heavy's head came first
    assert tickets(q.release("heavy")) == ["i0"]


def test_a_returning_tenant_keeps_a_larger_counter() -> None:
    q = queue(capacity=2)
    q.arrive("a0", "a", prompt_tokens=10)
    q.arrive("b0", "b", prompt_tokens=10)
    q.charge("a", 500)
    q.release("a")  # a goes idle above the floor (b's 20): its counter is kept
    assert (q.counter("a"), q.counter("b")) == (1010.0, 20.0)
    assert q.arrive("a1", "a", prompt_tokens=1) is None
    assert q.counter("a") == 1011.0
    assert isinstance(q.arrive("a2", "a"), Waiting)
    assert isinstance(q.arrive("b1", "b"), Waiting)
    assert tickets(q.release("a")) == ["b1"]


def test_per_tenant_cap_refuses_only_that_tenant() -> None:
    q = queue(capacity=1, cap=2)
    q.arrive("r", "a")
    assert isinstance(q.arrive("a1", "a"), Waiting)
    assert isinstance(q.arrive("a2", "a"), Waiting)
    assert q.arrive("a3", "a") == Refused("a", 2)
    assert isinstance(q.arrive("b1", "b"), Waiting)
    assert q.queued_by_tenant() == {"a": 2, "b": 1}
    # Room for one more of a once one of its own leaves.
    q.release("a")
    assert q.queued_by_tenant() == {"a": 1, "b": 1}  # a tie at 0: a1 came first
    assert isinstance(q.arrive("a4", "a"), Waiting)


def test_the_queue_holds_at_most_max_waiting_in_all() -> None:
    q = queue(capacity=1)
    assert q.set_capacity(1, max_waiting=2) == []
    q.arrive("r", "a")
    q.arrive("a1", "a")
    q.arrive("b1", "b")
    assert q.arrive("c1", "c") == Refused("c", 2, full=True)
    assert q.queued_by_tenant() == {"a": 1, "b": 1}
    q.release("a")
    assert isinstance(q.arrive("c1", "c"), Waiting)


def test_cancel_removes_a_waiting_request_only() -> None:
    q = queue(capacity=1)
    q.arrive("r", "a")
    q.arrive("w1", "a")
    q.arrive("w2", "b")
    assert q.cancel("w1") is True
    assert q.cancel("w1") is False
    assert q.cancel("r") is False  # passed already: it is released, not cancelled
    assert tickets(q.release("a")) == ["w2"]
    assert q.waiting == 0 and q.in_flight == 1


def test_capacity_changes_dispatch_in_order() -> None:
    q = queue(capacity=1)
    q.arrive("r", "a")
    q.arrive("x", "a", priority=3)
    q.arrive("y", "b", priority=1)
    q.arrive("z", "c", priority=2)
    assert tickets(q.set_capacity(3)) == ["y", "z"]
    assert q.in_flight == 3
    assert q.set_capacity(1) == []  # nothing is taken back
    assert q.release("b") == [] and q.release("c") == []
    assert tickets(q.release("a")) == ["x"]


def test_queued_time_uses_the_injected_clock() -> None:
    clock = Clock()
    q = queue(capacity=1, clock=clock)
    q.arrive("r", "a")
    clock.now = 7.5
    placed = q.arrive("w", "b")
    assert isinstance(placed, Waiting) and placed.arrived == 7.5


def test_idle_tenants_at_the_floor_are_forgotten() -> None:
    q = queue(capacity=2)
    q.arrive("a0", "a", prompt_tokens=5)
    q.arrive("b0", "b", prompt_tokens=50)
    q.release("a")  # a (5) is below b's 50: it would be lifted anyway
    assert q.counter("a") == 0.0 and "a" not in q.queued_by_tenant()
    q.release("b")  # nobody active: b is forgotten too
    assert q.counter("b") == 0.0
    assert q.in_flight == 0 and q.waiting == 0


def test_serve_capacity_is_the_batch_slots_shared_by_the_ingresses() -> None:
    from pagefleet.cluster.config import ServeConfig
    from pagefleet.cluster.fair_capacity import capacity_of
    from pagefleet.cluster.http.fair_admission import Slots

    config = ServeConfig.model_validate(
        {
            "model": "m",
            "replicas": 2,
            "ingress_replicas": 2,
            "max_waiting_requests": 10,
            "max_queued_requests": 5,
            "engine": {"max_num_seqs": 8},
            "fairness": {"enabled": True, "ready_per_replica": 2},
        }
    )
    # (8 + 2) x 3 running / 2 ingresses; waiting: 10 per replica at the fleet's largest,
    # plus 5.
    assert capacity_of(config, 3) == Slots(15, 25)
    fixed = config.model_copy(
        update={"fairness": config.fairness.model_copy(update={"max_in_flight": 4})}
    )
    assert capacity_of(fixed, 3) == Slots(4, 25)


def test_serve_capacity_follows_a_live_change_of_the_fleet_bounds() -> None:
    import asyncio

    from pagefleet.cluster.config import ServeConfig
    from pagefleet.cluster.fair_capacity import ServeCapacity
    from pagefleet.cluster.fleet_state import FleetState
    from pagefleet.cluster.http.fair_admission import Slots
    from pagefleet.cluster.live_settings import with_user_config

    args = ServeConfig.model_validate(
        {
            "model": "m",
            "replicas": 2,
            "max_waiting_requests": 10,
            "max_queued_requests": 5,
            "engine": {"max_num_seqs": 8},
            "fairness": {"enabled": True, "ready_per_replica": 2},
        }
    )
    starting = FleetState(replicas={"STARTING": 4}, status="UPDATING")

    async def fleet_state() -> FleetState:
        return starting

    capacity = ServeCapacity(args, fleet_state)
    # None running yet: the configured count, 2 x (8 + 2); waiting 10 x 2 + 5.
    assert asyncio.run(capacity()) == Slots(20, 25)
    # `serve deploy` with 4 replicas changes the ingress's user_config alone.
    capacity.reconfigure(with_user_config(args, {"replicas": 4}))
    assert asyncio.run(capacity()) == Slots(40, 45)
