"""Two engine replicas behind one endpoint (`pagefleet serve`, real Ray Serve, the
most-free-blocks router): both serve, the router counts every request, blocks balance.

Not asserted yet (issue 8 stays open): where the router sends requests. Against Serve
2.60 the per-replica counts did not follow the policy in three checks (skewed load,
shared prefix): all requests of a check went to one replica, and a debug log showed
choose_replicas called for only some of them. Until that is understood, routing
decisions are tested on the pure policy (tests/cluster/test_routing.py) and the
adapter with fakes (tests/cluster/test_router.py).
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.cluster.test_api import free_port
from tests.e2e.test_serve import Served, start_served, stop_served

BLOCKS = 160
ENGINE = {
    "num_kv_blocks": BLOCKS,
    "block_size": 8,
    "max_num_seqs": 32,
    "max_model_len": 1024,
    "num_threads": 1,
}

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def fleet(llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    cfg = tmp_path_factory.mktemp("fleet") / "fleet.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "model": llama_dir,
                "served_model_name": "tiny",
                "port": free_port(),
                "replicas": 2,
                "replica_resources": {"num_cpus": 0.5},
                "routing": "most_free_blocks",
                "routing_stats_period_s": 0.5,
                "engine": ENGINE,
            }
        )
    )
    served = start_served(cfg)
    try:
        yield served
    finally:
        stop_served(served)


def routed(served: Served) -> dict[str, float]:
    text = httpx.get(f"{served.url}/metrics", timeout=30).text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "pagefleet:routed_requests_total":
                out[s.labels["replica"]] = out.get(s.labels["replica"], 0.0) + s.value
    return out


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}


def complete(served: Served, prompt: str | list[int], max_tokens: int) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    r = httpx.post(f"{served.url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def wait_idle(served: Served) -> None:
    deadline = time.monotonic() + 60
    while True:
        m = served.scrape()
        if (
            sum(m["vllm:num_requests_running"].values()) == 0
            and m["pagefleet:kv_blocks_free"] == m["pagefleet:kv_blocks_total"]
        ):
            return
        assert time.monotonic() < deadline, f"not idle: {m}"
        time.sleep(0.3)


def test_two_replicas_report(fleet: Served) -> None:
    deadline = time.monotonic() + 60
    while len(fleet.scrape().get("pagefleet:kv_blocks_total", {})) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.5)
    assert set(fleet.scrape()["pagefleet:kv_blocks_total"].values()) == {BLOCKS}


def test_a_burst_over_two_replicas_is_served_and_balances(fleet: Served) -> None:
    complete(fleet, "warm", 2)  # the ingress's first call (engine info) is routed too
    wait_idle(fleet)
    before = routed(fleet)
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda i: complete(fleet, f"y{i}", 8), range(16)))
    assert [r["usage"]["completion_tokens"] for r in results] == [8] * 16
    assert sum(delta(before, routed(fleet)).values()) == 16  # the router counted each
    wait_idle(fleet)  # both replicas: nothing running, every block free
    assert set(fleet.scrape()["pagefleet:kv_blocks_free"].values()) == {BLOCKS}


def test_fleet_stops_cleanly(fleet: Served, tmp_path: Path) -> None:
    stop_served(fleet)
