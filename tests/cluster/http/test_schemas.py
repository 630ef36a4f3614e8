"""JSON schemas as vLLM's default backend (xgrammar, strict) reads them: an object
schema that lists its properties yields no other key unless it says so.

The grammar itself is checked (the matcher's next-token mask after the listed
properties allows only the closing brace), then a request whose sampler is pushed
hard towards more keys (logit_bias on ",") still gets only the listed ones, for
`guided_json`, `response_format` and a named tool's arguments; the lenient setting
gives the JSON Schema reading back."""

from __future__ import annotations

import json
from collections.abc import Iterator

import llguidance.hf
import numpy as np
import pytest
from llguidance import LLMatcher

from pagefleet.cluster.http.schemas import closed_objects
from pagefleet.engine import StructuredOutputsParams
from pagefleet.engine.grammar_spec import grammar_spec
from tests.cluster.http.test_api import ENGINE, Harness, serving
from tests.conftest import tokenizer_for

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 3}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
}


def test_closing_reaches_every_nested_object_and_keeps_what_the_schema_says() -> None:
    schema = {
        "type": "object",
        "properties": {
            "properties": {"type": "object", "properties": {"a": {"type": "integer"}}},
            "items": {"type": "array", "items": {"properties": {"b": {}}}},
            "open": {"type": "object", "properties": {}, "additionalProperties": True},
            "any": {"type": "object"},
        },
        "$defs": {"D": {"properties": {"c": {}}}},
        "anyOf": [{"properties": {"d": {}}}],
    }
    closed = json.loads(closed_objects(schema))
    assert closed["additionalProperties"] is False
    props = closed["properties"]
    assert "additionalProperties" not in props  # a property named "properties" is a name
    assert props["properties"]["additionalProperties"] is False
    assert props["items"]["items"]["additionalProperties"] is False
    assert props["open"]["additionalProperties"] is True
    assert "additionalProperties" not in props["any"]  # lists nothing: any object
    assert closed["$defs"]["D"]["additionalProperties"] is False
    assert closed["anyOf"][0]["additionalProperties"] is False
    assert list(closed) == [*schema, "additionalProperties"]  # key order kept


def _allowed_after(llama_dir: str, schema: str, text: str) -> set[str]:
    tok = tokenizer_for(llama_dir)
    matcher = LLMatcher(
        llguidance.hf.from_tokenizer(tok), grammar_spec(StructuredOutputsParams(json=schema))
    )
    assert matcher.consume_tokens(tok.encode(text)), matcher.get_error()
    words = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint32)
    allowed = [t for t in range(len(tok)) if words[t // 32] >> (t % 32) & 1]
    return {tok.decode([t]) for t in allowed}


def test_the_grammar_allows_only_the_closing_brace_after_the_listed_properties(
    llama_dir: str,
) -> None:
    head = '{"city":"Rom","unit":"c"'
    closed = _allowed_after(llama_dir, closed_objects(SCHEMA), head)
    assert closed == {"}"}
    lenient = _allowed_after(llama_dir, json.dumps(SCHEMA), head)
    assert "}" in lenient and any(t.startswith(",") for t in lenient)


@pytest.fixture(scope="module")
def strict(llama_dir: str) -> Iterator[Harness]:
    engine = {**ENGINE, "num_kv_blocks": 128, "max_model_len": 512}  # room for the tools
    with serving(llama_dir, {"engine": engine}) as h:
        yield h


@pytest.fixture(scope="module")
def comma(llama_dir: str) -> str:
    ids = tokenizer_for(llama_dir).encode(",")
    assert len(ids) == 1
    return str(ids[0])


def _pushed(comma: str) -> dict:
    return {"temperature": 0, "max_tokens": 60, "logit_bias": {comma: 30}}


@pytest.mark.parametrize(
    "field",
    [
        {"guided_json": SCHEMA},
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "w", "schema": SCHEMA},
            }
        },
    ],
)
def test_structured_output_gets_only_the_listed_keys(
    strict: Harness, comma: str, field: dict
) -> None:
    r = strict.client.post("/v1/completions", json={"prompt": "def", **_pushed(comma), **field})
    assert r.status_code == 200, r.text
    assert set(json.loads(r.json()["choices"][0]["text"])) == {"city", "unit"}


def test_a_named_tool_gets_only_its_listed_arguments(strict: Harness, comma: str) -> None:
    tool = {"type": "function", "function": {"name": "weather", "parameters": SCHEMA}}
    r = strict.client.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [tool],
            "tool_choice": {"type": "function", "function": {"name": "weather"}},
            **_pushed(comma),
        },
    )
    assert r.status_code == 200, r.text
    call = r.json()["choices"][0]["message"]["tool_calls"][0]["function"]
    assert set(json.loads(call["arguments"])) == {"city", "unit"}
    strict.check_idle_and_balanced()


def test_the_lenient_setting_reads_schemas_as_json_schema_does(llama_dir: str, comma: str) -> None:
    from pagefleet.cluster.config import ChatSettings

    lenient = ChatSettings(disable_additional_properties=False)
    with serving(llama_dir, {"engine": ENGINE}, chat_settings=lenient) as h:
        r = h.client.post(
            "/v1/completions", json={"prompt": "def", **_pushed(comma), "guided_json": SCHEMA}
        )
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["text"]
        assert text.startswith('{"city":') and '"unit":' in text
        assert text.count(",") > 1  # pushed past the listed keys: JSON Schema allows it
