"""The router's counters behind two ingress replicas (`pagefleet serve`, real Ray Serve,
`ingress_replicas: 2`): each ingress's /metrics shows its own counters and the other's
(through the metrics hub), so every series carries an `ingress` label. No series appears
twice in a scrape, none goes down between scrapes, and summed over the ingresses they
count every request once.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.cluster.test_api import free_port
from tests.e2e.served import Served, serving

pytestmark = pytest.mark.e2e

ROUTED = "pagefleet:routed_requests_total"
HITS = "pagefleet:router_prefix_hit_blocks_total"
# An ingress pushes its counters to the hub on Serve's health checks (every 10 s by default),
# so the other ingress's scrape may lag that long.
SETTLE_S = 45.0

Series = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture(scope="module")
def two_ingresses(llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    config = {
        "model": llama_dir,
        "served_model_name": "tiny",
        "port": free_port(),
        "replicas": 1,
        "ingress_replicas": 2,
        "replica_resources": {"num_cpus": 0.5},
        "routing_stats_period_s": 0.5,
        "engine": {
            "num_kv_blocks": 128,
            "block_size": 8,
            "max_num_seqs": 16,
            "max_model_len": 256,
            "num_threads": 1,
        },
    }
    with serving(config, tmp_path_factory.mktemp("ingress-metrics")) as served:
        yield served


def router_series(served: Served) -> Series:
    """The router's counter samples of one scrape; a series seen twice fails."""
    text = httpx.get(f"{served.url}/metrics", timeout=30).text
    out: Series = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in (ROUTED, HITS):
                key = (s.name, tuple(sorted(s.labels.items())))
                assert key not in out, f"{key} twice in one scrape"
                out[key] = s.value
    return out


def ingresses(series: Series) -> set[str]:
    return {dict(labels)["ingress"] for name, labels in series if name == ROUTED}


def routed_total(series: Series) -> float:
    return sum(v for (name, _), v in series.items() if name == ROUTED)


def complete(served: Served, i: int) -> None:
    body = {"model": "tiny", "prompt": [5, i % 97 + 3, 7, 9], "max_tokens": 4, "ignore_eos": True}
    r = httpx.post(f"{served.url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text


def test_router_counters_are_unique_and_monotonic_across_ingresses(
    two_ingresses: Served,
) -> None:
    sent = 0
    deadline = time.monotonic() + SETTLE_S
    last: Series = {}

    def scrape_forward() -> Series:
        """A scrape (whichever ingress serves it) in which no counter went down."""
        nonlocal last
        now = router_series(two_ingresses)
        fell = {k: (v, now[k]) for k, v in last.items() if k in now and now[k] < v}
        assert not fell, f"counters went down between two scrapes: {fell}"
        last = {**last, **now}
        return now

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        # Concurrent requests (the proxy spreads them over both ingresses), scraped while
        # they run (`router_series` fails on a series seen twice, `scrape_forward` on a
        # counter that went down), until the scrapes show both ingresses' series.
        while True:
            batch = [pool.submit(complete, two_ingresses, sent + k) for k in range(16)]
            sent += len(batch)
            while not all(f.done() for f in batch):
                scrape_forward()
                time.sleep(0.2)
            for f in batch:
                f.result()
            seen = ingresses(scrape_forward())
            if len(seen) == 2:
                break
            assert time.monotonic() < deadline, f"one ingress only after {sent} requests"
            time.sleep(1.0)
    # Quiet now: once every ingress's last push has reached the hub, the totals add up.
    deadline = time.monotonic() + SETTLE_S
    while routed_total(first := scrape_forward()) < sent:
        assert time.monotonic() < deadline, (routed_total(first), sent)
        time.sleep(0.5)
    second = scrape_forward()
    assert routed_total(first) == routed_total(second) == sent  # each request counted once
    # No counter went down between the two scrapes (whichever ingress served each).
    assert first.keys() == second.keys()
    assert all(second[k] >= v for k, v in first.items()), (first, second)
    assert {dict(labels)["policy"] for name, labels in first if name == ROUTED} == {
        "most_free_blocks"
    }
    assert len({dict(labels)["ingress"] for name, labels in first if name == HITS}) == 2
