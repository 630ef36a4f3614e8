"""Requests built to stall or bloat an ingress or a replica, over real HTTP (uvicorn) and
an in-process engine replica: each is refused by name, or bounded, and the server goes on.

- Output constraints past the configured sizes (choices, their bytes, a regex, grammar or
  schema) are 400s naming the field; a nested counted repetition is refused by the check
  against the vocabulary, and 20 distinct ones leave the process's memory where it was.
- Constraints are checked on the validator's own threads: a busy tokenizer thread does
  not hold up a constraint's verdict.
- Stop strings past their length limits; tool-call arguments nested past `max_json_depth`.
- The request time-out counts from arrival (a request stuck behind the tokenizer is a
  408), and a body trickled slower than `body_read_timeout_s` is a 408.
- `cache_salt` is taken on both endpoints; /metrics needs the key by default when there
  is one.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from pagefleet.cluster.http import create_app
from tests.cluster.http.test_api import Harness, assert_error, serving
from tests.cluster.http.test_limits_auth_overload import _InfoOnly
from tests.conftest import tokenizer_for

ENGINE = {
    "num_kv_blocks": 160,
    "block_size": 8,
    "max_num_seqs": 2,
    "max_model_len": 1024,
    "num_threads": 1,
}
LIMITS = {
    "max_stop_length": 8,
    "max_stop_total_length": 12,
    "max_choices": 4,
    "max_choice_bytes": 32,
    "max_grammar_bytes": 64,
    "max_json_depth": 8,
    "body_read_timeout_s": 1.0,
}
MB = 1024 * 1024
KEY = "sk-pagefleet-test-77ab"
OK = {"model": "tiny", "prompt": "x", "max_tokens": 2}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def h(llama_dir: str) -> Iterator[Harness]:
    with serving(llama_dir, {"engine": ENGINE, "limits": LIMITS}, request_timeout_s=60) as h:
        yield h


def post(h: Harness, body: dict[str, Any], path: str = "/v1/completions") -> httpx.Response:
    return h.client.post(path, json=body)


def check(h: Harness, body: dict[str, Any], message: str, param: str, path: str = "") -> None:
    err = assert_error(post(h, body, path or "/v1/completions"), 400)
    assert (err["message"], err["param"]) == (message, param)


def resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_constraints_past_their_sizes_are_400s_naming_the_field(h: Harness) -> None:
    check(
        h,
        {**OK, "guided_choice": ["a", "b", "c", "d", "e"]},
        "guided_choice: 5 choices exceed the limit of 4 (max_choices)",
        "guided_choice",
    )
    check(
        h,
        {**OK, "guided_choice": ["a" * 20, "b" * 13]},
        "guided_choice: the choices take 33 bytes, more than the limit of 32 (max_choice_bytes)",
        "guided_choice",
    )
    check(
        h,
        {**OK, "guided_regex": "a" * 65},
        "guided_regex: the regex takes 65 bytes, more than the limit of 64 (max_grammar_bytes)",
        "guided_regex",
    )
    check(
        h,
        {**CHAT, "structured_outputs": {"grammar": "start: " + " | ".join(['"ab"'] * 12)}},
        "structured_outputs: the grammar takes 88 bytes, more than the limit of 64 "
        "(max_grammar_bytes)",
        "structured_outputs",
        "/v1/chat/completions",
    )
    # Within the limits: answered, one of the choices.
    r = post(h, {**OK, "max_tokens": 16, "guided_choice": ["yes", "no"]})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("yes", "no")
    h.check_idle_and_balanced()


def test_regex_bombs_are_400s_and_leave_memory_flat(h: Harness) -> None:
    def bomb(i: int) -> httpx.Response:
        return post(h, {**OK, "guided_regex": f"(a{{1000}}){{{1000 + i}}}"})

    assert_error(bomb(-1), 400)  # the vocabulary is built on first use
    before = resident()
    for i in range(20):
        err = assert_error(bomb(i), 400)
        assert (err["message"], err["param"]) == (
            "guided_regex: structured outputs: invalid regex: lexer error: too many "
            "expressions constructed",
            "guided_regex",
        )
    assert resident() - before < 150 * MB
    h.check_idle_and_balanced()


def test_a_constraint_is_checked_while_the_tokenizer_thread_is_busy(h: Harness) -> None:
    assert post(h, {**OK, "guided_choice": ["a", "b"]}).status_code == 200  # warm
    serving_ = h.app.state.serving
    release = threading.Event()
    busy = asyncio.run_coroutine_threadsafe(serving_.tokenizer.run(release.wait, 30), h.loop)
    try:
        err = assert_error(post(h, {**OK, "guided_regex": "a(b"}), 400)
        assert err["param"] == "guided_regex" and "unclosed group" in err["message"]
        assert not busy.done()  # answered while the tokenizer thread was still held
    finally:
        release.set()
    busy.result(10)


def test_stop_strings_past_their_lengths_are_400s(h: Harness) -> None:
    check(
        h,
        {**OK, "stop": ["x" * 9]},
        "a stop string of 9 characters exceeds the limit of 8 (max_stop_length)",
        "stop",
    )
    check(
        h,
        {**CHAT, "stop": ["x" * 7, "y" * 6]},
        "the stop strings take 13 characters, more than the limit of 12 (max_stop_total_length)",
        "stop",
        "/v1/chat/completions",
    )
    assert post(h, {**OK, "stop": ["x" * 8, "y" * 4]}).status_code == 200


def _with_call(arguments: str) -> dict[str, Any]:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return {
        **CHAT,
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        ],
    }


def test_deeply_nested_tool_call_arguments_are_a_400_naming_them(h: Harness) -> None:
    param = "messages.1.tool_calls.0.function.arguments"
    check(
        h,
        _with_call("[" * 50000),
        f"{param}: JSON nested more than 8 levels deep (max_json_depth)",
        param,
        "/v1/chat/completions",
    )
    # Brackets inside strings do not count; 8 levels are allowed.
    fine = '{"a": ' * 7 + '"[[[[[[[[[["' + "}" * 7
    assert post(h, _with_call(fine), "/v1/chat/completions").status_code == 200


def test_cache_salt_is_taken_by_both_endpoints(h: Harness) -> None:
    assert post(h, {**OK, "cache_salt": "tenant-a"}).status_code == 200
    r = post(h, {**CHAT, "cache_salt": "tenant-a"}, "/v1/chat/completions")
    assert r.status_code == 200
    err = assert_error(post(h, {**OK, "cache_salt": ""}), 400)
    assert err["param"] == "cache_salt"


def test_a_body_slower_than_its_deadline_is_a_408(h: Harness) -> None:
    host, port = h.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n{"
        )
        answer = b""
        while chunk := s.recv(65536):  # the server closes the connection after its answer
            answer += chunk
        head = answer.decode("latin-1")
    assert head.startswith("HTTP/1.1 408"), head
    assert "the request body did not arrive within 1 s (body_read_timeout_s)" in head


def test_the_time_out_counts_from_arrival(llama_dir: str) -> None:
    config = {"engine": ENGINE}
    with serving(llama_dir, config, request_timeout_s=0.5) as h:
        release = threading.Event()
        busy = asyncio.run_coroutine_threadsafe(
            h.app.state.serving.tokenizer.run(release.wait, 20), h.loop
        )
        try:
            err = assert_error(post(h, OK), 408)
            assert err["message"] == (
                "the request did not finish within the server's request_timeout_s (0.5 s) "
                "and was cancelled"
            )
            assert not busy.done()  # answered at its deadline, not once the thread was free
        finally:
            release.set()
        busy.result(10)
        assert post(h, OK).status_code == 200  # in time once the thread is free
        h.check_idle_and_balanced()


def test_metrics_need_the_key_by_default_when_there_is_one(llama_dir: str) -> None:
    def status(protect: bool | None, auth: bool) -> int:
        kwargs = {} if protect is None else {"protect_metrics": protect}
        app = create_app(_InfoOnly(), tokenizer_for(llama_dir), "tiny", api_key=KEY, **kwargs)
        headers = {"Authorization": f"Bearer {KEY}"} if auth else {}

        async def run() -> int:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
                return (await c.get("/metrics", headers=headers)).status_code

        return asyncio.run(run())

    assert status(None, auth=False) == 401
    assert status(None, auth=True) == 200
    assert status(False, auth=False) == 200  # opened on purpose
    app = create_app(_InfoOnly(), tokenizer_for(llama_dir), "tiny")  # no key: open

    async def open_metrics() -> int:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return (await c.get("/metrics")).status_code

    assert asyncio.run(open_metrics()) == 200
