"""The fair queue on a real `pagefleet serve` (Ray Serve): the ingress holds requests once
its slots are taken, an urgent one overtakes queued low-priority ones, and a tenant's full
queue is a 429 naming the limit, with Retry-After. Counts and orders, never timings.

One engine replica; the ingress lets one request through at a time
(`fairness.max_in_flight: 1`). A long streamed request holds the slot while the test
queues the others behind it, each once the one before is counted in
`pagefleet:tenant_queue_depth`; then its client leaves, which frees the slot.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagefleet.bench.launcher import free_port  # outside the ephemeral range Ray binds in
from tests.e2e.served import Served, serving

pytestmark = pytest.mark.e2e

HEADER = "x-tenant"
LONG = {"max_tokens": 8000, "ignore_eos": True, "temperature": 0, "stream": True}


@pytest.fixture(scope="module")
def fair(long_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    config = {
        "model": long_llama_dir,
        "served_model_name": "tiny",
        "port": free_port(),
        "replicas": 1,
        "replica_resources": {"num_cpus": 0.5},
        "fairness": {
            "enabled": True,
            "tenant_header": HEADER,
            "max_in_flight": 1,
            "max_queued_per_tenant": 3,
            "output_token_weight": 0.0,
        },
        "engine": {
            "num_kv_blocks": 1100,
            "block_size": 16,
            "max_num_seqs": 2,
            "max_model_len": 8192,
            "max_num_batched_tokens": 256,
            "num_threads": 1,
            "scheduling_policy": "priority",
        },
    }
    with serving(config, tmp_path_factory.mktemp("fairness")) as served:
        yield served


def _depth(served: Served) -> dict[str, float]:
    text = httpx.get(f"{served.url}/metrics", timeout=30).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "pagefleet:tenant_queue_depth":
                out[s.labels["tenant"]] = out.get(s.labels["tenant"], 0.0) + s.value
    return out


def _wait(served: Served, tenant: str, queued: int) -> None:
    deadline = time.monotonic() + 120
    while _depth(served).get(tenant, 0) != queued:
        assert time.monotonic() < deadline, f"{tenant} never had {queued} queued"
        time.sleep(0.1)


def test_urgent_overtakes_the_queue_and_a_full_tenant_queue_is_a_429(fair: Served) -> None:
    done: list[str] = []
    lock = threading.Lock()
    leave = threading.Event()

    def hold() -> None:
        body = {"model": "tiny", "prompt": "def run(self):", **LONG}
        with (
            httpx.Client(base_url=fair.url, timeout=None) as c,
            c.stream("POST", "/v1/completions", json=body, headers={HEADER: "a"}) as r,
        ):
            assert r.status_code == 200
            for _ in r.iter_lines():
                if leave.is_set():
                    break

    def send(name: str, tenant: str, priority: int, extra: dict) -> None:
        body = {"model": "tiny", "prompt": "def run(self):", "priority": priority, **extra}
        with httpx.Client(base_url=fair.url, timeout=None) as c:
            r = c.post("/v1/completions", json=body, headers={HEADER: tenant})
        assert r.status_code == 200, r.text
        with lock:
            done.append(name)

    short = {"max_tokens": 4, "ignore_eos": True, "temperature": 0}
    threads = [threading.Thread(target=hold)]
    threads[0].start()
    deadline = time.monotonic() + 120
    while not fair.total("vllm:num_requests_running"):
        assert time.monotonic() < deadline, "the long request never ran"
        time.sleep(0.1)
    for queued, (name, priority) in enumerate((("low-1", 5), ("low-2", 5), ("urgent", -1)), 1):
        threads.append(threading.Thread(target=send, args=(name, "a", priority, short)))
        threads[-1].start()
        _wait(fair, "a", queued)
    r = httpx.post(
        f"{fair.url}/v1/completions",
        json={"model": "tiny", "prompt": "hi", "max_tokens": 2},
        headers={HEADER: "a"},
        timeout=60,
    )
    assert r.status_code == 429, r.text
    assert r.headers["Retry-After"] == "1"
    assert "tenant a has 3 requests queued" in r.json()["error"]["message"]
    leave.set()
    for t in threads:
        t.join(600)
    assert done == ["urgent", "low-1", "low-2"]
    assert _depth(fair)["a"] == 0
