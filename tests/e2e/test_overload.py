"""Overload over a real `pagefleet serve` (Ray Serve): every queue is bounded and answers 429
(OpenAI's body, Retry-After) when full, and clients that leave while queued, in the engine's
queue or in Serve's, free their place and never run, checked through the metrics.

One engine replica runs 2 sequences (max_num_seqs) with room for 1 waiting request
(max_waiting_requests), so Serve sends it at most 3 (max_ongoing_requests), and the ingress
holds 1 more while it is full (max_queued_requests). Requests are sent one at a time, each
once the previous one reached its place, so every count is exact. They are raw HTTP over
sockets: a test can leave one mid-request just by closing its socket, as a client would.
"""

from __future__ import annotations

import json
import select
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from pagefleet.bench.launcher import free_port  # outside the ephemeral range Ray binds in
from tests.e2e.served import Served, serving

pytestmark = pytest.mark.e2e

BLOCKS = 1100
# A long context, so a request runs for tens of seconds: it stays running while the test
# fills the queues behind it (block size 16: a full request takes 500 of the 1100 blocks).
MAX_LEN = 8192
LONG = {"max_tokens": 8000, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def overloaded(long_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    config = {
        "model": long_llama_dir,
        "served_model_name": "tiny",
        "port": free_port(),
        "replicas": 1,
        "replica_resources": {"num_cpus": 0.5},
        "max_waiting_requests": 1,
        "max_queued_requests": 1,
        "engine": {
            "num_kv_blocks": BLOCKS,
            "block_size": 16,
            "max_num_seqs": 2,
            "max_model_len": MAX_LEN,
            "max_num_batched_tokens": 256,  # a cheap warm-up at this context length
            "num_threads": 1,
        },
    }
    with serving(config, tmp_path_factory.mktemp("overload")) as served:
        yield served


def open_request(served: Served, body: dict) -> socket.socket:
    """Send a completion request over a socket of its own, and leave the answer unread."""
    port = int(served.url.rsplit(":", 1)[1])
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    data = json.dumps({"model": "tiny", **body}).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock


def answered(sock: socket.socket, within_s: float) -> bool:
    return bool(select.select([sock], [], [], within_s)[0])


def wait_metrics(served: Served, what: str, cond, timeout_s: float = 30) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        m = served.scrape()
        if m.get("vllm:num_requests_running") and cond(m):
            return m
        assert time.monotonic() < deadline, f"{what}: {m}"
        time.sleep(0.2)


def running(m: dict) -> float:
    return sum(m["vllm:num_requests_running"].values())


def waiting(m: dict) -> float:
    return sum(m["vllm:num_requests_waiting"].values())


def prompt_tokens(served: Served, text: str) -> int:
    return httpx.post(f"{served.url}/tokenize", json={"prompt": text}, timeout=30).json()["count"]


def test_full_queues_answer_429_and_queued_clients_that_leave_never_run(
    overloaded: Served,
) -> None:
    s = overloaded
    warm = httpx.post(f"{s.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
    assert warm.status_code == 200
    # A fresh replica: once its metrics show the warm-up's prompt, they are current.
    warm_prompt = prompt_tokens(s, "hi")
    wait_metrics(
        s,
        "the warm-up is not counted",
        lambda m: sum(m["vllm:prompt_tokens_total"].values()) == warm_prompt,
    )
    # Two long streams fill the batch (max_num_seqs 2), one after the other: sent at once,
    # the second could find the first still waiting for its replica in the ingress's
    # one-place queue, and be refused.
    a1 = open_request(s, {**LONG, "prompt": "while True:", "stream": True})
    wait_metrics(s, "the first stream does not run", lambda m: running(m) == 1)
    a2 = open_request(s, {**LONG, "prompt": "for x in y:", "stream": True})
    wait_metrics(s, "the two streams do not run", lambda m: running(m) == 2)
    # One waits in the engine's queue (max_waiting_requests 1)...
    b = open_request(s, {**LONG, "prompt": "import os"})
    wait_metrics(s, "the third is not queued", lambda m: waiting(m) == 1)
    # ...one in the ingress's queue (the replica has its 3: max_queued_requests 1)...
    c = open_request(s, {**LONG, "prompt": "class A:"})
    assert not answered(c, 1.5)  # held: no status line yet
    # Every queue is full, and the fleet is healthy: /health asks Serve's controller,
    # never an engine replica's queue, so it answers while every queued request still
    # waits (a load balancer or a Kubernetes probe must not pull the busiest pod). Judged by
    # order, not by a clock: a /health behind a queue would answer after them, tens of
    # seconds on.
    for _ in range(3):
        t0 = time.monotonic()
        health = httpx.get(f"{s.url}/health", timeout=30)
        took = time.monotonic() - t0
        assert health.status_code == 200, health.text
        assert not answered(b, 0) and not answered(c, 0)
    print(f"/health under full queues: {took * 1000:.0f} ms")
    # ...and the next is refused while they wait, streamed or not.
    for stream in (False, True):
        r = httpx.post(
            f"{s.url}/v1/completions",
            json={"model": "tiny", "prompt": "x", "max_tokens": 2, "stream": stream},
            timeout=30,
        )
        assert r.status_code == 429, r.text
        assert not answered(b, 0) and not answered(c, 0)
        assert r.headers["retry-after"] == "1"
        assert r.json() == {
            "error": {
                "message": "The server is at capacity: every engine replica's queue is full. "
                "Retry after 1 s.",
                "type": "RateLimitError",
                "param": None,
                "code": 429,
            }
        }
    # The queued clients leave: first the one in Serve's queue, then the engine's.
    c.close()
    time.sleep(1.0)
    b.close()
    m = wait_metrics(s, "the left request is still queued", lambda m: waiting(m) == 0)
    assert running(m) == 2
    # Had the request in Serve's queue not been cancelled, it would now have taken the
    # engine-queue place the other one left.
    time.sleep(2.0)
    m = s.scrape()
    assert (running(m), waiting(m)) == (2, 0)
    # A new request takes that place, and runs once the streams' clients leave too.
    e = open_request(s, {"prompt": "def f(x):", "max_tokens": 3, "ignore_eos": True})
    wait_metrics(s, "the new request is not queued", lambda m: waiting(m) == 1)
    a1.close()
    a2.close()
    assert answered(e, 60)
    head = e.recv(65536).decode()
    assert head.startswith("HTTP/1.1 200"), head
    e.close()
    # Nothing left: no request, every block free; and only the three requests that ran
    # were ever prefilled (the two that left while queued never were).
    m = wait_metrics(
        s,
        "not idle and balanced",
        lambda m: (
            running(m) == waiting(m) == 0
            and m["pagefleet:kv_blocks_free"] == m["pagefleet:kv_blocks_total"]
        ),
    )
    assert set(m["pagefleet:kv_blocks_free"].values()) == {BLOCKS}
    expected = sum(prompt_tokens(s, p) for p in ("while True:", "for x in y:", "def f(x):"))
    assert s.total("vllm:prompt_tokens_total") == warm_prompt + expected
