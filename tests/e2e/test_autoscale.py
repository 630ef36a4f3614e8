"""Autoscaling from KV-cache use (`pagefleet serve`, real Ray Serve, the pagefleet policy):
a burst that overfills one replica's KV pool brings a second replica, the quiet after it
takes the fleet back to one, and no request fails on the way up or down.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from pagefleet.bench.launcher import free_port  # outside the ephemeral range Ray binds in
from tests.e2e.test_serve import Served, serving

pytestmark = pytest.mark.e2e

BLOCKS = 48  # of 8 tokens: two of the burst's requests (136 tokens, 17 blocks) fit at once
AUTOSCALING = {
    "min_replicas": 1,
    "max_replicas": 2,
    "initial_replicas": 1,
    "target_kv_utilization": 0.5,
    "scale_in_kv_utilization": 0.1,
    "scale_out_after_s": 1.0,
    "scale_in_after_s": 2.0,
    "look_back_period_s": 1.0,
    "metrics_interval_s": 0.5,
}


@pytest.fixture(scope="module")
def fleet(llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    config = {
        "model": llama_dir,
        "served_model_name": "tiny",
        "port": free_port(),
        "replica_resources": {"num_cpus": 0.5},
        "routing_stats_period_s": 0.5,
        "drain_timeout_s": 30,
        "autoscaling": AUTOSCALING,
        "engine": {
            "num_kv_blocks": BLOCKS,
            "block_size": 8,
            "max_num_seqs": 16,
            "max_model_len": 256,
            "num_threads": 1,
        },
    }
    with serving(config, tmp_path_factory.mktemp("autoscale")) as served:
        yield served


def fleet_size(served: Served) -> tuple[float, float, int]:
    """(pagefleet:replicas, pagefleet:target_replicas, replicas reporting KV blocks)."""
    m = served.scrape()
    return (
        m.get("pagefleet:replicas", {}).get(None, -1.0),
        m.get("pagefleet:target_replicas", {}).get(None, -1.0),
        len(m.get("pagefleet:kv_blocks_total", {})),
    )


def wait_for(what: str, cond: Callable[[], bool], timeout_s: float) -> float:
    start = time.monotonic()
    while not cond():
        assert time.monotonic() - start < timeout_s, f"timed out waiting for {what}"
        time.sleep(0.5)
    return time.monotonic() - start


def load(served: Served, stop: threading.Event, max_tokens: int, seed: int) -> list[int]:
    """Completions back to back until `stop`; every one's completion_tokens."""
    got = []
    i = 0
    while not stop.is_set():
        body = {
            "model": "tiny",
            "prompt": [seed, i % 50 + 3, *[7] * 14],
            "max_tokens": max_tokens,
            "ignore_eos": True,
        }
        r = httpx.post(f"{served.url}/v1/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        got.append(r.json()["usage"]["completion_tokens"])
        i += 1
    return got


def test_a_burst_scales_out_to_two_replicas_and_the_quiet_back_to_one(fleet: Served) -> None:
    wait_for("the policy's first status", lambda: fleet_size(fleet)[:2] == (1.0, 1.0), 60)
    stop = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        burst = [pool.submit(load, fleet, stop, 120, seed) for seed in range(12)]
        # More requests than one replica's blocks hold: they wait, and KV use passes 0.5.
        t_out = wait_for("a second replica", lambda: fleet_size(fleet) == (2.0, 2.0, 2), 180)
        time.sleep(2)  # both replicas take part of the burst
        stop.set()
        counts = [f.result() for f in burst]
    assert all(n == 120 for c in counts for n in c), counts
    total = sum(len(c) for c in counts)
    assert total >= 12

    # Quiet, but for one user with short requests, who must never see an error while
    # the second replica drains and stops.
    stop = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        trickle = pool.submit(load, fleet, stop, 4, 99)
        t_in = wait_for("back to one replica", lambda: fleet_size(fleet) == (1.0, 1.0, 1), 180)
        stop.set()
        assert set(trickle.result()) == {4}
    print(f"scaled out in {t_out:.1f}s under {total} requests, back in {t_in:.1f}s")
