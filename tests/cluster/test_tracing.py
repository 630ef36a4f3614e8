"""OpenTelemetry traces exported over OTLP/gRPC to a collector in this process.

A streamed chat request that carries a client's `traceparent` makes one trace: the
ingress's server span (the client's span its parent), its `route` span (the router's
choice, naming the replica), the replica's `llm_request` (the route its parent, its
context carried in the `ReplicaRequest`), and the engine core's `engine_core` (the
`llm_request` its parent, its context carried in the core's `AddRequest`) with the
core's `queue`, `prefill` and `decode` below it; `llm_request` and `engine_core`
carry vLLM's `gen_ai.*` attributes. Here the engine core runs in a child process of
the test's (as in a Serve replica), so its spans come from that process.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from pagefleet.cluster import tracing
from tests.cluster.http.test_api import free_port, serving

ENGINE = {"num_kv_blocks": 64, "block_size": 8, "max_num_seqs": 16, "max_model_len": 128}
CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[Any] = []

    def Export(self, request: Any, context: Any) -> Any:
        for resource in request.resource_spans:
            for scope in resource.scope_spans:
                self.spans.extend(scope.spans)
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture
def collector() -> Iterator[tuple[Collector, str]]:
    server = grpc.server(futures.ThreadPoolExecutor(2))
    c = Collector()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(c, server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    yield c, f"127.0.0.1:{port}"
    server.stop(None)


def test_one_streamed_request_is_one_trace_across_ingress_replica_and_engine(
    llama_dir: str, collector: tuple[Collector, str]
) -> None:
    c, endpoint = collector
    config = {"engine": ENGINE, "observability": {"otlp_traces_endpoint": endpoint}}
    with serving(llama_dir, config, in_process=False, otlp_traces_endpoint=endpoint) as h:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
        body |= {"stream": True, "ignore_eos": True, "temperature": 0}
        body["stream_options"] = {"include_usage": True}
        parent = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01", "X-Request-Id": "tr-1"}
        with h.client.stream("POST", "/v1/chat/completions", json=body, headers=parent) as r:
            assert r.status_code == 200
            chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    usage = chunks[-1]["usage"]
    deadline = time.monotonic() + 30
    while len(c.spans) < 7:
        tracing.force_flush()
        assert time.monotonic() < deadline, [s.name for s in c.spans]
        time.sleep(0.2)
    by_name = {s.name: s for s in c.spans}
    assert len(by_name) == len(c.spans) == 7
    ingress, route = by_name["POST /v1/chat/completions"], by_name["route"]
    llm, core = by_name["llm_request"], by_name["engine_core"]
    assert {s.trace_id.hex() for s in c.spans} == {CLIENT_TRACE}
    assert ingress.parent_span_id.hex() == CLIENT_SPAN
    assert route.parent_span_id == ingress.span_id
    assert llm.parent_span_id == route.span_id
    assert core.parent_span_id == llm.span_id
    for phase in ("queue", "prefill", "decode"):
        assert by_name[phase].parent_span_id == core.span_id
        assert core.start_time_unix_nano <= by_name[phase].start_time_unix_nano
        assert by_name[phase].end_time_unix_nano <= core.end_time_unix_nano
    assert by_name["queue"].end_time_unix_nano <= by_name["prefill"].start_time_unix_nano + 1000
    assert by_name["prefill"].end_time_unix_nano <= by_name["decode"].start_time_unix_nano + 1000
    for span in (llm, core):
        attrs = {a.key: a.value for a in span.attributes}
        assert attrs["gen_ai.request.id"].string_value == "tr-1"
        assert attrs["gen_ai.usage.prompt_tokens"].int_value == usage["prompt_tokens"]
        assert attrs["gen_ai.usage.completion_tokens"].int_value == 5
        assert attrs["gen_ai.request.max_tokens"].int_value == 5
        assert attrs["gen_ai.request.temperature"].double_value == 0
        assert attrs["gen_ai.request.n"].int_value == 1
        assert attrs["gen_ai.response.model"].string_value == "tiny"
        for key in ("time_in_queue", "time_to_first_token", "e2e"):
            assert attrs[f"gen_ai.latency.{key}"].double_value >= 0
        for key in ("time_in_model_prefill", "time_in_model_decode"):
            assert attrs[f"gen_ai.latency.{key}"].double_value >= 0
    core_attrs = {a.key: a.value for a in core.attributes}
    assert core_attrs["gen_ai.latency.time_in_model_inference"].double_value == pytest.approx(
        (by_name["decode"].end_time_unix_nano - by_name["prefill"].start_time_unix_nano) / 1e9,
        abs=1e-3,
    )
    route_attrs = {a.key: a.value for a in route.attributes}
    assert route_attrs["pagefleet.replica"].string_value == "r0"
    assert route_attrs["gen_ai.request.id"].string_value == "tr-1"
    assert route.end_time_unix_nano <= llm.end_time_unix_nano
    ingress_attrs = {a.key: a.value for a in ingress.attributes}
    assert ingress_attrs["http.response.status_code"].int_value == 200
    assert ingress_attrs["pagefleet.replica"].string_value == "r0"
