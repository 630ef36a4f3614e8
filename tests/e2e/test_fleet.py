"""Two engine replicas behind one endpoint (`pagefleet serve`, real Ray Serve): the
most-free-blocks router's prefix affinity, and bursts that spread.

Not here yet (issue 8 stays open): the skewed-load check (a long request on one replica,
then short ones must go to the other). Run against Serve 2.60 it failed: all six short
requests went to the busy replica, and the router's choose_replicas was not called for
them at all (a debug log saw only the long request's decision), so Serve assigned them
through a path that bypasses the custom router. To be understood before it is asserted.
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


def prefix_hit_blocks(served: Served) -> float:
    text = httpx.get(f"{served.url}/metrics", timeout=30).text
    return sum(
        s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == "pagefleet:router_prefix_hit_blocks_total"
    )


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


def test_shared_prefix_goes_to_the_replica_holding_it(fleet: Served) -> None:
    wait_idle(fleet)
    system = list(range(100, 100 + 12 * 8))  # 12 full blocks of token ids
    before = routed(fleet)
    hits0 = prefix_hit_blocks(fleet)
    complete(fleet, [*system, 7, 8, 9], 2)
    first = delta(before, routed(fleet))
    holder = next(k for k, v in first.items() if v == 1)
    time.sleep(1.2)  # two stats periods: the holder's digest now has the prefix
    mid = routed(fleet)
    for q in range(5):
        complete(fleet, [*system, 20 + q, 30 + q], 2)
    after = delta(mid, routed(fleet))
    assert after.get(holder, 0.0) == 5.0, after
    assert prefix_hit_blocks(fleet) - hits0 >= 5 * 12
    wait_idle(fleet)


def test_a_burst_spreads_over_both_replicas(fleet: Served) -> None:
    wait_idle(fleet)
    time.sleep(1.2)
    before = routed(fleet)
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda i: complete(fleet, f"y{i}", 8), range(16)))
    spread = delta(before, routed(fleet))
    assert sum(spread.values()) == 16
    assert len(spread) == 2 and min(spread.values()) >= 4, spread
    wait_idle(fleet)


def test_fleet_stops_cleanly(fleet: Served, tmp_path: Path) -> None:
    stop_served(fleet)
