"""`/v1/responses` on real Serve (`pagefleet serve`, two ingress replicas, two engine
replicas): a conversation continues whichever ingress receives its next turn.

Each response names the ingress replica that answered it (`X-Pagefleet-Ingress`) and
the engine replica that made it (`X-Pagefleet-Replica`), so a test sends the next turn
until the proxy gives it to the other ingress: that ingress finds the stored turn in
the shared store, and the router sends the turn, whose prompt extends the last one,
to the engine replica that holds that prefix. The OpenAI Agents SDK runs a two-turn
agent with a function tool the same way. The same server exports its traces to a
collector in the test's process: one request's spans join the ingress's and the
engine replica's processes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Annotated, Any, Literal

import grpc
import httpx
import openai
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from pydantic import BaseModel, ConfigDict, Field

from pagefleet.bench.launcher import free_port
from tests.cluster.test_tracing import CLIENT_SPAN, CLIENT_TRACE, Collector
from tests.e2e.served import Served, serving

pytestmark = pytest.mark.e2e

ENGINE = {"num_kv_blocks": 256, "block_size": 8, "max_num_seqs": 16, "max_model_len": 1024}
FIRST = "Tell me everything about the history of the city of Paris, from its start. " * 3
TRIES = 40  # the proxy picks an ingress at random: the other one comes well within this


@pytest.fixture(scope="module")
def collector() -> Iterator[tuple[Collector, str]]:
    server = grpc.server(futures.ThreadPoolExecutor(2))
    c = Collector()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(c, server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    yield c, f"127.0.0.1:{port}"
    server.stop(None)


@pytest.fixture(scope="module")
def served(
    llama_dir: str, tmp_path_factory: pytest.TempPathFactory, collector: tuple[Collector, str]
) -> Iterator[Served]:
    config = {
        "observability": {"otlp_traces_endpoint": collector[1]},
        "model": llama_dir,
        "served_model_name": "tiny",
        "port": free_port(),
        "replicas": 2,
        "ingress_replicas": 2,
        "replica_resources": {"num_cpus": 0.25},
        "routing_stats_period_s": 0.5,
        "engine": ENGINE,
    }
    with serving(config, tmp_path_factory.mktemp("responses")) as s:
        yield s


def create(served: Served, body: dict[str, Any]) -> httpx.Response:
    r = httpx.post(f"{served.url}/v1/responses", json={"model": "tiny", **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r


def on_another_ingress(served: Served, body: dict[str, Any], ingress: str) -> httpx.Response:
    for _ in range(TRIES):
        r = create(served, body)
        if r.headers["x-pagefleet-ingress"] != ingress:
            return r
    raise AssertionError(f"every one of {TRIES} requests went to {ingress}")


def test_second_turn_on_the_other_ingress_continues_on_the_same_engine(served: Served) -> None:
    greedy = {"temperature": 0, "max_output_tokens": 8}
    first = create(served, {"input": FIRST, **greedy})
    ingress, replica = first.headers["x-pagefleet-ingress"], first.headers["x-pagefleet-replica"]
    time.sleep(1.5)  # three routing-stats periods: the router has seen the cached prefix
    turn = {"input": "And then?", "previous_response_id": first.json()["id"], **greedy}
    second = on_another_ingress(served, turn, ingress)
    assert second.headers["x-pagefleet-replica"] == replica  # the router's prefix affinity
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
    oracle = client.chat.completions.create(
        model="tiny",
        messages=[
            {"role": "user", "content": FIRST},
            {"role": "assistant", "content": first.json()["output"][0]["content"][0]["text"]},
            {"role": "user", "content": "And then?"},
        ],
        temperature=0,
        max_tokens=8,
    )
    body = second.json()
    assert body["previous_response_id"] == first.json()["id"]
    assert oracle.usage is not None and body["usage"]["input_tokens"] == oracle.usage.prompt_tokens
    assert body["output"][0]["content"][0]["text"] == oracle.choices[0].message.content
    got = httpx.get(f"{served.url}/v1/responses/{first.json()['id']}", timeout=30)
    assert got.status_code == 200 and got.json() == first.json()


class Answer(BaseModel):
    """The agent's final output: a grammar ends it (random weights never would)."""

    model_config = ConfigDict(extra="forbid")
    sky: Literal["sunny", "rainy"]
    city: Annotated[str, Field(max_length=8)]


def test_openai_agents_two_turns_with_a_tool_across_ingresses(served: Served) -> None:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    calls: list[str] = []
    ingresses: list[str] = []

    @function_tool
    def get_weather(city: Annotated[str, Field(max_length=8)]) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    async def note(r: httpx.Response) -> None:
        ingresses.append(r.headers["x-pagefleet-ingress"])

    async def run() -> None:
        http = httpx.AsyncClient(event_hooks={"response": [note]}, timeout=120)
        client = openai.AsyncOpenAI(
            base_url=f"{served.url}/v1", api_key="unused", max_retries=0, http_client=http
        )
        agent = Agent(
            name="weather",
            instructions="Use the tool, then answer.",
            tools=[get_weather],
            output_type=Answer,
            model=OpenAIResponsesModel(model="tiny", openai_client=client),
            model_settings=ModelSettings(
                tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=128
            ),
        )
        first = await Runner.run(agent, "Weather in Paris?", max_turns=4)
        assert [type(i).__name__ for i in first.new_items] == [
            "ToolCallItem",
            "ToolCallOutputItem",
            "MessageOutputItem",
        ]
        assert isinstance(first.final_output, Answer) and len(calls) == 1
        stored_by = ingresses[-1]
        second_runs = 0
        while second_runs < TRIES:
            second_runs += 1
            ingresses.clear()
            second = await Runner.run(
                agent, "And Rome?", previous_response_id=first.last_response_id, max_turns=4
            )
            if ingresses[0] != stored_by:
                break
        assert ingresses[0] != stored_by
        assert isinstance(second.final_output, Answer)
        assert (
            type(second.new_items[0]).__name__ == "ToolCallItem" and len(calls) == 1 + second_runs
        )
        await http.aclose()

    asyncio.run(run())


def test_every_ingress_counts_its_responses_on_one_scrape(served: Served) -> None:
    """After the turns above went to both ingresses, any ingress's scrape shows each
    one's `pagefleet:http_responses_total` (pushed to the hub) and its client-side TTFT."""
    from prometheus_client.parser import text_string_to_metric_families

    def ingresses(name: str) -> set[str]:
        text = httpx.get(f"{served.url}/metrics", timeout=30).text
        return {
            s.labels["ingress"]
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
            if s.name == name and s.value > 0
        }

    deadline = time.monotonic() + 45  # each ingress pushes its series every 2 s
    while len(ingresses("pagefleet:http_responses_total")) < 2:
        assert time.monotonic() < deadline, "one ingress's responses only"
        time.sleep(1)
    assert len(ingresses("pagefleet:client_time_to_first_token_seconds_count")) == 2


def test_a_trace_joins_the_ingress_and_replica_processes(
    served: Served, collector: tuple[Collector, str]
) -> None:
    """The ingress's span and its `route` (in an ingress replica's process) are the parents
    of the replica's `llm_request` (in an engine replica's process), the parent of the
    `engine_core` span (in that replica's engine core process), which holds the phases."""
    c, _ = collector
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    body |= {"stream": True, "ignore_eos": True}
    headers = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01", "X-Request-Id": "trace-e2e"}
    with httpx.stream(
        "POST", f"{served.url}/v1/chat/completions", json=body, headers=headers, timeout=120
    ) as r:
        assert r.status_code == 200
        r.read()

    def ours() -> dict[str, Any]:
        return {s.name: s for s in c.spans if s.trace_id.hex() == CLIENT_TRACE}

    deadline = time.monotonic() + 60  # each process exports its spans in batches
    while len(ours()) < 7:
        assert time.monotonic() < deadline, sorted(ours())
        time.sleep(0.5)
    spans = ours()
    ingress, route = spans["POST /v1/chat/completions"], spans["route"]
    llm, core = spans["llm_request"], spans["engine_core"]
    assert ingress.parent_span_id.hex() == CLIENT_SPAN
    assert route.parent_span_id == ingress.span_id
    assert llm.parent_span_id == route.span_id
    assert core.parent_span_id == llm.span_id
    assert all(spans[p].parent_span_id == core.span_id for p in ("queue", "prefill", "decode"))
    for span in (ingress, route, llm):
        replica = {a.key: a.value.string_value for a in span.attributes}["pagefleet.replica"]
        assert replica == r.headers["x-pagefleet-replica"]
