"""`pagefleet serve` as users run it: a subprocess with an embedded Ray, Ray Serve, the official
`openai` SDK, a Prometheus scrape, SIGINT, and nothing left running afterwards.

The server runs two ingress replicas (`ingress_replicas: 2`), as a fleet behind one
endpoint does, so every check here holds whichever ingress the proxy picks; the first
test is about the two ingresses' router counters (one server for both saves CI a
start-up).
"""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import httpx
import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, ConfigDict, Field

from pagefleet.bench.launcher import free_port  # outside the ephemeral range Ray binds in
from pagefleet.engine import LLM, SamplingParams
from tests.conftest import PROMPT_TEXTS
from tests.e2e.served import Served, serving, stop_served

ENGINE = {"num_kv_blocks": 96, "block_size": 8, "max_num_seqs": 16, "max_model_len": 256}

pytestmark = pytest.mark.e2e

ROUTED = "pagefleet:routed_requests_total"
HITS = "pagefleet:router_prefix_hit_blocks_total"
# An ingress pushes its counters to the hub on Serve's health checks (every 10 s by default),
# so the other ingress's scrape may lag that long.
SETTLE_S = 45.0

Series = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture(scope="module")
def served(llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    config = {
        "model": llama_dir,
        "served_model_name": "tiny",
        "port": free_port(),
        "replicas": 1,
        "ingress_replicas": 2,
        "replica_resources": {"num_cpus": 0.5},
        "routing_stats_period_s": 0.5,
        "engine": ENGINE,
        "limits": {"max_n": 4},
    }
    with serving(config, tmp_path_factory.mktemp("serve")) as s:
        yield s


@pytest.fixture(scope="module")
def client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)


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


def test_router_counters_are_unique_and_monotonic_across_ingresses(served: Served) -> None:
    """First in this module: the router counters start from zero here."""
    sent = 0
    deadline = time.monotonic() + SETTLE_S
    last: Series = {}

    def scrape_forward() -> Series:
        """A scrape (whichever ingress serves it) in which no counter went down."""
        nonlocal last
        now = router_series(served)
        fell = {k: (v, now[k]) for k, v in last.items() if k in now and now[k] < v}
        assert not fell, f"counters went down between two scrapes: {fell}"
        last = {**last, **now}
        return now

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        # Concurrent requests (the proxy spreads them over both ingresses), scraped while
        # they run (`router_series` fails on a series seen twice, `scrape_forward` on a
        # counter that went down), until the scrapes show both ingresses' series.
        while True:
            batch = [pool.submit(complete, served, sent + k) for k in range(16)]
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


def test_sdk_models_completions_chat(served: Served, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == ["tiny"]
    c = client.completions.create(model="tiny", prompt="def f(x):", max_tokens=6, temperature=0)
    assert c.choices[0].finish_reason in ("length", "stop") and c.usage.completion_tokens <= 6
    chunks = list(
        client.completions.create(
            model="tiny", prompt="def f(x):", max_tokens=6, temperature=0, stream=True
        )
    )
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == c.choices[0].text
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0
    )
    assert chat.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts = list(stream)
    assert "".join(p.choices[0].delta.content or "" for p in parts if p.choices) == (
        chat.choices[0].message.content
    )
    assert (
        parts[-1].usage is not None
        and parts[-1].usage.completion_tokens == chat.usage.completion_tokens
    )
    two = client.completions.create(
        model="tiny",
        prompt="import",
        max_tokens=4,
        n=2,
        temperature=0.8,
        seed=3,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    assert sorted(ch.index for ch in two.choices) == [0, 1]
    assert all(len(ch.logprobs.tokens) == 4 for ch in two.choices)
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="tiny", prompt="x", max_tokens=-3)
    assert "max_tokens" in bad.value.message
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4o", prompt="x", max_tokens=3)


class Point(BaseModel):
    model_config = ConfigDict(extra="forbid")

    x: Annotated[int, Field(ge=-9, le=9)]
    label: Annotated[str, Field(max_length=4)]


def test_structured_output_through_serve(client: openai.OpenAI) -> None:
    """The constraint travels with the request through Serve to the replica's engine:
    the SDK's parse() gets its object, a choice is one of its strings."""
    for seed in range(3):
        got = client.chat.completions.parse(
            model="tiny",
            messages=[{"role": "user", "content": "a point"}],
            response_format=Point,
            temperature=1.0,
            seed=seed,
            max_completion_tokens=60,
        )
        assert isinstance(got.choices[0].message.parsed, Point)
    pick = client.completions.create(
        model="tiny",
        prompt="x",
        max_tokens=8,
        temperature=1.0,
        extra_body={"guided_choice": ["left", "right"]},
    )
    assert pick.choices[0].text in ("left", "right")


def test_greedy_over_http_equals_llm_generate(
    served: Served, client: openai.OpenAI, llama_dir: str
) -> None:
    texts = PROMPT_TEXTS[:5]
    with LLM(model=llama_dir, **ENGINE) as llm:
        expected = llm.generate(
            texts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False
        )
    got = client.completions.create(
        model="tiny", prompt=texts, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
    )
    assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == [
        o.outputs[0].text for o in expected
    ]
    ids = client.completions.create(
        model="tiny",
        prompt=expected[2].prompt_token_ids,
        max_tokens=16,
        temperature=0,
        logprobs=0,
        extra_body={"ignore_eos": True},
    )
    assert "".join(ids.choices[0].logprobs.tokens) == expected[2].outputs[0].text


def test_metrics_move_by_exactly_the_usage(served: Served, client: openai.OpenAI) -> None:
    def settled() -> tuple[float, float, float]:
        # Replicas push every 0.5 s: wait until two scrapes agree.
        last = None
        for _ in range(60):
            now = (
                served.total("vllm:prompt_tokens_total"),
                served.total("vllm:generation_tokens_total"),
                served.total("vllm:request_prompt_tokens_count"),
            )
            if now == last:
                return now
            last = now
            time.sleep(0.6)
        raise AssertionError("metrics did not settle")

    p0, g0, n0 = settled()
    usage = [
        client.completions.create(
            model="tiny", prompt=t, max_tokens=7, extra_body={"ignore_eos": True}
        ).usage
        for t in ("import os", "class A:", "x")
    ]
    time.sleep(1.2)
    p1, g1, n1 = settled()
    assert p1 - p0 == sum(u.prompt_tokens for u in usage)
    assert g1 - g0 == sum(u.completion_tokens for u in usage) == 21
    assert n1 - n0 == 3
    families = {
        f.name for f in text_string_to_metric_families(httpx.get(f"{served.url}/metrics").text)
    }
    for name in (
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:request_success",
    ):
        assert name in families


def test_embeddings_through_the_router(
    served: Served, client: openai.OpenAI, llama_dir: str
) -> None:
    """`embeddings.create` is routed to the engine replica as completions are, and its
    vectors are the in-process engine's (the default `last` pooling)."""
    before = routed_total(router_series(served))
    texts = PROMPT_TEXTS[:3]
    out = client.embeddings.create(model="tiny", input=texts)
    assert out.usage.prompt_tokens > 0
    with LLM(model=llama_dir, **ENGINE) as llm:
        want = llm.generate(texts, SamplingParams(embed=True), use_tqdm=False)
    for d, w in zip(out.data, want, strict=True):
        assert w.embedding is not None
        assert max(abs(a - b) for a, b in zip(d.embedding, w.embedding, strict=True)) < 1e-5
    deadline = time.monotonic() + SETTLE_S
    while routed_total(router_series(served)) < before + len(texts):
        assert time.monotonic() < deadline, "the router did not count the embedding requests"
        time.sleep(0.5)


def test_disconnect_over_serve_frees_blocks(served: Served) -> None:
    body = {
        "model": "tiny",
        "prompt": "while True:",
        "max_tokens": 200,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{served.url}/v1/completions", json=body, timeout=60) as r:
        n = 0
        for line in r.iter_lines():
            n += line.startswith("data: ")
            if n == 3:
                break
    deadline = time.monotonic() + 30
    while True:
        m = served.scrape()
        free, total = m["pagefleet:kv_blocks_free"], m["pagefleet:kv_blocks_total"]
        if sum(m["vllm:num_requests_running"].values()) == 0 and free == total:
            break
        assert time.monotonic() < deadline, f"blocks not freed: {m}"
        time.sleep(0.5)
    assert set(free.values()) == {ENGINE["num_kv_blocks"]}


def test_sigint_stops_everything(served: Served) -> None:
    """Last in this module: Ctrl-C stops Serve and the embedded Ray, leaving no process."""
    stop_served(served)
    assert "stopping" in "".join(served.log)


def test_bad_config_fails_with_one_line(tmp_path: Path, llama_dir: str) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(yaml.safe_dump({"model": llama_dir, "replicaz": 2}))
    r = subprocess.run(
        [sys.executable, "-m", "pagefleet.cli", "serve", str(cfg)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [
        "pagefleet: error: invalid config: replicaz: unknown key"
    ]
    missing = tmp_path / "missing.yaml"
    missing.write_text(yaml.safe_dump({"model": str(tmp_path / "nowhere")}))
    r = subprocess.run(
        [sys.executable, "-m", "pagefleet.cli", "serve", str(missing)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1 and "nowhere" in r.stderr and "Traceback" not in r.stderr


def test_port_taken_fails_with_one_line(tmp_path: Path, llama_dir: str) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cfg = tmp_path / "c.yaml"
        cfg.write_text(yaml.safe_dump({"model": llama_dir, "port": port}))
        r = subprocess.run(
            [sys.executable, "-m", "pagefleet.cli", "serve", str(cfg)],
            capture_output=True,
            text=True,
            timeout=120,
            env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"},
        )
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [
        f"pagefleet: error: cannot listen on 127.0.0.1:{port}: Address already in use"
    ]
