"""Request ids, the per-request log line and the metrics vLLM has, over real HTTP
(uvicorn, an in-process engine replica): every response carries `X-Request-Id`, the
engine request is named by it, one log line tells each request's end, and a scrape of
`/metrics` moves by exactly what the responses reported.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Iterator
from typing import ClassVar

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagefleet.cluster.replica import LocalBackend
from pagefleet.cluster.replica_messages import ReplicaRequest, RequestDelta
from tests.cluster.http.test_api import Harness, serving

ENGINE = {"num_kv_blocks": 64, "block_size": 8, "max_num_seqs": 16, "max_model_len": 128}
GREEDY = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}


class NamesSeen(LocalBackend):
    """A local backend that notes the engine request ids it is asked for."""

    seen: ClassVar[list[str]] = []

    def generate(self, request: ReplicaRequest) -> AsyncIterator[RequestDelta]:
        NamesSeen.seen.append(request.request_id)
        return super().generate(request)


@pytest.fixture(scope="module")
def srv(llama_dir: str) -> Iterator[Harness]:
    with serving(llama_dir, {"engine": ENGINE}, request_log="json") as h:
        yield h


def scrape(srv: Harness) -> dict[tuple[str, str], float]:
    """Each series' value by (name, its status or finished_reason label or "")."""
    values: dict[tuple[str, str], float] = {}
    for fam in text_string_to_metric_families(srv.client.get("/metrics").text):
        for s in fam.samples:
            key = (s.name, s.labels.get("status", ""))
            values[key] = values.get(key, 0.0) + s.value
    return values


def moved(
    before: dict[tuple[str, str], float],
    after: dict[tuple[str, str], float],
    name: str,
    status: str = "",
) -> float:
    return after.get((name, status), 0.0) - before.get((name, status), 0.0)


def test_request_id_is_echoed_on_every_response(srv: Harness) -> None:
    given = {"X-Request-Id": "trace-42"}
    ok = srv.client.post("/v1/completions", json={"prompt": "a", **GREEDY}, headers=given)
    assert ok.status_code == 200 and ok.headers["x-request-id"] == "trace-42"
    assert (ok.headers["x-pagefleet-ingress"], ok.headers["x-pagefleet-replica"]) == ("local", "r0")
    bad = srv.client.post("/v1/completions", json={"prompt": "a", "max_tokens": -1}, headers=given)
    assert bad.status_code == 400 and bad.headers["x-request-id"] == "trace-42"
    missing = srv.client.get("/nowhere", headers=given)
    assert missing.status_code == 404 and missing.headers["x-request-id"] == "trace-42"
    with srv.client.stream(
        "POST",
        "/v1/chat/completions",
        headers=given,
        json={"messages": [{"role": "user", "content": "hi"}], "stream": True, **GREEDY},
    ) as r:
        assert r.headers["x-request-id"] == "trace-42"
        r.read()
    made = srv.client.get("/health").headers["x-request-id"]
    assert len(made) == 32 and int(made, 16) >= 0
    unusable = srv.client.get("/health", headers={"X-Request-Id": "x" * 200}).headers[
        "x-request-id"
    ]
    assert len(unusable) == 32


def test_the_request_id_names_the_engine_request_while_unique(llama_dir: str) -> None:
    NamesSeen.seen = []
    with serving(llama_dir, {"engine": ENGINE}, backend_class=NamesSeen, api_key="k") as h:
        key = {"Authorization": "Bearer k"}
        for rid in ("abc-1", "abc-2"):
            headers = {"X-Request-Id": rid, **key}
            r = h.client.post("/v1/completions", json={"prompt": "a", **GREEDY}, headers=headers)
            assert r.status_code == 200
        h.client.post("/v1/completions", json={"prompt": "a", **GREEDY}, headers=key)
        two = {"prompt": ["a", "b"], **GREEDY}
        h.client.post("/v1/completions", json=two, headers={"X-Request-Id": "two", **key})
        # The same id twice at once: the second request's engine request keeps its own.
        body = {"prompt": "a", "stream": True, **GREEDY, "max_tokens": 100}
        dup = {"X-Request-Id": "dup", **key}
        with h.client.stream("POST", "/v1/completions", json=body, headers=dup) as first:
            again = h.client.post("/v1/completions", json={"prompt": "a", **GREEDY}, headers=dup)
            assert again.status_code == 200 and again.headers["x-request-id"] == "dup"
            first.read()
        refused = h.client.post(
            "/v1/completions", json={"prompt": "a"}, headers={"X-Request-Id": "no-key"}
        )
        assert refused.status_code == 401 and refused.headers["x-request-id"] == "no-key"
    assert NamesSeen.seen[:2] == ["abc-1", "abc-2"]
    assert NamesSeen.seen[2].startswith("cmpl-")
    assert NamesSeen.seen[3:5] == ["two-0", "two-1"]
    assert NamesSeen.seen[5] == "dup" and NamesSeen.seen[6].startswith("cmpl-")


def test_one_json_log_line_per_finished_request(
    srv: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="pagefleet.requests"):
        body = {"messages": [{"role": "user", "content": "hi"}], **GREEDY}
        r = srv.client.post("/v1/chat/completions", json=body, headers={"X-Request-Id": "log-1"})
        srv.client.post(
            "/v1/chat/completions", json={"messages": []}, headers={"X-Request-Id": "log-2"}
        )
    lines = [
        json.loads(rec.getMessage()) for rec in caplog.records if rec.name == "pagefleet.requests"
    ]
    ok, bad = (
        [x for x in lines if x["request_id"] == "log-1"],
        [x for x in lines if x["request_id"] == "log-2"],
    )
    assert len(ok) == len(bad) == 1
    usage = r.json()["usage"]
    line = ok[0]
    assert line["method_path"] == "POST /v1/chat/completions" and line["model"] == "tiny"
    assert (line["status"], line["prompt_tokens"], line["output_tokens"]) == (
        200,
        usage["prompt_tokens"],
        usage["completion_tokens"],
    )
    assert line["replica"] == "r0" and 0 <= line["ttft_s"] <= line["e2e_s"]
    assert bad[0]["status"] == 400 and bad[0]["output_tokens"] == 0 and bad[0]["ttft_s"] is None


def test_text_log_and_off(llama_dir: str, caplog: pytest.LogCaptureFixture) -> None:
    for form in ("text", "off"):
        caplog.clear()
        with (
            serving(llama_dir, {"engine": ENGINE}, request_log=form) as h,
            caplog.at_level(logging.INFO, logger="pagefleet.requests"),
        ):
            h.client.post(
                "/v1/completions", json={"prompt": "a", **GREEDY}, headers={"X-Request-Id": "t-1"}
            )
        lines = [rec.getMessage() for rec in caplog.records if rec.name == "pagefleet.requests"]
        if form == "off":
            assert lines == []
        else:
            [line] = [x for x in lines if "request_id=t-1" in x]
            assert "status=200" in line and "output_tokens=6" in line and "replica=r0" in line


def test_metrics_move_by_what_the_responses_reported(srv: Harness) -> None:
    before = scrape(srv)
    with openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0) as client:
        done = client.completions.create(
            model="tiny", prompt="a", n=2, max_tokens=5, extra_body={"ignore_eos": True}
        )
        streamed = list(
            client.completions.create(
                model="tiny", prompt="b", max_tokens=4, stream=True, extra_body={"ignore_eos": True}
            )
        )
    assert done.usage is not None and streamed
    srv.client.post("/v1/completions", json={"prompt": "a", "max_tokens": -1})
    srv.check_idle_and_balanced()  # also takes the engine's stats fresh
    after = scrape(srv)
    assert moved(before, after, "pagefleet:http_responses_total", "200") == 2
    assert moved(before, after, "pagefleet:http_responses_total", "400") == 1
    assert moved(before, after, "pagefleet:client_time_to_first_token_seconds_count") == 2
    for name in (
        "vllm:request_prefill_time_seconds_count",
        "vllm:request_decode_time_seconds_count",
        "vllm:request_inference_time_seconds_count",
        "vllm:request_time_per_output_token_seconds_count",
        "vllm:request_params_n_count",
        "vllm:request_params_max_tokens_count",
    ):
        assert moved(before, after, name) == 2, name
    assert moved(before, after, "vllm:request_params_n_sum") == 3
    # Tokens per engine step: every sampled token but each sample's last is fed back
    # through a step (prompt tokens come on top, once per sequence not found cached).
    computed = moved(before, after, "vllm:iteration_tokens_total_sum")
    assert computed >= moved(before, after, "vllm:generation_tokens_total") - 3
    assert (
        moved(before, after, "vllm:iteration_tokens_total_count") >= 4
    )  # the longest sample's steps
    assert moved(before, after, "vllm:request_params_max_tokens_sum") == 9
    info = [
        s.labels
        for fam in text_string_to_metric_families(srv.client.get("/metrics").text)
        if fam.name == "vllm:cache_config_info"
        for s in fam.samples
    ]
    assert info == [
        {
            "model_name": "tiny",
            "replica": "r0",
            "block_size": "8",
            "num_gpu_blocks": "64",
            "enable_prefix_caching": "True",
        }
    ]
