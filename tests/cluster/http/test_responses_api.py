"""`/v1/responses` over real HTTP (uvicorn, an in-process engine replica), through the
official `openai` client's `responses` resource.

The oracle is the chat endpoint: a response is the chat completion of its
conversation, so its greedy text and its prompt's token count equal the chat
completion's of the same messages. Random weights make tool calls and JSON valid only
through the grammars (`tool_choice: required`, a named function, `text.format`). The
harness checks every block free when the module's server stops.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.cluster.http.test_api import Harness, assert_error, serving

ENGINE = {"num_kv_blocks": 512, "block_size": 8, "max_num_seqs": 16, "max_model_len": 1024}
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"type": "string", "enum": ["c", "f"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOL = {"type": "function", "name": "get_weather", "parameters": WEATHER}
GREEDY: dict[str, Any] = {"temperature": 0, "max_output_tokens": 12}


@pytest.fixture(scope="module")
def srv(llama_dir: str) -> Iterator[Harness]:
    with serving(llama_dir, {"engine": ENGINE}) as h:
        yield h


@pytest.fixture(scope="module")
def client(srv: Harness) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0) as c:
        yield c


def chat(client: openai.OpenAI, messages: list[dict[str, Any]], max_tokens: int = 12) -> Any:
    return client.chat.completions.create(
        model="tiny",
        messages=messages,
        temperature=0,
        max_tokens=max_tokens,  # type: ignore[arg-type]
    )


def test_plain_response_is_the_chat_completion_of_its_conversation(client: openai.OpenAI) -> None:
    r = client.responses.create(
        model="tiny", input="Tell me a story", instructions="Be brief", **GREEDY
    )
    c = chat(
        client,
        [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Tell me a story"}],
    )
    assert r.id.startswith("resp_") and r.object == "response"
    assert r.output_text == c.choices[0].message.content
    assert r.status == ("incomplete" if c.choices[0].finish_reason == "length" else "completed")
    assert r.usage is not None and c.usage is not None
    assert (r.usage.input_tokens, r.usage.output_tokens) == (
        c.usage.prompt_tokens,
        c.usage.completion_tokens,
    )
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"


def test_stream_has_the_responses_events_and_the_same_text(client: openai.OpenAI) -> None:
    plain = client.responses.create(model="tiny", input="Once upon", **GREEDY)
    events = list(client.responses.create(model="tiny", input="Once upon", stream=True, **GREEDY))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        f"response.{plain.status}",  # completed, or incomplete when max_output_tokens cut it
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == plain.output_text == events[-4].text  # type: ignore[union-attr]
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == text and final.usage.output_tokens == plain.usage.output_tokens  # type: ignore[union-attr]


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_gives_a_function_call(client: openai.OpenAI, stream: bool) -> None:
    args = {
        "model": "tiny",
        "input": "Weather in Paris?",
        "tools": [TOOL],
        "tool_choice": "required",
    }
    args |= {"temperature": 0, "max_output_tokens": 64, "parallel_tool_calls": False}
    if not stream:
        r = client.responses.create(**args)
    else:
        events = list(client.responses.create(stream=True, **args))
        kinds = [e.type for e in events]
        assert "response.function_call_arguments.delta" in kinds
        done = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert len(done) == 1
        deltas = "".join(
            e.delta for e in events if e.type == "response.function_call_arguments.delta"
        )
        assert deltas == done[0].arguments  # type: ignore[union-attr]
        r = events[-1].response  # type: ignore[union-attr]
    calls = [i for i in r.output if i.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)


def test_named_tool_choice_and_the_function_call_output_turn(client: openai.OpenAI) -> None:
    first = client.responses.create(
        model="tiny",
        input="Weather in Paris?",
        tools=[TOOL],  # type: ignore[list-item]
        tool_choice={"type": "function", "name": "get_weather"},
        temperature=0,
        max_output_tokens=64,
    )
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    second = client.responses.create(
        model="tiny",
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}],
        tools=[TOOL],  # type: ignore[list-item]
        **GREEDY,
    )
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": call.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"},
    ]
    c = client.chat.completions.create(
        model="tiny",
        messages=messages,
        tools=[{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}],  # type: ignore[arg-type, list-item]
        temperature=0,
        max_tokens=12,
    )
    assert second.usage is not None and c.usage is not None
    assert second.usage.input_tokens == c.usage.prompt_tokens
    assert second.output_text == (c.choices[0].message.content or "")


def test_previous_response_id_continues_the_conversation_then_retrieve_and_delete(
    client: openai.OpenAI,
) -> None:
    first = client.responses.create(model="tiny", input="Hello there", **GREEDY)
    second = client.responses.create(
        model="tiny", input="And then?", previous_response_id=first.id, **GREEDY
    )
    c = chat(
        client,
        [
            {"role": "user", "content": "Hello there"},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And then?"},
        ],
    )
    assert second.previous_response_id == first.id
    assert second.output_text == c.choices[0].message.content
    assert second.usage is not None and c.usage is not None
    assert second.usage.input_tokens == c.usage.prompt_tokens
    got = client.responses.retrieve(second.id)
    assert got.id == second.id and got.output_text == second.output_text
    client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="tiny", input="x", previous_response_id=second.id, **GREEDY)


def test_store_false_keeps_nothing(client: openai.OpenAI) -> None:
    r = client.responses.create(model="tiny", input="Hi", store=False, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_text_format_json_schema(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "name": "weather", "schema": WEATHER, "strict": True}
    r = client.responses.create(
        model="tiny", input="Weather?", text={"format": fmt}, temperature=0, max_output_tokens=64
    )  # type: ignore[arg-type]
    jsonschema.validate(json.loads(r.output_text), WEATHER)
    assert r.text.format.type == "json_schema"  # type: ignore[union-attr]


def test_another_api_key_sees_no_stored_response(llama_dir: str) -> None:
    with serving(llama_dir, {"engine": ENGINE}) as h:
        r = h.client.post(
            "/v1/responses", json={"input": "Hi", **GREEDY}, headers={"Authorization": "Bearer a"}
        )
        assert r.status_code == 200, r.text
        rid = r.json()["id"]
        assert (
            h.client.get(f"/v1/responses/{rid}", headers={"Authorization": "Bearer a"}).status_code
            == 200
        )
        other = h.client.get(f"/v1/responses/{rid}", headers={"Authorization": "Bearer b"})
        assert_error(other, 404, rid)


def test_errors_name_the_responses_fields(srv: Harness) -> None:
    def post(body: dict[str, Any]) -> httpx.Response:
        return srv.client.post("/v1/responses", json=body)

    assert (
        assert_error(post({"input": "Hi", "max_output_tokens": 5000}), 400)["param"]
        == "max_output_tokens"
    )
    assert (
        assert_error(post({"input": "Hi", "previous_response_id": "resp_x"}), 404)["param"]
        == "previous_response_id"
    )
    assert assert_error(post({"input": []}), 400)["param"] == "input"
    assert assert_error(post({"input": "Hi", "model": "other"}), 404)["param"] == "model"
    bad_choice = post(
        {"input": "Hi", "tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}}
    )
    assert assert_error(bad_choice, 400)["param"] == "tool_choice"
    bad_item = post({"input": [{"type": "reasoning_x", "summary": []}]})
    assert assert_error(bad_item, 400)["param"].startswith("input")
    assert_error(srv.client.delete("/v1/responses/resp_none"), 404)


# OpenAI's ResponseCreateParams (openai-python 3.63.0) that the server does not model,
# each with a value that asks for something: every one is a 400 naming it.
UNMODELLED_RESPONSE_FIELDS = {
    "background": True,
    "conversation": "conv_1",
    "context_management": [{"type": "compaction"}],
    "include": ["message.output_text.logprobs"],
    "max_tool_calls": 3,
    "prompt": {"id": "pmpt_1"},
    "reasoning": {"effort": "high"},
    "service_tier": "flex",
    "stream_options": {"include_obfuscation": False},
    "top_logprobs": 2,
    "truncation": "auto",
}


@pytest.mark.parametrize("field", sorted(UNMODELLED_RESPONSE_FIELDS))
def test_unmodelled_fields_are_refused_by_name(srv: Harness, field: str) -> None:
    body = {"input": "Hi", "max_output_tokens": 4, field: UNMODELLED_RESPONSE_FIELDS[field]}
    assert assert_error(srv.client.post("/v1/responses", json=body), 400)["param"] == field


def test_fields_that_ask_for_nothing_pass(srv: Harness) -> None:
    body = {"input": "Hi", "max_output_tokens": 4, "include": [], "truncation": "disabled"}
    assert srv.client.post("/v1/responses", json=body).status_code == 200


def test_the_store_is_bounded_in_count_and_age() -> None:
    import asyncio

    from pagefleet.cluster.http.responses import MemoryResponseStore, StoredResponse

    async def run() -> None:
        store = MemoryResponseStore(max_entries=2, ttl_s=3600)
        for rid in ("a", "b", "c"):
            await store.put(rid, StoredResponse("k", {"id": rid}))
        assert len(store) == 2 and await store.get("k", "a") is None
        assert (await store.get("k", "c")) == StoredResponse("k", {"id": "c"})
        assert await store.get("other key", "c") is None
        assert not await store.delete("other key", "c") and await store.delete("k", "c")
        aged = MemoryResponseStore(max_entries=10, ttl_s=1e-9)
        await aged.put("a", StoredResponse("k", {"id": "a"}))
        assert await aged.get("k", "a") is None and len(aged) == 0

    asyncio.run(run())


def test_a_client_leaving_a_stream_frees_its_blocks_and_stores_nothing(srv: Harness) -> None:
    body = {"input": "Once upon a time", "stream": True, "max_output_tokens": 500}
    with srv.client.stream("POST", "/v1/responses", json=body) as r:
        lines = r.iter_lines()
        created = next(line for line in lines if line.startswith("data: "))
    rid = json.loads(created[len("data: ") :])["response"]["id"]
    srv.check_idle_and_balanced()
    assert_error(srv.client.get(f"/v1/responses/{rid}"), 404)
