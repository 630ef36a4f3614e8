"""Every request field OpenAI's and vLLM's schemas know, sent to a real ingress: each is
honoured (a behavioural check where one is cheap) or refused with a 400 naming it.

The field lists are kept here with their sources, so a field a new version adds
fails `test_every_known_field_has_a_fate` until it is given one:

- OpenAI: openai-python 3.63.0's `CompletionCreateParams` and `ChatCompletionCreateParams`
  (`openai/types/completion_create_params.py`, `openai/types/chat/completion_create_params.py`);
- vLLM: `vllm/entrypoints/openai/protocol.py`'s `CompletionRequest` and
  `ChatCompletionRequest` at vLLM 0.10.2 (commit 0052bed), with 0.11's additions
  (`structured_outputs`, `return_token_ids`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from tests.cluster.http.test_api import ENGINE, Harness, serving
from tests.conftest import tokenizer_for

OPENAI_VERSION = "3.63.0"
OPENAI_COMPLETION = [
    "best_of",
    "echo",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "max_tokens",
    "model",
    "n",
    "presence_penalty",
    "prompt",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "suffix",
    "temperature",
    "top_p",
    "user",
]
OPENAI_CHAT = [
    "audio",
    "frequency_penalty",
    "function_call",
    "functions",
    "logit_bias",
    "logprobs",
    "max_completion_tokens",
    "max_tokens",
    "messages",
    "metadata",
    "modalities",
    "model",
    "moderation",
    "n",
    "parallel_tool_calls",
    "prediction",
    "presence_penalty",
    "prompt_cache_key",
    "prompt_cache_options",
    "prompt_cache_retention",
    "reasoning_effort",
    "response_format",
    "safety_identifier",
    "seed",
    "service_tier",
    "stop",
    "store",
    "stream",
    "stream_options",
    "temperature",
    "tool_choice",
    "tools",
    "top_logprobs",
    "top_p",
    "user",
    "verbosity",
    "web_search_options",
]
VLLM_VERSION = "0.10.2 (0052bed) + 0.11 additions"
_VLLM_SAMPLING = [
    "use_beam_search",
    "top_k",
    "min_p",
    "repetition_penalty",
    "length_penalty",
    "stop_token_ids",
    "include_stop_str_in_output",
    "ignore_eos",
    "min_tokens",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "truncate_prompt_tokens",
    "allowed_token_ids",
    "prompt_logprobs",
]
_VLLM_EXTRA = [
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_decoding_backend",
    "guided_whitespace_pattern",
    "priority",
    "request_id",
    "logits_processors",
    "return_tokens_as_token_ids",
    "cache_salt",
    "kv_transfer_params",
    "vllm_xargs",
    "add_special_tokens",
    "structured_outputs",
    "return_token_ids",
]
VLLM_COMPLETION = [
    *[
        "model",
        "prompt",
        "prompt_embeds",
        "best_of",
        "echo",
        "frequency_penalty",
        "logit_bias",
        "logprobs",
        "max_tokens",
        "n",
        "presence_penalty",
        "seed",
        "stop",
        "stream",
        "stream_options",
        "suffix",
        "temperature",
        "top_p",
        "user",
    ],
    *_VLLM_SAMPLING,
    *_VLLM_EXTRA,
]
VLLM_CHAT = [
    *[
        "messages",
        "model",
        "frequency_penalty",
        "logit_bias",
        "logprobs",
        "top_logprobs",
        "max_tokens",
        "max_completion_tokens",
        "n",
        "presence_penalty",
        "response_format",
        "seed",
        "stop",
        "stream",
        "stream_options",
        "temperature",
        "top_p",
        "tools",
        "tool_choice",
        "reasoning_effort",
        "include_reasoning",
        "parallel_tool_calls",
        "user",
        "best_of",
        "bad_words",
        "echo",
        "add_generation_prompt",
        "continue_final_message",
        "documents",
        "chat_template",
        "chat_template_kwargs",
        "mm_processor_kwargs",
        "structural_tag",
    ],
    *_VLLM_SAMPLING,
    *_VLLM_EXTRA,
]

# pagefleet's own beyond both lists: vLLM's chat-only bad_words, on completions too.
OWN_COMPLETION = {"bad_words"}

Check = Callable[[dict[str, Any]], None]
REFUSED = "refused"
# What `cache_salt` does is another part's (prefix-cache isolation); expected honoured.
OTHERS = {"cache_salt"}

TOOL = {
    "type": "function",
    "function": {"name": "f", "parameters": {"type": "object", "properties": {}}},
}


def text_of(body: dict[str, Any]) -> str:
    c = body["choices"][0]
    return c["text"] if "text" in c else c["message"]["content"]


def _usage(key: str, n: int) -> Check:
    def check(body: dict[str, Any]) -> None:
        assert body["usage"][key] == n

    return check


def _n(n: int) -> Check:
    def check(body: dict[str, Any]) -> None:
        assert len(body["choices"]) == n

    return check


def _text(expected: str) -> Check:
    def check(body: dict[str, Any]) -> None:
        assert text_of(body) == expected

    return check


def _prompt_logprobs(body: dict[str, Any]) -> None:
    table = body["choices"][0]["prompt_logprobs"] if "text" in body["choices"][0] else None
    table = table if table is not None else body["prompt_logprobs"]
    assert table[0] is None and len(table) == body["usage"]["prompt_tokens"]
    assert all(any(e["rank"] == 1 for e in row.values()) for row in table[1:])


def _token_ids(body: dict[str, Any]) -> None:
    c = body["choices"][0]
    prompt = c.get("prompt_token_ids") or body.get("prompt_token_ids")
    assert len(prompt) == body["usage"]["prompt_tokens"]
    assert len(c["token_ids"]) == body["usage"]["completion_tokens"]


def _logprobs(body: dict[str, Any]) -> None:
    assert body["choices"][0]["logprobs"] is not None


def _stream_usage(body: dict[str, Any]) -> None:
    chunks = body["chunks"]
    assert all(c["usage"] is not None for c in chunks)
    assert chunks[-1]["usage"]["completion_tokens"] == 4


def _ok(body: dict[str, Any]) -> None:
    del body


# field -> (its value, more fields it needs, what the answer must show or REFUSED)
SHARED: dict[str, tuple[Any, dict[str, Any], Check | str]] = {
    "model": ("tiny", {}, _ok),
    "frequency_penalty": (0.5, {}, _ok),
    "presence_penalty": (0.5, {}, _ok),
    "logit_bias": ({"77": 100}, {}, "token77"),
    "n": (2, {}, _n(2)),
    "seed": (3, {}, _ok),
    "stop": (["\n"], {}, _ok),
    "stream": (True, {}, _ok),
    "stream_options": (
        {"include_usage": True, "continuous_usage_stats": True},
        {"stream": True},
        _stream_usage,
    ),
    "temperature": (0.7, {}, _ok),
    "top_p": (0.9, {}, _ok),
    "user": ("someone", {}, _ok),
    "use_beam_search": (True, {"n": 2}, _n(2)),
    "top_k": (5, {}, _ok),
    "min_p": (0.1, {}, _ok),
    "repetition_penalty": (1.1, {}, _ok),
    "length_penalty": (0.5, {}, REFUSED),  # without use_beam_search it would do nothing
    "stop_token_ids": ([5], {}, _ok),
    "include_stop_str_in_output": (True, {"stop": ["a"]}, _ok),
    "ignore_eos": (True, {}, _usage("completion_tokens", 4)),
    "min_tokens": (2, {}, _ok),
    "skip_special_tokens": (False, {}, _ok),
    "spaces_between_special_tokens": (False, {}, REFUSED),
    "truncate_prompt_tokens": (
        2,
        {"prompt": "import os\nimport sys", "messages": [{"role": "user", "content": "hi"}]},
        _usage("prompt_tokens", 2),
    ),
    "allowed_token_ids": ([77], {}, "token77"),
    "prompt_logprobs": (2, {}, _prompt_logprobs),
    "bad_words": (["the"], {}, _ok),
    "response_format": ({"type": "json_object"}, {}, _ok),
    "guided_json": ({"type": "object"}, {}, _ok),
    "guided_regex": ("ab", {}, _text("ab")),
    "guided_choice": (["yes", "no"], {}, _ok),
    "guided_grammar": ('start: "xy"', {}, _text("xy")),
    "structured_outputs": ({"choice": ["zz"]}, {}, _text("zz")),
    "guided_decoding_backend": ("xgrammar", {}, REFUSED),
    "guided_whitespace_pattern": (" ", {}, REFUSED),
    "priority": (1, {}, REFUSED),
    "request_id": ("mine", {}, _ok),  # accepted; the engine's id is the server's own
    "logits_processors": (["my.Processor"], {}, REFUSED),
    "return_tokens_as_token_ids": (True, {}, REFUSED),
    "cache_salt": ("a-salt-of-forty-three-characters-or-so-xyz", {}, _ok),
    "kv_transfer_params": ({"do_remote_prefill": True}, {}, REFUSED),
    "vllm_xargs": ({"k": 1}, {}, REFUSED),
    "add_special_tokens": (True, {}, _ok),
    "return_token_ids": (True, {}, _token_ids),
}
COMPLETION: dict[str, tuple[Any, dict[str, Any], Check | str]] = {
    **SHARED,
    "prompt": ("def", {}, _ok),
    "best_of": (2, {}, _n(1)),
    "echo": (True, {}, _ok),
    "logprobs": (2, {}, _logprobs),
    "max_tokens": (3, {}, _usage("completion_tokens", 3)),
    "suffix": ("end", {}, REFUSED),
    "prompt_embeds": ("AAAA", {}, REFUSED),
}
CHAT: dict[str, tuple[Any, dict[str, Any], Check | str]] = {
    **SHARED,
    "messages": ([{"role": "user", "content": "hello"}], {}, _ok),
    "audio": ({"voice": "alloy", "format": "wav"}, {}, REFUSED),
    "function_call": ("auto", {}, REFUSED),
    "functions": ([{"name": "f"}], {}, REFUSED),
    "logprobs": (True, {}, _logprobs),
    "top_logprobs": (2, {"logprobs": True}, _logprobs),
    "max_completion_tokens": (3, {}, _usage("completion_tokens", 3)),
    "max_tokens": (3, {}, _usage("completion_tokens", 3)),
    "metadata": ({"k": "v"}, {}, REFUSED),
    "modalities": (["text", "audio"], {}, REFUSED),
    "moderation": ({"input": {"mode": "block"}}, {}, REFUSED),
    "parallel_tool_calls": (False, {"tools": [TOOL]}, _ok),
    "prediction": ({"type": "content", "content": "x"}, {}, REFUSED),
    "prompt_cache_key": ("bucket-1", {}, _ok),
    "prompt_cache_options": ({"mode": "explicit"}, {}, REFUSED),
    "prompt_cache_retention": ("24h", {}, REFUSED),
    "reasoning_effort": ("low", {}, _ok),
    "safety_identifier": ("user-hash", {}, _ok),
    "service_tier": ("flex", {}, REFUSED),
    "store": (True, {}, REFUSED),
    "tool_choice": ("none", {"tools": [TOOL]}, _ok),
    "tools": ([TOOL], {}, _ok),
    "verbosity": ("low", {}, REFUSED),
    "web_search_options": ({}, {}, REFUSED),
    "include_reasoning": (False, {}, _ok),
    "best_of": (2, {}, REFUSED),
    "echo": (True, {}, REFUSED),
    "add_generation_prompt": (False, {}, _ok),
    "continue_final_message": (True, {}, REFUSED),
    "documents": ([{"title": "t", "text": "x"}], {}, _ok),
    "chat_template": ("{{ messages }}", {}, REFUSED),
    "chat_template_kwargs": ({"enable_thinking": False}, {}, _ok),
    "mm_processor_kwargs": ({"num_crops": 4}, {}, REFUSED),
    "structural_tag": ('{"structures": []}', {}, REFUSED),
}
BASE_COMPLETION = {"prompt": "def", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
BASE_CHAT = {
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 4,
    "temperature": 0,
    "ignore_eos": True,
}


@pytest.fixture(scope="module")
def srv(llama_dir: str) -> Iterator[Harness]:
    engine = {**ENGINE, "num_kv_blocks": 128, "max_model_len": 512}  # room for the tools
    with serving(llama_dir, {"engine": engine, "limits": {"max_n": 4}}) as h:
        yield h


def test_every_known_field_has_a_fate() -> None:
    assert set(OPENAI_COMPLETION) | set(VLLM_COMPLETION) | OWN_COMPLETION == set(COMPLETION)
    assert set(OPENAI_CHAT) | set(VLLM_CHAT) == set(CHAT)


def _send(srv: Harness, path: str, body: dict[str, Any]) -> tuple[httpx.Response, dict[str, Any]]:
    r = srv.client.post(path, json=body)
    if r.status_code != 200 or not body.get("stream"):
        return r, r.json()
    lines = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return r, {"chunks": [json.loads(x) for x in lines[:-1]]}


def _walk(srv: Harness, llama_dir: str, path: str, base: dict, table: dict, name: str) -> None:
    value, more, expect = table[name]
    r, body = _send(srv, path, {**base, **more, name: value})
    if expect == REFUSED:
        assert r.status_code == 400, (name, r.text)
        assert body["error"]["param"] == name, body
        return
    assert r.status_code == 200, (name, r.text)
    if expect == "token77":
        assert text_of(body) == tokenizer_for(llama_dir).decode([77] * 4)
    else:
        expect(body)


@pytest.mark.parametrize("name", sorted(COMPLETION))
def test_completion_field(srv: Harness, llama_dir: str, name: str) -> None:
    _walk(srv, llama_dir, "/v1/completions", BASE_COMPLETION, COMPLETION, name)


@pytest.mark.parametrize("name", sorted(CHAT))
def test_chat_field(srv: Harness, llama_dir: str, name: str) -> None:
    _walk(srv, llama_dir, "/v1/chat/completions", BASE_CHAT, CHAT, name)


def test_unknown_fields_are_dropped_and_accepted_values_pass(srv: Harness) -> None:
    r = srv.client.post(
        "/v1/chat/completions",
        json={
            **BASE_CHAT,
            "not_a_field_anyone_knows": 1,
            "store": False,
            "service_tier": "auto",
            "priority": 0,
            "modalities": ["text"],
            "guided_decoding_backend": "guidance",
            "spaces_between_special_tokens": True,
        },
    )
    assert r.status_code == 200, r.text
    srv.check_idle_and_balanced()


def test_continue_final_message_continues_the_last_message(srv: Harness, llama_dir: str) -> None:
    msgs = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "The answer is"},
    ]
    body = {**BASE_CHAT, "messages": msgs, "return_token_ids": True}
    r = srv.client.post(
        "/v1/chat/completions",
        json={**body, "continue_final_message": True, "add_generation_prompt": False},
    )
    assert r.status_code == 200, r.text
    prompt = tokenizer_for(llama_dir).decode(r.json()["prompt_token_ids"])
    assert prompt.endswith("<|im_start|>assistant\nThe answer is")
    err = srv.client.post(
        "/v1/chat/completions", json={**body, "continue_final_message": True}
    ).json()["error"]
    assert err["param"] == "continue_final_message"
    assert "add_generation_prompt" in err["message"]


def test_chat_template_kwargs_outside_the_allow_list_are_refused(srv: Harness) -> None:
    r = srv.client.post(
        "/v1/chat/completions", json={**BASE_CHAT, "chat_template_kwargs": {"tokenize": True}}
    )
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "chat_template_kwargs"
    r = srv.client.post(
        "/v1/chat/completions", json={**BASE_CHAT, "chat_template_kwargs": {"custom": 1}}
    )
    assert r.status_code == 400


def test_streamed_token_ids_add_up(srv: Harness) -> None:
    _, body = _send(
        srv,
        "/v1/chat/completions",
        {**BASE_CHAT, "stream": True, "return_token_ids": True},
    )
    chunks = body["chunks"]
    assert "prompt_token_ids" in chunks[0] and "prompt_token_ids" not in chunks[1]
    ids = [t for c in chunks for ch in c["choices"] for t in ch["token_ids"]]
    assert len(ids) == 4
    _, body = _send(
        srv, "/v1/completions", {**BASE_COMPLETION, "stream": True, "return_token_ids": True}
    )
    ids = [t for c in body["chunks"] for ch in c["choices"] for t in ch["token_ids"]]
    assert len(ids) == 4
    srv.check_idle_and_balanced()


def test_beam_search_equals_the_engines_own(srv: Harness, llama_dir: str) -> None:
    from pagefleet.engine import LLM, BeamSearchParams

    body = {**BASE_COMPLETION, "use_beam_search": True, "n": 3, "max_tokens": 6}
    r = srv.client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    texts = [c["text"] for c in r.json()["choices"]]
    with LLM(model=llama_dir, **ENGINE) as llm:
        params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
        expected = [s.text for s in llm.beam_search(["def"], params)[0].sequences]
    assert texts == expected
    chat = {**BASE_CHAT, "use_beam_search": True, "n": 2, "length_penalty": 0.7}
    r = srv.client.post("/v1/chat/completions", json=chat)
    assert r.status_code == 200 and len(r.json()["choices"]) == 2
    r = srv.client.post("/v1/completions", json={**body, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "use_beam_search"
    # A length penalty past the range is a 400, not a float overflow in the ranking.
    r = srv.client.post("/v1/chat/completions", json={**chat, "length_penalty": -5.6e16})
    assert r.status_code == 400 and r.json()["error"]["param"] == "length_penalty"
    srv.check_idle_and_balanced()
