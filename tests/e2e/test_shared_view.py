"""Two ingress replicas route as one (`routing/shared_view.py`), on real Serve: `pagefleet
serve` with 4 engine replicas of the tiny model and 2 ingress replicas, the
most-free-blocks router in each.

Routing stats are polled once at start and then not for 10 minutes, so between the two
routers only the shared view carries what each sent: without it each would see its own
sends only. Requests go through Serve's proxy, which picks the ingress (both take some:
`pagefleet:routed_requests{ingress}`), one every `PACE_S`, longer than the view's bound
(two exchange periods and a round trip of the hub). The pace is not asserted on.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from pagefleet.cluster.ingress import ROUTER_METRICS_PERIOD_S
from pagefleet.cluster.make_model import make_model
from tests.cluster.test_dashboard import port_in_range
from tests.e2e.served import start_served, stop_served
from tests.e2e.test_serve import Served

pytestmark = pytest.mark.e2e

PACE_S = 0.4
REPLICAS = 4
SYSTEM_TOKENS = 128  # 8 blocks of 16
QUESTION_TOKENS = 16
LONG = 16000  # output tokens of a burst's request: none ends while the burst is sent
BURST = 64  # requests: 16 per replica


@pytest.fixture(scope="module")
def fleet(model_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    model = model_root / "tiny-16k"
    if not (model / "model.safetensors").exists():
        make_model(model, "tiny", max_position_embeddings=16384)
    config = {
        "model": str(model),
        "served_model_name": "tiny",
        "port": port_in_range(),
        "replicas": REPLICAS,
        "ingress_replicas": 2,
        "replica_resources": {"num_cpus": 0.25},
        "routing": "most_free_blocks",
        "routing_stats_period_s": 600,
        "max_ongoing_requests": 64,
        "engine": {
            "num_kv_blocks": 1100,
            "block_size": 16,
            "max_num_seqs": 1,
            "max_model_len": 16384,
            "num_threads": 1,
        },
    }
    path = tmp_path_factory.mktemp("shared-view") / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    served = start_served(path, timeout_s=600)  # 6 replicas starting on a loaded machine
    try:
        yield served
    finally:
        stop_served(served)


def samples(served: Served, name: str) -> list[tuple[dict[str, str], float]]:
    text = httpx.get(f"{served.url}/metrics", timeout=30).text
    return [
        (s.labels, s.value)
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == name
    ]


def routed(served: Served) -> dict[tuple[str, str], float]:
    """(ingress, replica) -> requests routed there."""
    out: dict[tuple[str, str], float] = {}
    for labels, value in samples(served, "pagefleet:routed_requests_total"):
        key = (labels["ingress"], labels["replica"])
        out[key] = out.get(key, 0.0) + value
    return out


def fleet_total(served: Served, name: str) -> float:
    return sum(v for labels, v in samples(served, name) if labels.get("model_name") == "tiny")


def settled_routes(served: Served) -> dict[tuple[str, str], float]:
    """`routed` once every ingress has pushed what it routed: each pushes its counters to
    the hub every ROUTER_METRICS_PERIOD_S and a scrape reads the others' last push, so a
    count read too soon after a route may still miss it and a later one would add it."""
    deadline = time.monotonic() + 60
    last = routed(served)
    while True:
        time.sleep(ROUTER_METRICS_PERIOD_S + 0.5)
        now = routed(served)
        if now == last:
            return now
        assert time.monotonic() < deadline, f"routed counts still moving: {now}"
        last = now


def routed_since(served: Served, before: dict[tuple[str, str], float], n: int) -> dict:
    """The routes since `before`, once all `n` have reached /metrics (pushed to the hub)."""
    deadline = time.monotonic() + 60
    while True:
        after = routed(served)
        new = {k: v - before.get(k, 0.0) for k, v in after.items() if v > before.get(k, 0.0)}
        if sum(new.values()) >= n:
            return new
        assert time.monotonic() < deadline, f"routed {new}, expected {n}"
        time.sleep(0.5)


def wait_idle(served: Served) -> None:
    deadline = time.monotonic() + 120
    while True:
        m = served.scrape()
        if (
            sum(m["vllm:num_requests_running"].values()) == 0
            and sum(m.get("vllm:num_requests_waiting", {}).values()) == 0
            and m["pagefleet:kv_blocks_free"] == m["pagefleet:kv_blocks_total"]
        ):
            return
        assert time.monotonic() < deadline, f"not idle: {m}"
        time.sleep(0.5)


def by_replica(routes: dict[tuple[str, str], float]) -> dict[str, float]:
    out: dict[str, float] = {}
    for (_, replica), v in routes.items():
        out[replica] = out.get(replica, 0.0) + v
    return out


def test_both_routers_merge_each_other_s_view(fleet: Served) -> None:
    # Both ingresses route (the proxy spreads requests over them) and say they share (the
    # hub actor starts with the first exchange: a worker process, slow on a loaded node).
    deadline = time.monotonic() + 240
    while True:
        body = {"model": "tiny", "prompt": [7, 7, 7], "max_tokens": 1}
        assert httpx.post(f"{fleet.url}/v1/completions", json=body, timeout=60).status_code == 200
        shared = {
            labels["ingress"]: v for labels, v in samples(fleet, "pagefleet:router_shared_view")
        }
        if len(shared) == 2 and all(v == 1.0 for v in shared.values()):
            break
        assert time.monotonic() < deadline, f"pagefleet:router_shared_view: {shared}"
        time.sleep(PACE_S)


def test_a_shared_prefix_stays_on_one_owner_whichever_ingress_takes_it(fleet: Served) -> None:
    wait_idle(fleet)
    before = settled_routes(fleet)
    hits0 = fleet_total(fleet, "vllm:prefix_cache_hits_total")
    queries0 = fleet_total(fleet, "vllm:prefix_cache_queries_total")
    # The tiny model's vocabulary is 1,024 tokens.
    systems = [
        [k + 1] + [(37 * i + 101 * k) % 900 + 20 for i in range(SYSTEM_TOKENS - 1)]
        for k in range(4)
    ]
    n = 32
    for i in range(n):
        question = [50 + i * QUESTION_TOKENS + j for j in range(QUESTION_TOKENS)]
        body = {"model": "tiny", "prompt": systems[i % 4] + question, "max_tokens": 2}
        assert httpx.post(f"{fleet.url}/v1/completions", json=body, timeout=60).status_code == 200
        time.sleep(PACE_S)
    routes = routed_since(fleet, before, n)
    assert len({ingress for ingress, _ in routes}) == 2  # both ingresses took some
    wait_idle(fleet)
    hits = fleet_total(fleet, "vllm:prefix_cache_hits_total") - hits0
    queries = fleet_total(fleet, "vllm:prefix_cache_queries_total") - queries0
    # Each system prompt computed once in the fleet, every later request hitting all of it:
    # what one router does (the best any can).
    assert queries == n * (SYSTEM_TOKENS + QUESTION_TOKENS)
    assert hits == (n - 4) * SYSTEM_TOKENS
    assert hits / queries == pytest.approx(0.778, abs=0.001)


def test_a_burst_through_two_ingresses_spreads_evenly(fleet: Served) -> None:
    wait_idle(fleet)
    before = settled_routes(fleet)
    streams: list[httpx.Response] = []
    lock = threading.Lock()
    with contextlib.ExitStack() as stack:
        client = stack.enter_context(httpx.Client(timeout=120))
        for i in range(BURST):
            body = {
                "model": "tiny",
                "prompt": [300 + i] * 8,
                "max_tokens": LONG,
                "ignore_eos": True,
                "stream": True,
            }
            request = client.build_request("POST", f"{fleet.url}/v1/completions", json=body)

            def send(req: httpx.Request = request) -> None:
                response = client.send(req, stream=True)
                with lock:
                    streams.append(response)

            threading.Thread(target=send, daemon=True).start()
            time.sleep(PACE_S)
        routes = routed_since(fleet, before, BURST)
        deadline = time.monotonic() + 60
        while len(streams) < BURST:  # every stream's headers in
            assert time.monotonic() < deadline, f"{len(streams)} streams answered"
            time.sleep(0.2)
        for response in streams:
            assert response.status_code == 200
            stack.callback(response.close)  # the client leaves: the replicas abort them
    assert len({ingress for ingress, _ in routes}) == 2
    # Exactly as through one ingress: each of the 4 replicas a quarter of the burst.
    assert sorted(by_replica(routes).values()) == [BURST / REPLICAS] * REPLICAS
    wait_idle(fleet)
