"""LangChain's `ChatOpenAI` against the real server (uvicorn, an in-process engine replica).

Two of LangChain's everyday calls over `/v1/chat/completions`, each parsed by LangChain
itself: `bind_tools([tool], tool_choice=<the tool's name>)` must give a tool call whose
arguments LangChain reads into a dict (an invalid one lands in `invalid_tool_calls`),
and `with_structured_output(Model)` must give a validated `Model`; the same over
`/v1/responses` (`use_responses_api=True`). The weights are
random, so only the grammars (a named tool's arguments schema, `response_format`'s
strict JSON schema) make either valid. The harness checks every block free when the
module's server stops.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Literal

import pytest
from langchain_core.language_models import BaseChatModel
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, ConfigDict, Field

from tests.cluster.http.test_api import Harness, serving

ENGINE = {"num_kv_blocks": 256, "block_size": 8, "max_num_seqs": 8, "max_model_len": 1024}


class Weather(BaseModel):
    """The weather in a city."""

    model_config = ConfigDict(extra="forbid")
    city: Annotated[str, Field(max_length=8, description="the city")]
    unit: Literal["c", "f"]


@pytest.fixture(scope="module")
def srv(llama_dir: str) -> Iterator[Harness]:
    with serving(llama_dir, {"engine": ENGINE}) as h:
        yield h


@pytest.fixture(scope="module")
def chat(srv: Harness) -> Iterator[BaseChatModel]:
    model = ChatOpenAI(
        model="tiny",
        base_url=f"{srv.url}/v1",
        api_key="unused",
        temperature=0,
        max_tokens=96,
        max_retries=0,
    )
    yield model


def test_bind_tools_with_a_named_tool_gives_a_parsed_call(chat: BaseChatModel) -> None:
    bound = chat.bind_tools([Weather], tool_choice="Weather")
    message = bound.invoke("What is the weather in Paris?")
    assert message.invalid_tool_calls == []
    [call] = message.tool_calls
    assert call["name"] == "Weather" and call["id"]
    assert Weather.model_validate(call["args"]) == Weather(**call["args"])
    assert message.response_metadata["finish_reason"] == "stop"  # OpenAI's, for a forced call


def test_bind_tools_streamed_gives_the_same_call(chat: BaseChatModel) -> None:
    bound = chat.bind_tools([Weather], tool_choice="Weather")
    whole = bound.invoke("What is the weather in Rome?")
    chunks = list(bound.stream("What is the weather in Rome?"))
    message = chunks[0]
    for chunk in chunks[1:]:
        message = message + chunk
    assert message.invalid_tool_calls == []
    [call] = message.tool_calls
    [expected] = whole.tool_calls
    assert (call["name"], call["args"]) == (expected["name"], expected["args"])
    assert len(message.tool_call_chunks) == 1  # the fragments joined under one index
    assert sum(bool(c.tool_call_chunks) for c in chunks) > 2  # the arguments came in fragments


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output_gives_a_validated_object(chat: BaseChatModel, method: str) -> None:
    structured = chat.with_structured_output(Weather, method=method)
    prompt = "Weather in Oslo? Answer in JSON with keys city and unit."
    out = structured.invoke(prompt)
    assert isinstance(out, Weather)
    assert len(out.city) <= 8 and out.unit in ("c", "f")


def test_with_structured_output_include_raw_keeps_the_message(chat: BaseChatModel) -> None:
    structured = chat.with_structured_output(Weather, method="json_schema", include_raw=True)
    out = structured.invoke("Weather in Lima?")
    assert out["parsing_error"] is None and isinstance(out["parsed"], Weather)
    assert Weather.model_validate_json(out["raw"].content) == out["parsed"]


def test_the_responses_api_binds_tools_and_structures_output(srv: Harness) -> None:
    """`ChatOpenAI(use_responses_api=True)`: the same two calls over `/v1/responses`."""
    chat = ChatOpenAI(
        model="tiny",
        base_url=f"{srv.url}/v1",
        api_key="unused",
        temperature=0,
        max_tokens=96,
        max_retries=0,
        use_responses_api=True,
    )
    message = chat.bind_tools([Weather], tool_choice="Weather").invoke("Weather in Bern?")
    assert message.invalid_tool_calls == []
    [call] = message.tool_calls
    assert call["name"] == "Weather" and isinstance(Weather.model_validate(call["args"]), Weather)
    out = chat.with_structured_output(Weather, method="json_schema").invoke("Weather in Kyiv?")
    assert isinstance(out, Weather)
