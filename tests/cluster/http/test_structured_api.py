"""Structured output and tool calling over real HTTP, through the official `openai` client.

The model has random weights, so free text is nonsense: every constrained answer
below is valid only because the grammar made it so (the same seeds without the
constraint give invalid JSON). Seeded requests are deterministic whatever they are
batched with, so nothing here passes by luck or fails by it. The harness checks
every block free when the module's server stops.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Annotated, Any, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from tests.cluster.http.test_api import Harness, serving

ENGINE = {"num_kv_blocks": 512, "block_size": 8, "max_num_seqs": 16, "max_model_len": 1024}
SEEDS = range(5)

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"type": "string", "enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"tz": {"type": "string", "maxLength": 5}},
    "required": ["tz"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Item(BaseModel):
    model_config = ConfigDict(extra="forbid")  # additionalProperties: false, bounded

    name: Annotated[str, Field(max_length=6)]
    qty: Annotated[int, Field(ge=0, le=99)]
    kind: Literal["tool", "part", "kit"]


class Order(BaseModel):
    model_config = ConfigDict(extra="forbid")

    items: Annotated[list[Item], Field(min_length=1, max_length=3)]
    urgent: bool


@pytest.fixture(scope="module")
def srv(llama_dir: str) -> Iterator[Harness]:
    with serving(llama_dir, {"engine": ENGINE, "limits": {"max_n": 4}}) as h:
        yield h


@pytest.fixture(scope="module")
def client(srv: Harness) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0) as c:
        yield c


def is_json(text: str | None) -> bool:
    try:
        json.loads(text or "")
    except ValueError:
        return False
    return True


def test_the_sdks_parse_returns_the_pydantic_object(client: openai.OpenAI) -> None:
    for seed in SEEDS:
        got = client.chat.completions.parse(
            model="tiny",
            messages=[{"role": "user", "content": "An order, please."}],
            response_format=Order,
            temperature=1.0,
            seed=seed,
            max_completion_tokens=400,
        )
        choice = got.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Order)
        assert choice.message.parsed == Order.model_validate_json(choice.message.content or "")


def test_a_json_schema_holds_for_every_seed_and_sample_and_not_without_it(
    client: openai.OpenAI,
) -> None:
    schema = Order.model_json_schema()
    fmt = {"type": "json_schema", "json_schema": {"name": "order", "schema": schema}}
    free = []
    for seed in SEEDS:
        body: dict[str, Any] = dict(
            model="tiny", prompt="order:", temperature=1.0, seed=seed, max_tokens=300, n=4
        )
        got = client.completions.create(**body, extra_body={"response_format": fmt})
        assert [c.finish_reason for c in got.choices] == ["stop"] * 4
        for c in got.choices:
            jsonschema.validate(json.loads(c.text), schema)
        free += [c.text for c in client.completions.create(**{**body, "max_tokens": 60}).choices]
    assert not any(is_json(t) for t in free)  # the grammar did the work


def test_json_object_regex_and_choice(client: openai.OpenAI) -> None:
    stopped = 0
    for seed in SEEDS:
        common: dict[str, Any] = dict(model="tiny", temperature=1.0, seed=seed)
        # Any object: nothing bounds its strings, and a random model writes long ones.
        # Every answer that ends is an object; one cut short is an object's beginning.
        obj = client.chat.completions.create(
            **common,
            messages=ASK,
            response_format={"type": "json_object"},
            max_completion_tokens=300,
        ).choices[0]
        text = obj.message.content or ""
        if obj.finish_reason == "stop":
            stopped += 1
            assert isinstance(json.loads(text), dict)
        else:
            assert obj.finish_reason == "length" and text.startswith("{") and not is_json(text)
        text = client.completions.create(
            **common, prompt="id:", max_tokens=20, extra_body={"guided_regex": r"[0-9]{3}-[a-z]{2}"}
        ).choices[0]
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", text.text), text.text
        assert text.finish_reason == "stop"
        pick = client.chat.completions.create(
            **common,
            messages=ASK,
            max_completion_tokens=20,
            extra_body={"structured_outputs": {"choice": ["yes", "no", "it rains"]}},
        ).choices[0]
        assert pick.message.content in ("yes", "no", "it rains")
    assert stopped >= 1  # seeded: the same seeds, the same answers


def check_calls(calls: list[Any], names: set[str] | None = None) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in (names or SCHEMAS)
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_makes_valid_calls_and_the_tool_loop_goes_on(client: openai.OpenAI) -> None:
    for seed in SEEDS:
        got = client.chat.completions.create(
            model="tiny",
            messages=ASK,
            tools=TOOLS,
            tool_choice="required",
            temperature=1.0,
            seed=seed,
            max_completion_tokens=300,
        ).choices[0]
        assert got.finish_reason == "tool_calls"
        assert got.message.content is None
        check_calls(got.message.tool_calls or [])
    single = client.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=1.0,
        seed=3,
        max_completion_tokens=300,
    ).choices[0]
    assert len(single.message.tool_calls or []) == 1
    # The loop: the calls and their results go back through the chat template.
    history = [
        *ASK,
        single.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": single.message.tool_calls[0].id, "content": "sunny"},
    ]
    after = client.chat.completions.create(
        model="tiny", messages=history, tools=TOOLS, tool_choice="none", max_completion_tokens=5
    )
    first = client.chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, tool_choice="none", max_completion_tokens=5
    )
    assert after.choices[0].message.tool_calls in (None, [])
    assert after.usage.prompt_tokens > first.usage.prompt_tokens


def stream_calls(client: openai.OpenAI, **kwargs: Any) -> tuple[str, list[dict], str | None]:
    """A streamed answer's content, its calls assembled from their deltas, and its finish."""
    content, calls, finish = "", [], None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            if d.id is not None:  # a call's first part: id, type and name
                assert d.index == len(calls) and d.type == "function"
                calls.append({"id": d.id, "name": d.function.name, "arguments": ""})
            else:
                assert d.function.name is None
            calls[d.index]["arguments"] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, calls, finish


def test_a_named_function_streams_its_arguments_and_matches_the_whole_answer(
    client: openai.OpenAI,
) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed in SEEDS:
        kwargs: dict[str, Any] = dict(
            model="tiny",
            messages=ASK,
            tools=TOOLS,
            tool_choice=named,
            temperature=1.0,
            seed=seed,
            max_completion_tokens=200,
        )
        whole = client.chat.completions.create(**kwargs).choices[0]
        assert whole.finish_reason == "stop"  # as OpenAI's, for a forced call
        check_calls(whole.message.tool_calls or [], {"get_weather"})
        content, calls, finish = stream_calls(client, **kwargs)
        assert (content, finish) == ("", "stop")
        assert [(c["name"], c["arguments"]) for c in calls] == [
            (c.function.name, c.function.arguments) for c in whole.message.tool_calls or []
        ]


def test_auto_reads_the_models_tool_call_blocks(client: openai.OpenAI) -> None:
    # A random model never writes a <tool_call> block of itself: a regex makes it, and
    # `auto` must find it in the text, streamed or not.
    block = (
        r'<tool_call>\n\{"name": "get_time", "arguments": \{"tz": "[a-z]{1,5}"\}\}\n</tool_call>'
    )
    kwargs: dict[str, Any] = dict(
        model="tiny",
        messages=ASK,
        tools=TOOLS,
        temperature=1.0,
        seed=7,
        max_completion_tokens=60,
        extra_body={"guided_regex": r"Sure\." + block},
    )
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls"
    assert whole.message.content == "Sure."
    check_calls(whole.message.tool_calls or [], {"get_time"})
    content, calls, finish = stream_calls(client, **kwargs)
    assert (content, finish) == ("Sure.", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls or []
    ]
    # Without tools the same text is just content.
    plain = client.chat.completions.create(**{**kwargs, "tools": None}).choices[0]
    assert plain.message.tool_calls in (None, []) and "<tool_call>" in (plain.message.content or "")
