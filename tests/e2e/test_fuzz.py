"""Schema fuzzing of a real `pagefleet serve` (Ray Serve, an API key from $PAGEFLEET_API_KEY)
with schemathesis, driven from the server's own /openapi.json.

Every documented operation gets generated requests: valid ones (within the document's
ranges and limits) and, for those with a body, invalid ones (wrong types, out-of-range
values, missing fields). Each answer must be a 2xx, or a 4xx with OpenAI's error body, that
the document declares (status, content type, body schema, headers), sent with no 5xx,
hang or dropped connection; an operation that declares the key must refuse requests
without it. Afterwards an ordinary completion still works, every replica's blocks are all
free again, and the key appears in no log and no metric.

The generation is derandomized (the same requests every run), and small limits keep each
request cheap: the whole module runs in about two minutes on two CPU cores.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from pagefleet.bench.launcher import free_port  # outside the ephemeral range Ray binds in
from tests.e2e.served import Served, start_served, stop_served

pytestmark = pytest.mark.e2e

KEY = "sk-fuzz-7d1e9b40c2a84f5e"
AUTH = {"Authorization": f"Bearer {KEY}"}
BLOCKS = 96
# Requests per operation and mode; POSTs get most (they carry the bodies worth fuzzing).
POSITIVE_EXAMPLES = 120
NEGATIVE_EXAMPLES = 60
GET_EXAMPLES = 10
MIN_REQUESTS = 800


@pytest.fixture(scope="module")
def fuzzed(llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    cfg = tmp_path_factory.mktemp("fuzz") / "fuzz.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "model": llama_dir,
                "served_model_name": "tiny",
                "port": free_port(),
                "replicas": 1,
                "replica_resources": {"num_cpus": 0.5},
                "request_timeout_s": 60,
                "engine": {
                    "num_kv_blocks": BLOCKS,
                    "block_size": 8,
                    "max_num_seqs": 8,
                    "max_model_len": 256,
                    "num_threads": 1,
                },
                # Small limits keep every generated request cheap (at most 2 prompts x 2
                # samples x 4 tokens), and the document states them, so the generator
                # stays mostly within what the server accepts.
                "limits": {
                    "max_body_bytes": 16384,
                    "max_prompt_tokens": 64,
                    "max_prompts": 2,
                    "max_n": 2,
                    "max_logprobs": 3,
                    "max_stop": 3,
                    "max_tokens": 4,
                },
            }
        )
    )
    # Ray's files (its logs included) go to a folder of this test's own, to be searched
    # for the key afterwards; short, as Ray's socket paths must be.
    ray_tmp = Path(tempfile.mkdtemp(prefix="pfz", dir="/tmp"))
    served = start_served(cfg, env={"PAGEFLEET_API_KEY": KEY, "RAY_TMPDIR": str(ray_tmp)})
    served.ray_tmp = ray_tmp  # type: ignore[attr-defined]
    try:
        yield served
    finally:
        if served.proc.poll() is None:
            os.killpg(served.proc.pid, signal.SIGKILL)
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _openai_error_body(response: Any) -> None:
    """A 4xx answer carries OpenAI's error body, with the status as its code."""
    body = response.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["code"] == response.status_code and err["message"] and err["type"], err


def test_fuzz_every_operation(fuzzed: Served) -> None:
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis.checks import not_a_server_error
    from schemathesis.generation import GenerationMode
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        ignored_auth,
        negative_data_rejection,
        response_headers_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    @schemathesis.check
    def negative_data_rejected(ctx: Any, response: Any, case: Any) -> bool | None:
        # The body-size limit answers 413 before anything is parsed: a rejection too.
        if response.status_code == 413:
            return True
        return negative_data_rejection(ctx, response, case)

    checks = [
        not_a_server_error,
        status_code_conformance,
        content_type_conformance,
        response_headers_conformance,
        response_schema_conformance,
        negative_data_rejected,
        ignored_auth,
    ]
    schema = schemathesis.openapi.from_url(f"{fuzzed.url}/openapi.json", timeout=30)
    operations = [result.ok() for result in schema.get_all_operations()]
    labels = sorted(op.label for op in operations)
    assert labels == [
        "DELETE /v1/responses/{response_id}",
        "GET /dashboard/data",
        "GET /health",
        "GET /metrics",
        "GET /v1/models",
        "GET /v1/responses/{response_id}",
        "GET /version",
        "POST /detokenize",
        "POST /tokenize",
        "POST /v1/chat/completions",
        "POST /v1/completions",
        "POST /v1/embeddings",
        "POST /v1/responses",
    ]
    sent: Counter[str] = Counter()
    refused: Counter[str] = Counter()
    statuses: Counter[int] = Counter()
    t0 = time.monotonic()
    with httpx.Client(timeout=60) as session_check:
        session_check.get(f"{fuzzed.url}/health").raise_for_status()
    for op in operations:
        modes = [GenerationMode.POSITIVE]
        if op.method.upper() == "POST":
            modes.append(GenerationMode.NEGATIVE)
        for mode in modes:
            if op.method.upper() != "POST":
                examples = GET_EXAMPLES
            elif mode == GenerationMode.POSITIVE:
                examples = POSITIVE_EXAMPLES
            else:
                examples = NEGATIVE_EXAMPLES

            @settings(
                max_examples=examples,
                deadline=None,
                database=None,
                derandomize=True,
                phases=[Phase.explicit, Phase.generate],
                suppress_health_check=list(HealthCheck),
            )
            @given(case=op.as_strategy(generation_mode=mode))
            def run(case: Any) -> None:
                # A hang shows as a timeout, a dropped connection as an exception: both fail.
                response = case.call(base_url=fuzzed.url, headers=AUTH, timeout=60)
                sent[case.operation.label] += 1
                statuses[response.status_code] += 1
                case.validate_response(response, checks=checks, headers=AUTH)
                assert 200 <= response.status_code < 300 or 400 <= response.status_code < 500
                if response.status_code >= 400:
                    _openai_error_body(response)
                    if case.meta is None or case.meta.generation.mode == GenerationMode.POSITIVE:
                        # What valid-by-the-document requests were refused for (cross-field
                        # rules, token counts): printed, to keep the document honest.
                        message = response.json()["error"]["message"]
                        refused[f"{case.operation.label}: {re.sub(r'[0-9]+', 'N', message)}"] += 1
                elif "text/event-stream" in response.headers.get("content-type", ""):
                    if case.operation.label == "POST /v1/responses":
                        _responses_stream(response.text)
                        return
                    events = [
                        line[len("data: ") :]
                        for line in response.text.splitlines()
                        if line.startswith("data: ")
                    ]
                    assert events[-1] == "[DONE]", response.text
                    for event in events[:-1]:
                        assert "error" not in json.loads(event), event

            run()
    elapsed = time.monotonic() - t0
    total = sum(sent.values())
    print(f"fuzzed {total} requests in {elapsed:.0f} s: {dict(sent)}; statuses {dict(statuses)}")
    print(
        "valid requests refused:", *(f"{n:4d} {why}" for why, n in refused.most_common()), sep="\n"
    )
    assert total >= MIN_REQUESTS, dict(sent)
    assert all(sent[label] >= 1 for label in labels), dict(sent)
    assert all(200 <= s < 300 or 400 <= s < 500 for s in statuses)
    # Meaningful requests, not only rejections: many were served.
    assert statuses[200] >= 300, dict(statuses)

    # Afterwards the server still serves, and every replica's pool balances.
    client = openai.OpenAI(base_url=f"{fuzzed.url}/v1", api_key=KEY, max_retries=0)
    done = client.completions.create(
        model="tiny", prompt="def f(x):", max_tokens=4, extra_body={"ignore_eos": True}
    )
    assert done.usage.completion_tokens == 4
    _wait_balanced(fuzzed)


def _responses_stream(text: str) -> None:
    """A Responses stream: typed events, numbered in order, ending with the response."""
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]
    assert [e["sequence_number"] for e in events] == list(range(len(events))), text
    assert events[0]["type"] == "response.created", text
    assert events[-1]["type"] in ("response.completed", "response.incomplete"), text


def _wait_balanced(served: Served) -> None:
    """Idle, and free + used == total on every replica (used from the usage gauge)."""
    deadline = time.monotonic() + 60
    while True:
        text = httpx.get(f"{served.url}/metrics", headers=AUTH, timeout=30).text
        m = _samples(text)
        free, total = m["pagefleet:kv_blocks_free"], m["pagefleet:kv_blocks_total"]
        usage = m["vllm:kv_cache_usage_perc"]
        running, waiting = m["vllm:num_requests_running"], m["vllm:num_requests_waiting"]
        idle = set(running.values()) == set(waiting.values()) == {0.0}
        if idle and free == total and set(usage.values()) == {0.0}:
            break
        assert time.monotonic() < deadline, f"not balanced: {m}"
        time.sleep(0.5)
    assert set(total.values()) == {BLOCKS} and len(total) == 1
    for replica in total:
        used = round(usage[replica] * total[replica])
        assert free[replica] + used == total[replica] == BLOCKS


def _samples(text: str) -> dict[str, dict[str, float]]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[str, float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.labels.get("model_name") == "tiny" and "finished_reason" not in s.labels:
                out.setdefault(s.name, {})[s.labels.get("replica")] = s.value
    return out


def test_the_key_is_in_no_metric_and_no_log(fuzzed: Served) -> None:
    # /metrics needs the key (protect_metrics defaults on with one) and holds no trace of it.
    assert httpx.get(f"{fuzzed.url}/metrics", timeout=30).status_code == 401
    metrics = httpx.get(f"{fuzzed.url}/metrics", headers=AUTH, timeout=30)
    assert metrics.status_code == 200 and KEY not in metrics.text
    # The key from the environment guards /v1 as one from the config would.
    r = httpx.get(f"{fuzzed.url}/v1/models", timeout=30)
    assert r.status_code == 401 and KEY not in r.text
    stop_served(fuzzed)
    logs = [p for p in fuzzed.ray_tmp.rglob("*") if p.is_file()]  # type: ignore[attr-defined]
    assert any(p.suffix in (".log", ".out", ".err") for p in logs)
    leaked = [str(p) for p in logs if KEY.encode() in _read(p)]
    assert leaked == []
    assert KEY not in "".join(fuzzed.log)


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:  # sockets and files Ray removed meanwhile
        return b""
