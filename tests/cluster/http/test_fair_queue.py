"""The ingress's fair queue over a real HTTP server (uvicorn) and an in-process engine
replica: high-priority requests overtake queued low-priority ones, a light tenant is not
starved by a heavy one, a full tenant queue is a 429 with Retry-After, and nothing
waits while the fleet has room. Orders and counts only, never timings.

The queue's capacity starts at 0, so every request waits until the test has queued them
all; then it is one request, so they leave one at a time, each when the one before has
finished: the order they finish in is the order the queue chose. Output tokens weigh 0
here, so the virtual token counters are the prompts' tokens alone and the order is
exact."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagefleet.cluster.config import FairnessSettings
from pagefleet.cluster.http.fair_admission import Slots, key_tenant, tenant_of
from tests.cluster.http.test_api import ENGINE, Harness, serving

HEADER = "x-tenant"
ENGINE_1 = {**ENGINE, "max_num_seqs": 1}


def _fairness(**over: Any) -> FairnessSettings:
    base = {"enabled": True, "tenant_header": HEADER}
    return FairnessSettings.model_validate({**base, "output_token_weight": 0.0, **over})


class Knob:
    """The queue's capacity, as the test sets it (asked every CAPACITY_PERIOD_S)."""

    def __init__(self) -> None:
        self.slots = 0

    async def __call__(self) -> Slots:
        return Slots(self.slots)


def _samples(h: Harness, name: str) -> dict[str, float]:
    """{tenant: value} of the ingress's series `name`."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(h.client.get("/metrics").text):
        for s in family.samples:
            if s.name == name:
                out[s.labels["tenant"]] = out.get(s.labels["tenant"], 0.0) + s.value
    return out


def _wait_queued(h: Harness, want: dict[str, int]) -> None:
    deadline = time.monotonic() + 60
    while True:
        depth = _samples(h, "pagefleet:tenant_queue_depth")
        if all(depth.get(t, 0) == n for t, n in want.items()):
            return
        assert time.monotonic() < deadline, f"queued {depth}, never {want}"
        time.sleep(0.01)


class Senders:
    """Requests sent from threads; `done` lists their names in the order they finished."""

    def __init__(self, h: Harness) -> None:
        self.h = h
        self.done: list[str] = []
        self.statuses: dict[str, int] = {}
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def send(self, name: str, tenant: str, priority: int = 0) -> None:
        body = {
            "model": "tiny",
            "prompt": "def run(self):",
            "max_tokens": 4,
            "temperature": 0,
            "ignore_eos": True,
            "priority": priority,
        }

        def post() -> None:
            with httpx.Client(base_url=self.h.url, timeout=None) as c:
                r = c.post("/v1/completions", json=body, headers={HEADER: tenant})
            with self._lock:
                self.statuses[name] = r.status_code
                if r.status_code == 200:
                    self.done.append(name)

        t = threading.Thread(target=post)
        t.start()
        self._threads.append(t)

    def join(self) -> None:
        for t in self._threads:
            t.join(120)


@pytest.fixture
def knob() -> Knob:
    return Knob()


@pytest.fixture
def fair(llama_dir: str, knob: Knob, request: pytest.FixtureRequest) -> Iterator[Harness]:
    settings = _fairness(**getattr(request, "param", {}))
    config = {"engine": {**ENGINE_1, "scheduling_policy": "priority"}}
    with serving(
        llama_dir, config, priority_scheduling=True, fairness=settings, fair_capacity=knob
    ) as h:
        yield h


def test_urgent_requests_overtake_queued_low_priority_ones(fair: Harness, knob: Knob) -> None:
    s = Senders(fair)
    for queued, (name, priority) in enumerate(
        (("low-1", 5), ("low-2", 5), ("urgent", -1), ("mid", 0)), start=1
    ):
        s.send(name, "p-tenant", priority=priority)
        _wait_queued(fair, {"p-tenant": queued})
    knob.slots = 1
    s.join()
    assert s.done == ["urgent", "mid", "low-1", "low-2"]


def test_a_light_tenant_is_not_starved_by_a_heavy_one(fair: Harness, knob: Knob) -> None:
    s = Senders(fair)
    for i in range(1, 7):
        s.send(f"h{i}", "heavy")
        _wait_queued(fair, {"heavy": i})
    for i in (1, 2):
        s.send(f"l{i}", "light")
        _wait_queued(fair, {"light": i})
    knob.slots = 1
    s.join()
    # First come, first served would be h1..h6, then l1, l2. light's counter is lifted to
    # heavy's (0) on arrival; each request adds its prompt as it leaves the queue; ties
    # go to the tenant whose head came first.
    assert s.done == ["h1", "l1", "h2", "l2", "h3", "h4", "h5", "h6"]
    waited = _samples(fair, "pagefleet:tenant_queue_time_seconds_count")
    assert (waited["heavy"], waited["light"]) == (6, 2)
    depth = _samples(fair, "pagefleet:tenant_queue_depth")
    assert (depth["heavy"], depth["light"]) == (0, 0)


@pytest.mark.parametrize("fair", [{"max_queued_per_tenant": 2}], indirect=True)
def test_a_full_tenant_queue_is_a_429_for_that_tenant_only(fair: Harness, knob: Knob) -> None:
    s = Senders(fair)
    for i in (1, 2):
        s.send(f"a{i}", "cap-a")
        _wait_queued(fair, {"cap-a": i})
    r = fair.client.post(
        "/v1/completions",
        json={"model": "tiny", "prompt": "hi", "max_tokens": 2},
        headers={HEADER: "cap-a"},
    )
    assert r.status_code == 429, r.text
    assert r.headers["Retry-After"] == "1"
    error = r.json()["error"]
    assert "tenant cap-a has 2 requests queued" in error["message"]
    assert "fairness.max_queued_per_tenant" in error["message"]
    s.send("b1", "cap-b")  # another tenant still queues
    _wait_queued(fair, {"cap-a": 2, "cap-b": 1})
    knob.slots = 1
    s.join()
    assert s.done == ["a1", "b1", "a2"]
    rejected = _samples(fair, "pagefleet:tenant_rejected_requests_total")
    assert (rejected["cap-a"], rejected.get("cap-b", 0)) == (1, 0)


def test_nothing_waits_while_the_fleet_has_room(llama_dir: str) -> None:
    async def room() -> Slots:
        return Slots(64)

    settings = _fairness()
    with serving(llama_dir, {"engine": ENGINE}, fairness=settings, fair_capacity=room) as h:
        s = Senders(h)
        for i in range(6):
            s.send(f"r{i}", "roomy")
        s.join()
        assert sorted(s.done) == [f"r{i}" for i in range(6)]
        assert "roomy" not in _samples(h, "pagefleet:tenant_queue_time_seconds_count")
        assert "roomy" not in _samples(h, "pagefleet:tenant_queue_depth")


def test_the_tenant_is_the_header_else_the_key_hash_else_anonymous() -> None:
    key = [(b"authorization", b"Bearer sk-secret")]
    assert tenant_of([(b"x-tenant", b" acme "), *key], HEADER) == "acme"
    assert tenant_of(key, HEADER) == key_tenant("sk-secret")
    assert tenant_of(key, None) == key_tenant("sk-secret")
    assert key_tenant("sk-secret").startswith("key-") and "secret" not in key_tenant("sk-secret")
    assert len(key_tenant("sk-secret")) == len("key-") + 12
    assert tenant_of([(b"x-tenant", b"")], HEADER) == "anonymous"
    assert tenant_of([], None) == "anonymous"
