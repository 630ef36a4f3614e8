"""The OpenAI API over a real HTTP server (uvicorn) and an in-process engine replica (no Ray).

The server's oracle is the engine: greedy completions over HTTP equal `LLM.generate`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagefleet.cluster.config import ServeConfig
from pagefleet.cluster.http import create_app
from pagefleet.cluster.replica import LLMReplica, LocalBackend
from pagefleet.engine import LLM, SamplingParams
from tests.conftest import PROMPT_TEXTS, tokenizer_for

ENGINE = {"num_kv_blocks": 64, "block_size": 8, "max_num_seqs": 16, "max_model_len": 128}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Harness:
    url: str
    replica: LLMReplica
    loop: asyncio.AbstractEventLoop
    client: httpx.Client
    app: Any = None

    def run(self, coro: Any, timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def check_idle_and_balanced(self) -> None:
        result = self.run(self.replica.check_block_accounting())
        assert result["free"] == result["total"] == self.replica.info_.num_kv_blocks


@contextlib.contextmanager
def serving(
    llama_dir: str,
    config: dict[str, Any],
    check_on_exit: bool = True,
    backend_class: type[LocalBackend] = LocalBackend,
    in_process: bool = True,
    **app_kwargs: Any,
) -> Iterator[Harness]:
    """`create_app` over a replica of `config` in this process (its engine core in a
    thread, or in a child process with in_process=False), served by uvicorn in a thread;
    on exit the replica must be idle with every block free (unless check_on_exit=False)."""
    import uvicorn

    cfg = ServeConfig.model_validate({"model": llama_dir, "served_model_name": "tiny", **config})
    replica = LLMReplica(cfg, "r0", in_process=in_process)
    app = create_app(
        backend_class(replica), tokenizer_for(llama_dir), "tiny", cfg.limits, **app_kwargs
    )
    loops: list[asyncio.AbstractEventLoop] = []

    async def remember_loop() -> None:
        loops.append(asyncio.get_running_loop())

    app.router.on_startup.append(remember_loop)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=url, timeout=60) as client:
            h = Harness(url, replica, loops[0], client, app)
            yield h
            if check_on_exit:
                h.check_idle_and_balanced()
            h.run(replica.shutdown())
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture(scope="module")
def srv(llama_dir: str) -> Iterator[Harness]:
    with serving(llama_dir, {"engine": ENGINE, "limits": {"max_n": 4}}) as h:
        yield h


@pytest.fixture(scope="module")
def llm(llama_dir: str) -> Iterator[LLM]:
    with LLM(model=llama_dir, **ENGINE) as llm:
        yield llm


def post(srv: Harness, path: str, body: dict[str, Any]) -> httpx.Response:
    return srv.client.post(path, json=body)


def sse_events(srv: Harness, path: str, body: dict[str, Any]) -> list[Any]:
    events = []
    with srv.client.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: ") :]
                events.append(data if data == "[DONE]" else json.loads(data))
    assert events[-1] == "[DONE]"
    return events[:-1]


def assert_error(r: httpx.Response, status: int, *needles: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status
    for n in needles:
        assert n in err["message"], err["message"]
    return err


# -- endpoints ---------------------------------------------------------------------


def test_models_health_version_openapi(srv: Harness) -> None:
    models = srv.client.get("/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == ["tiny"]
    assert models["data"][0]["max_model_len"] == 128
    assert srv.client.get("/health").status_code == 200
    assert srv.client.get("/version").json()["version"]
    paths = srv.client.get("/openapi.json").json()["paths"]
    for p in (
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/tokenize",
        "/detokenize",
        "/health",
        "/metrics",
        "/version",
    ):
        assert p in paths


def test_greedy_completions_equal_llm_generate(srv: Harness, llm: LLM, llama_dir: str) -> None:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    texts = PROMPT_TEXTS[:6]
    expected = llm.generate(texts, params, use_tqdm=False)
    body = {
        "model": "tiny",
        "prompt": texts,
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
    }
    r = post(srv, "/v1/completions", body)
    assert r.status_code == 200, r.text
    resp = r.json()
    assert resp["object"] == "text_completion" and resp["id"].startswith("cmpl-")
    assert [c["index"] for c in resp["choices"]] == list(range(6))
    tok = tokenizer_for(llama_dir)
    for choice, out in zip(resp["choices"], expected, strict=True):
        assert choice["text"] == out.outputs[0].text
        assert tok.encode(choice["text"], add_special_tokens=False) == tok.encode(
            out.outputs[0].text, add_special_tokens=False
        )
        assert choice["finish_reason"] == "length"
    assert resp["usage"] == {
        "prompt_tokens": sum(len(o.prompt_token_ids) for o in expected),
        "completion_tokens": 72,
        "total_tokens": sum(len(o.prompt_token_ids) for o in expected) + 72,
    }
    # Token-id prompts give the same tokens.
    ids = expected[1].prompt_token_ids
    r = post(srv, "/v1/completions", {**body, "prompt": ids, "logprobs": 0})
    lp = r.json()["choices"][0]["logprobs"]
    assert "".join(lp["tokens"]) == expected[1].outputs[0].text


def test_streamed_completion_equals_unstreamed(srv: Harness) -> None:
    body = {"prompt": "def f(x):", "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    full = post(srv, "/v1/completions", body).json()
    events = sse_events(
        srv, "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}}
    )
    chunks, usage = events[:-1], events[-1]
    assert all(c["object"] == "text_completion" and c["usage"] is None for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == full["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert usage["choices"] == [] and usage["usage"] == full["usage"]
    assert len({c["id"] for c in events}) == 1


def test_chat_greedy_and_stream(srv: Harness, llm: LLM, llama_dir: str) -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "Say hi"}]},
    ]
    tok = tokenizer_for(llama_dir)
    prompt = tok.apply_chat_template(
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    ids = tok.encode(prompt, add_special_tokens=False)
    expected = llm.generate(
        [ids], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False
    )[0]
    body = {
        "model": "tiny",
        "messages": messages,
        "max_completion_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
    }
    resp = post(srv, "/v1/chat/completions", body).json()
    assert resp["object"] == "chat.completion"
    assert resp["choices"][0]["message"] == {
        "role": "assistant",
        "content": expected.outputs[0].text,
        "tool_calls": [],  # as vLLM's: always there, empty without calls
    }
    assert resp["usage"]["prompt_tokens"] == len(ids)
    assert resp["usage"]["completion_tokens"] == 8
    events = sse_events(srv, "/v1/chat/completions", {**body, "stream": True})
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
    assert text == expected.outputs[0].text
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_n_seed_and_usage(srv: Harness) -> None:
    body = {
        "prompt": ["import os", "x = 1"],
        "n": 2,
        "max_tokens": 5,
        "temperature": 0.9,
        "seed": 7,
        "ignore_eos": True,
    }
    a = post(srv, "/v1/completions", body).json()
    b = post(srv, "/v1/completions", body).json()
    assert [c["index"] for c in a["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in a["choices"]] == [c["text"] for c in b["choices"]]
    assert a["usage"]["completion_tokens"] == 20


def test_logprobs_shapes(srv: Harness, llm: LLM) -> None:
    body = {
        "prompt": "class A:",
        "max_tokens": 4,
        "temperature": 0,
        "logprobs": 3,
        "ignore_eos": True,
    }
    lp = post(srv, "/v1/completions", body).json()["choices"][0]["logprobs"]
    expected = llm.generate(
        ["class A:"],
        SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 4
    for i, tid in enumerate(expected.token_ids):
        assert lp["token_logprobs"][i] == pytest.approx(expected.logprobs[i][tid], abs=1e-5)
        assert 3 <= len(lp["top_logprobs"][i]) <= 4
    assert lp["text_offset"][0] == 0
    chat = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    content = post(srv, "/v1/chat/completions", chat).json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 3
    for item in content:
        assert set(item) == {"token", "logprob", "bytes", "top_logprobs"}
        assert len(item["top_logprobs"]) == 2
        assert item["top_logprobs"][0]["logprob"] >= item["top_logprobs"][1]["logprob"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("max_tokens", [1, 2, 16])
def test_echo_scores_the_prompt_as_llm_generate_does(
    srv: Harness, llm: LLM, stream: bool, max_tokens: int
) -> None:
    """echo + logprobs (lm-eval's loglikelihood): the prompt's logprobs are the engine's,
    whatever max_tokens, streamed or not (the first prompt token has none)."""
    prompt = [11, 12, 13, 40, 7]
    expected = llm.generate(
        [prompt],
        SamplingParams(
            temperature=0, max_tokens=max_tokens, logprobs=1, prompt_logprobs=1, ignore_eos=True
        ),
        use_tqdm=False,
    )[0]
    body = {
        "prompt": prompt,
        "echo": True,
        "logprobs": 1,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    if stream:
        lps: list[float | None] = []
        for event in sse_events(srv, "/v1/completions", {**body, "stream": True}):
            for c in event["choices"]:
                if c["logprobs"] is not None:
                    lps += c["logprobs"]["token_logprobs"]
    else:
        lps = post(srv, "/v1/completions", body).json()["choices"][0]["logprobs"]["token_logprobs"]
    want = [None] + [expected.prompt_logprobs[i][t] for i, t in enumerate(prompt) if i > 0]
    want += [
        expected.outputs[0].logprobs[i][t] for i, t in enumerate(expected.outputs[0].token_ids)
    ]
    assert len(lps) == len(prompt) + max_tokens
    assert lps[0] is None and None not in lps[1:]
    assert lps == pytest.approx(want, abs=1e-5)


def test_echo_and_stop(srv: Harness) -> None:
    base = {"prompt": "def f(x):", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    plain = post(srv, "/v1/completions", base).json()["choices"][0]["text"]
    echoed = post(srv, "/v1/completions", {**base, "echo": True}).json()["choices"][0]["text"]
    assert echoed == "def f(x):" + plain
    stop = plain[3:5]
    cut = post(srv, "/v1/completions", {**base, "stop": [stop]}).json()["choices"][0]
    assert cut["text"] == plain[: plain.index(stop)]
    assert cut["finish_reason"] == "stop" and cut["stop_reason"] == stop
    kept = post(srv, "/v1/completions", {**base, "stop": stop, "include_stop_str_in_output": True})
    assert kept.json()["choices"][0]["text"] == plain[: plain.index(stop) + len(stop)]


def test_tokenize_detokenize(srv: Harness, llama_dir: str) -> None:
    tok = tokenizer_for(llama_dir)
    r = post(srv, "/tokenize", {"model": "tiny", "prompt": "import os"}).json()
    assert r["tokens"] == tok.encode("import os") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 128
    back = post(srv, "/detokenize", {"model": "tiny", "tokens": r["tokens"]}).json()
    assert back["prompt"] == tok.decode(r["tokens"])
    chat = post(srv, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 2


# -- errors ---------------------------------------------------------------------------


def test_errors(srv: Harness) -> None:
    ok = {"prompt": "x", "max_tokens": 4}
    assert_error(post(srv, "/v1/completions", {**ok, "model": "gpt-4"}), 404, "gpt-4")
    assert (
        post(srv, "/v1/completions", {**ok, "model": "gpt-4"}).json()["error"]["type"]
        == "NotFoundError"
    )
    assert_error(post(srv, "/v1/completions", {**ok, "max_tokens": -1}), 400, "max_tokens")
    assert_error(post(srv, "/v1/completions", {**ok, "temperature": -0.5}), 400, "temperature")
    assert_error(post(srv, "/v1/completions", {**ok, "n": 5}), 400, "n (5)", "4")
    assert_error(post(srv, "/v1/completions", {**ok, "logprobs": 50}), 400, "logprobs")
    err = assert_error(post(srv, "/v1/completions", {**ok, "prompt": ""}), 400)
    assert (err["message"], err["param"]) == (
        "prompt: String should have at least 1 character; or Input should be a valid list",
        "prompt",
    )
    assert_error(post(srv, "/v1/completions", {**ok, "prompt": [10**7]}), 400, "token ids")
    assert_error(post(srv, "/v1/completions", {**ok, "best_of": 3, "stream": True}), 400, "best_of")
    long = post(srv, "/v1/completions", {"prompt": "def " * 20, "max_tokens": 120})
    err = assert_error(long, 400, "128", "120")
    assert err["param"] == "max_tokens"
    assert_error(
        post(srv, "/v1/chat/completions", {"messages": [], "max_tokens": 2}), 400, "messages"
    )
    assert_error(post(srv, "/v1/completions", {**ok, "max_tokens": "many"}), 400, "max_tokens")
    assert_error(post(srv, "/v1/completions", {"max_tokens": 3}), 400, "prompt")
    r = srv.client.post(
        "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert_error(r, 400, "JSON")
    bad_role = {"messages": [{"role": "wizard", "content": "x"}]}
    assert_error(post(srv, "/v1/chat/completions", bad_role), 400, "role")
    assert_error(post(srv, "/detokenize", {"tokens": [10**7]}), 400, "tokens")
    srv.check_idle_and_balanced()


def test_client_disconnect_mid_stream_frees_blocks(srv: Harness) -> None:
    body = {
        "prompt": "while True:",
        "max_tokens": 100,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with srv.client.stream("POST", "/v1/completions", json=body) as r:
        got: list[str] = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                got.append(line)
            if len(got) == 3:
                break
    assert len(got) == 3
    # The stream was closed after 3 of 100 tokens; the engine request must be gone.
    deadline = time.monotonic() + 20
    while srv.replica.engine.stats().num_running:
        assert time.monotonic() < deadline, "the aborted request kept running"
        time.sleep(0.05)
    srv.check_idle_and_balanced()


def test_metrics_count_exactly_what_responses_reported(srv: Harness) -> None:
    def scrape() -> dict[str, float]:
        text = srv.client.get("/metrics").text
        values: dict[str, float] = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.labels.get("model_name") == "tiny" and "finished_reason" not in s.labels:
                    values[s.name] = values.get(s.name, 0.0) + s.value
        return values

    before = scrape()
    usage = post(
        srv, "/v1/completions", {"prompt": ["a", "import os"], "max_tokens": 6, "ignore_eos": True}
    ).json()["usage"]
    after = scrape()
    assert (
        after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"]
        == usage["prompt_tokens"]
    )
    assert (
        after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
        == usage["completion_tokens"]
    )
    assert (
        after["vllm:e2e_request_latency_seconds_count"]
        - before["vllm:e2e_request_latency_seconds_count"]
        == 2
    )
    assert after["vllm:num_requests_running"] == 0
    assert after["pagefleet:kv_blocks_free"] == after["pagefleet:kv_blocks_total"] == 64


def test_output_constraints_and_tools_are_checked_before_anything_is_queued(
    srv: Harness,
) -> None:
    """A constraint the grammar library rejects, two constraints at once, a tool choice
    that names no tool: each is a 400 naming the field, and no engine request is made
    (the harness checks every block free on exit)."""
    msgs = [{"role": "user", "content": "hi"}]
    chat = {"messages": msgs, "max_tokens": 2}
    comp = {"prompt": "x", "max_tokens": 2}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}
    cases = [
        ("/v1/completions", {**comp, "guided_regex": "a("}, "guided_regex", "guided_regex: "),
        (
            "/v1/chat/completions",
            {**chat, "response_format": bad_schema},
            "response_format",
            "response_format: structured outputs: invalid JSON schema: Invalid type: wat",
        ),
        (
            "/v1/completions",
            {**comp, "guided_grammar": "start: x"},
            "guided_grammar",
            "guided_grammar: ",
        ),
        (
            "/v1/completions",
            {**comp, "guided_choice": []},
            "guided_choice",
            "guided_choice: choice must be a non-empty list of non-empty strings",
        ),
        (
            "/v1/completions",
            {**comp, "guided_json": "{nope"},
            "guided_json",
            "guided_json: the JSON schema is not valid JSON",
        ),
        (
            "/v1/completions",
            {**comp, "guided_regex": "a+", "guided_choice": ["a"]},
            "guided_choice",
            "give one output constraint, not several (guided_regex and guided_choice)",
        ),
        (
            "/v1/chat/completions",
            {
                **chat,
                "response_format": {"type": "json_object"},
                "structured_outputs": {"regex": "a"},
            },
            "structured_outputs",
            "give one output constraint, not several",
        ),
        (
            "/v1/completions",
            {**comp, "structured_outputs": {"regex": "a", "choice": ["b"]}},
            "structured_outputs",
            "structured_outputs: structured outputs take exactly one of",
        ),
        (
            "/v1/chat/completions",
            {**chat, "tool_choice": "required"},
            "tool_choice",
            'tool_choice other than "none" needs tools',
        ),
        (
            "/v1/chat/completions",
            {
                **chat,
                "tools": [tool],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            "tool_choice",
            "tool_choice names 'g', which is not among tools",
        ),
        (
            "/v1/chat/completions",
            {**chat, "tools": [tool, tool]},
            "tools",
            "tools must have distinct function names",
        ),
        (
            "/v1/chat/completions",
            {**chat, "tools": [tool], "tool_choice": "required", "guided_regex": "a"},
            "guided_regex",
            "tool_choice 'required' sets the output's form itself",
        ),
        (
            "/v1/chat/completions",
            {**chat, "functions": [tool["function"]]},
            "functions",
            "functions (use tools) is not supported by this server",
        ),
        (
            "/v1/chat/completions",
            {**chat, "function_call": "auto"},
            "function_call",
            "function_call (use tool_choice) is not supported by this server",
        ),
    ]
    for path, body, param, message in cases:
        err = assert_error(post(srv, path, body), 400, message)
        assert err["param"] == param, (body, err)
    # vLLM's options-only object beside a response_format is no second constraint.
    so = {
        "response_format": {"type": "json_object"},
        "structured_outputs": {"disable_any_whitespace": True},
    }
    assert post(srv, "/v1/completions", {**comp, **so}).status_code == 200
    # What asks for nothing passes: plain text, no tools.
    ok = {**chat, "response_format": {"type": "text"}, "tool_choice": "none", "tools": []}
    assert post(srv, "/v1/chat/completions", ok).status_code == 200
    assert (
        post(srv, "/v1/completions", {**comp, "response_format": {"type": "text"}}).status_code
        == 200
    )


def test_text_parts_join_with_newlines_and_min_tokens_is_named(srv: Harness) -> None:
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    as_parts = post(srv, "/tokenize", {"messages": [{"role": "user", "content": parts}]})
    as_text = post(srv, "/tokenize", {"messages": [{"role": "user", "content": "first\nsecond"}]})
    assert as_parts.json()["tokens"] == as_text.json()["tokens"]
    err = assert_error(
        post(srv, "/v1/completions", {"prompt": "x", "max_tokens": 2, "min_tokens": 3}), 400
    )
    assert (err["param"], err["message"]) == (
        "min_tokens",
        "min_tokens (3) must be <= max_tokens (2)",
    )
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "min_tokens": 4}
    assert assert_error(post(srv, "/v1/chat/completions", body), 400)["param"] == "min_tokens"


def test_no_response_is_larger_than_its_bound(srv: Harness, llama_dir: str) -> None:
    """`response_size.response_bytes` bounds every non-streamed body (what the ingress
    holds whole): echoed prompts, several prompts and samples, both logprob forms."""
    from pagefleet.cluster.http.response_size import TokenWidths, response_bytes

    tok = tokenizer_for(llama_dir)
    widths = TokenWidths.of(tok, srv.replica.info_.vocab_size)
    assert widths.json_chars >= 3 and widths.utf8_bytes >= 1
    prompts = ["def f(x):", "import os\nimport sys", "\u00e9\u00e8\u4e2d\t\x01"]
    for body in (
        {"prompt": prompts, "max_tokens": 9, "n": 2, "logprobs": 4, "echo": True},
        {"prompt": prompts[:1], "max_tokens": 20, "logprobs": 0},
        {"prompt": [[5, 6, 7, 8]], "max_tokens": 5, "echo": True, "logprobs": 5},
        {"prompt": prompts[2], "max_tokens": 12, "n": 4},
    ):
        full = {**body, "temperature": 1.0, "seed": 3, "ignore_eos": True}
        r = post(srv, "/v1/completions", full)
        assert r.status_code == 200, r.text
        ids = [
            p if isinstance(p, list) else tok.encode(p)
            for p in (body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]])
        ]
        tokens = [body["max_tokens"] + (len(i) if body.get("echo") else 0) for i in ids]
        bound = response_bytes(widths, tokens, body.get("n", 1), body.get("logprobs"), chat=False)
        assert len(r.content) <= bound, (body, len(r.content), bound)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10, "n": 3}
    for extra in ({}, {"logprobs": True, "top_logprobs": 5}, {"logprobs": True}):
        r = post(srv, "/v1/chat/completions", {**chat, **extra, "ignore_eos": True})
        assert r.status_code == 200, r.text
        k = extra.get("top_logprobs", 0) if extra.get("logprobs") else None
        assert len(r.content) <= response_bytes(widths, [10], 3, k, chat=True)
