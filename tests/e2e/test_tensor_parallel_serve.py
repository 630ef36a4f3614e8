"""A tensor-parallel replica under real Ray Serve (`pagefleet serve`, gloo on CPU): rank 1 is a
Ray actor in the replica's placement group; greedy completions equal a one-process engine's;
a killed rank fails the replica's in-flight requests at once with the cause, and Serve replaces
the replica (ranks and all), after which it serves the same completions again.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import psutil
import pytest

from pagefleet.bench.launcher import first_free_port
from pagefleet.engine import LLM, SamplingParams
from tests.conftest import prompt_ids
from tests.e2e.served import Served, serving, stop_served

ENGINE = {
    "num_kv_blocks": 64,
    "block_size": 8,
    "max_num_seqs": 8,
    "max_model_len": 512,
    "num_threads": 1,
}
MAX_TOKENS = 12
LONG_TOKENS = 480  # a stream long enough to be in flight when its rank is killed

pytestmark = pytest.mark.e2e


def free_port_in_range(lo: int = 8400, hi: int = 8500) -> int:
    """A free port in the range this project's tests may use for servers."""
    port = first_free_port(range(lo, hi))
    if port is None:
        raise RuntimeError(f"no free port in {lo}-{hi - 1}")
    return port


@pytest.fixture(scope="module")
def tp_served(llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    config = {
        "model": llama_dir,
        "served_model_name": "tiny",
        "port": free_port_in_range(),
        "replicas": 1,
        # Per rank: the replica's placement group is two bundles of 0.5 CPU.
        "replica_resources": {"num_cpus": 0.5},
        "drain_timeout_s": 5,
        "engine": {**ENGINE, "tensor_parallel_size": 2},
    }
    with serving(config, tmp_path_factory.mktemp("tp")) as served:
        yield served


@pytest.fixture(scope="module")
def expected(llama_dir: str) -> dict[tuple[int, ...], tuple[str, str, int]]:
    """One process (TP=1), same engine settings: (text, finish reason, tokens) per prompt."""
    prompts = prompt_ids(llama_dir)[:6]
    with LLM(model=llama_dir, **ENGINE) as llm:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
            use_tqdm=False,
        )
    return {
        tuple(p): (o.outputs[0].text, o.outputs[0].finish_reason, len(o.outputs[0].token_ids))
        for p, o in zip(prompts, outs, strict=True)
    }


def complete(served: Served, prompt: list[int], max_tokens: int = MAX_TOKENS) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(f"{served.url}/v1/completions", json=body, timeout=120)


def served_greedy(served: Served, prompts: list[tuple[int, ...]]) -> dict:
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        responses = list(pool.map(lambda p: complete(served, list(p)), prompts))
    got = {}
    for prompt, r in zip(prompts, responses, strict=True):
        assert r.status_code == 200, r.text
        choice, usage = r.json()["choices"][0], r.json()["usage"]
        got[prompt] = (choice["text"], choice["finish_reason"], usage["completion_tokens"])
    return got


def rank_processes(served: Served) -> list[psutil.Process]:
    """The live rank actors' processes (Ray titles an actor's process `ray::ClassName...`)."""
    found = []
    for p in psutil.Process(served.proc.pid).children(recursive=True):
        try:
            if "ray::TensorParallelRank" in " ".join(p.cmdline()) and p.status() not in (
                psutil.STATUS_ZOMBIE,
                psutil.STATUS_DEAD,
            ):
                found.append(p)
        except psutil.NoSuchProcess:
            continue
    return found


def test_tp2_replica_serves_what_one_process_computes(tp_served: Served, expected: dict) -> None:
    (rank,) = rank_processes(tp_served)  # rank 1 is an actor; rank 0 is the engine core
    assert served_greedy(tp_served, list(expected)) == expected
    assert [p.pid for p in rank_processes(tp_served)] == [rank.pid]


def test_a_killed_rank_fails_in_flight_requests_and_the_replica_is_replaced(
    tp_served: Served, expected: dict
) -> None:
    (rank,) = rank_processes(tp_served)
    events: list[dict] = []
    started = threading.Event()

    def stream() -> None:
        body = {
            "model": "tiny",
            "prompt": [5, 6, 7],
            "max_tokens": LONG_TOKENS,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream("POST", f"{tp_served.url}/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
                    started.set()

    streamer = threading.Thread(target=stream)
    streamer.start()
    assert started.wait(60)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        # A non-streamed request in flight too: it gets a 503 with the cause.
        plain = pool.submit(complete, tp_served, [9, 9, 9], LONG_TOKENS)
        time.sleep(0.3)
        killed_at = time.monotonic()
        os.kill(rank.pid, signal.SIGKILL)
        streamer.join(30)
        assert not streamer.is_alive()  # the stream ended, it did not hang
        response = plain.result(30)
    assert time.monotonic() - killed_at < 15
    # The stream's last event is OpenAI's error body naming the dead rank, after fewer
    # tokens than asked for.
    *chunks, last = events
    assert 0 < len(chunks) < LONG_TOKENS
    assert last["error"]["code"] == 503
    assert "tensor-parallel rank 1 died" in last["error"]["message"]
    assert response.status_code == 503
    assert "tensor-parallel rank 1 died" in response.json()["error"]["message"]

    # The health check fails; Serve replaces the replica whole (a new rank actor with it).
    # Meanwhile (the only replica dead, then none running) a request is answered at once
    # with 503, never held until its time-out.
    deadline = time.monotonic() + 120
    while True:
        t0 = time.monotonic()
        r = complete(tp_served, list(next(iter(expected))))
        if r.status_code == 200:
            break
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == 503
        assert time.monotonic() - t0 < 15, r.text
        assert time.monotonic() < deadline, r.text
        time.sleep(1.0)
    assert not rank.is_running() or rank.status() == psutil.STATUS_ZOMBIE
    (new_rank,) = rank_processes(tp_served)
    assert new_rank.pid != rank.pid
    assert served_greedy(tp_served, list(expected)) == expected


def test_tp_server_stops_cleanly(tp_served: Served) -> None:
    stop_served(tp_served)
    assert tp_served.proc.returncode == 0
