"""vLLM's `priority` request field over HTTP: honoured under scheduling_policy
"priority" (an urgent request queued behind low-priority ones is served first),
refused by name with how to enable it otherwise."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.cluster.http.test_api import ENGINE, Harness, serving


def _gauge(h: Harness, name: str) -> float:
    text = h.client.get("/metrics").text
    for family in text_string_to_metric_families(text):
        if family.name == name:
            return sum(s.value for s in family.samples)
    raise AssertionError(f"no {name}")


def _wait_for(h: Harness, running: int, waiting: int) -> None:
    deadline = time.monotonic() + 60
    while (
        _gauge(h, "vllm:num_requests_running"),
        _gauge(h, "vllm:num_requests_waiting"),
    ) != (running, waiting):
        assert time.monotonic() < deadline, f"never {running} running, {waiting} waiting"
        time.sleep(0.01)


def test_urgent_request_overtakes_queued_low_priority_ones(llama_dir: str) -> None:
    engine = {
        **ENGINE,
        "max_num_seqs": 1,
        "max_model_len": 1024,
        "num_kv_blocks": 256,
        "scheduling_policy": "priority",
    }
    with serving(llama_dir, {"engine": engine}, priority_scheduling=True) as h:
        done: list[str] = []
        lock = threading.Lock()

        def send(name: str, priority: int, max_tokens: int) -> None:
            body = {
                "model": "tiny",
                "prompt": "def run(self):",
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "priority": priority,
            }
            with httpx.Client(base_url=h.url, timeout=120) as c:
                r = c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            with lock:
                done.append(name)

        first = threading.Thread(target=send, args=("low-1", 5, 1000))
        first.start()
        _wait_for(h, 1, 0)
        threads = [first]
        for name, priority, n in (("low-2", 5, 8), ("urgent", -1, 8)):
            # Each queued behind the running low-1 before the next is sent.
            t = threading.Thread(target=send, args=(name, priority, n))
            t.start()
            threads.append(t)
            _wait_for(h, 1, len(threads) - 1)
        for t in threads:
            t.join(120)
        # max_num_seqs=1: one at a time, and the urgent one is admitted before low-2.
        assert done == ["low-1", "urgent", "low-2"]


def test_priority_refused_under_fcfs(llama_dir: str) -> None:
    with serving(llama_dir, {"engine": ENGINE}) as h:
        for path, extra in (
            ("/v1/completions", {"prompt": "hi"}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ):
            body: dict[str, Any] = {"model": "tiny", "max_tokens": 2, **extra}
            r = h.client.post(path, json={**body, "priority": 3})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == "priority"
            assert "scheduling_policy: priority" in error["message"]
            for accepted in (0, None):
                r = h.client.post(path, json={**body, "priority": accepted})
                assert r.status_code == 200, r.text
