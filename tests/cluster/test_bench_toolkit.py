"""The bench toolkit: the one percentile, the streaming client, the launcher's readiness
check and lifecycle (against tiny HTTP servers on 127.0.0.1 only), the report writer,
the checkpoint it runs on, and the pytest runner the results writers use."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import socket
import sys
import textwrap
import threading
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import numpy as np
import pytest

from pagefleet.bench import add_bench_parser, checkpoint, launcher, serve, vllm_child
from pagefleet.bench.client import (
    TEMPERATURE,
    RequestResult,
    closed_loop,
    read_stream,
    sse_lines,
    stream_completion,
)
from pagefleet.bench.report import markdown_table, pyplot, save_png, write_report
from pagefleet.bench.stats import percentile, slope
from pagefleet.bench.workloads import BenchRequest

# -- stats ------------------------------------------------------------------------------


def test_percentile_interpolates_linearly_between_order_statistics() -> None:
    xs = [5.0, 1.0, 4.0, 2.0, 3.0]  # unsorted on purpose
    assert percentile(xs, 0.0) == 1.0
    assert percentile(xs, 0.5) == 3.0
    assert percentile(xs, 1.0) == 5.0
    assert percentile(xs, 0.25) == 2.0  # position 1 exactly
    assert percentile(xs, 0.99) == pytest.approx(4.96)  # position 3.96: 4 + 0.96 * (5 - 4)
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5  # the median of an even count
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.25) == 1.75
    assert percentile(list(range(1, 101)), 0.99) == pytest.approx(99.01)  # nearest rank: 99
    assert percentile([7.0], 0.99) == 7.0
    assert percentile([2.0, 2.0, 2.0], 0.9) == 2.0
    assert math.isnan(percentile([], 0.5))
    with pytest.raises(ValueError):
        percentile(xs, 1.5)
    with pytest.raises(ValueError):
        percentile(xs, -0.1)


@pytest.mark.parametrize("q", [0.0, 0.1, 0.5, 0.9, 0.95, 0.99, 1.0])
def test_percentile_is_numpys_default(q: float) -> None:
    values = [0.31, 2.5, 0.07, 9.0, 1.25, 1.25, 4.4, 0.9, 3.3, 0.5, 7.1]
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, 100 * q)))


def test_slope_is_least_squares_and_nan_without_enough_points() -> None:
    assert slope([0, 1, 2, 3], [1, 3, 5, 7]) == 2
    assert math.isnan(slope([0, 1], [0, 1]))
    assert math.isnan(slope([5, 5, 5], [1, 2, 3]))


# -- the client ---------------------------------------------------------------------------


class Pieces(httpx.AsyncByteStream):
    """A body arriving in the given pieces (which may cut a character or a line)."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for p in self.pieces:
            yield p


def _split(body: bytes, at: list[int]) -> list[bytes]:
    cuts = [0, *at, len(body)]
    return [body[a:b] for a, b in itertools.pairwise(cuts)]


def _lines(body: bytes, at: list[int] | None = None) -> list[str]:
    async def go() -> list[str]:
        r = httpx.Response(200, stream=Pieces(_split(body, at or [])))
        return [line async for line in sse_lines(r)]

    return asyncio.run(go())


def test_sse_lines_split_only_at_line_feeds() -> None:
    # Text a random-weight model writes may hold U+2028 or U+0085 (the API sends JSON
    # with ensure_ascii=False): inside a data line, never the end of one.
    body = 'data: {"text": "a\u2028b\x85c"}\r\n\ndata: [DONE]\n\n'.encode()
    expected = ['data: {"text": "a\u2028b\x85c"}', "", "data: [DONE]", ""]
    assert _lines(body) == expected
    # The same, arriving cut inside U+2028's three bytes, inside "\r\n", and mid-line.
    cut = body.index("\u2028".encode()) + 1
    assert _lines(body, [5, cut, cut + 1, body.index(b"\r") + 1]) == expected
    assert _lines(b"data: x\ndata: y") == ["data: x", "data: y"]  # no final line feed


def _sse(*chunks: dict | str) -> bytes:
    return "".join(
        f"data: {c if isinstance(c, str) else json.dumps(c, ensure_ascii=False)}\n\n"
        for c in chunks
    ).encode()


def _choice(text: str, finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "text": text, "finish_reason": finish}], "usage": None}


def _read(body: bytes) -> object:
    async def go() -> object:
        return await read_stream(httpx.Response(200, content=body), 0.0)

    return asyncio.run(go())


def test_read_stream_counts_token_chunks_usage_and_done() -> None:
    body = _sse(
        _choice("a\u2028b"),  # one chunk, U+2028 and all
        _choice(""),  # a token whose text is still held (half a character): a token chunk
        _choice("c", "length"),
        {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3}},
        "[DONE]",
    )
    s = _read(body)
    assert (s.chunks, s.tokens, s.done, s.error) == (3, 3, True, "")
    assert len(s.gaps) == 2 and not math.isnan(s.ttft)


def test_read_stream_skips_the_chat_role_chunk_and_stops_at_an_error_event() -> None:
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    token = {"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]}
    s = _read(_sse(role, token, "[DONE]"))
    assert (s.chunks, s.done) == (1, True)
    s = _read(_sse(_choice("x"), {"error": {"message": "engine died", "code": 500}}, "[DONE]"))
    assert (s.chunks, s.error, s.done) == (1, "engine died", False)
    s = _read(_sse(_choice("x")))  # the stream ends early
    assert (s.chunks, s.done, s.tokens) == (1, False, None)


def _serve_mock(handler: object) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.MockTransport(handler))  # type: ignore[arg-type]


def _complete(handler: object, req: BenchRequest) -> RequestResult:
    async def go() -> RequestResult:
        async with _serve_mock(handler) as client:
            return await stream_completion(client, "http://bench.invalid", "m", req, 0.0)

    return asyncio.run(go())


def test_stream_completion_sends_ignore_eos_and_checks_the_token_count() -> None:
    sent: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        usage = {"choices": [], "usage": {"completion_tokens": 2}}
        return httpx.Response(200, content=_sse(_choice("a"), _choice("b"), usage, "[DONE]"))

    res = _complete(handler, BenchRequest((20, 21, 22), 2, "short"))
    assert res.ok and res.tokens == 2 and res.kind == "short" and len(res.gaps) == 1
    assert sent[0]["prompt"] == [20, 21, 22] and sent[0]["ignore_eos"] and sent[0]["stream"]
    res = _complete(handler, BenchRequest("a text prompt", 5))
    assert not res.ok and res.error == "2 of 5 tokens" and sent[1]["prompt"] == "a text prompt"
    assert "logprobs" not in sent[0] and sent[0]["temperature"] == TEMPERATURE
    _complete(handler, BenchRequest((20,), 2, logprobs=3))
    assert sent[2]["logprobs"] == 3


def test_stream_completion_reports_http_errors_by_their_message() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(429, json={"error": {"message": "queue full", "code": 429}})

    res = _complete(handler, BenchRequest((20,), 2))
    assert not res.ok and res.error == "HTTP 429: queue full" and math.isnan(res.ttft)


# -- the launcher ---------------------------------------------------------------------


class _Fleet(BaseHTTPRequestHandler):
    """/health as `health`; /metrics listing `replicas` engine replicas."""

    health = 503
    replicas = 0

    def do_GET(self) -> None:
        if self.path == "/health":
            self._send(type(self).health, b'{"status": "ok"}')
        elif self.path == "/metrics":
            page = "# TYPE pagefleet:kv_blocks_total gauge\n" + "".join(
                f'pagefleet:kv_blocks_total{{replica="r{i}"}} 64.0\n'
                for i in range(type(self).replicas)
            )
            self._send(200, page.encode())
        else:
            self._send(404, b"not found")

    def _send(self, code: int, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def fleet() -> Iterator[tuple[str, type[_Fleet]]]:
    handler = type("Fleet", (_Fleet,), {})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler
    finally:
        server.shutdown()
        server.server_close()


def test_ready_when_health_answers_and_enough_replicas_report(fleet: tuple) -> None:
    url, state = fleet
    assert not launcher.is_ready(url)  # 503: no healthy replica yet
    state.health = 200
    assert launcher.is_ready(url)
    assert not launcher.is_ready(url, replicas=2)  # none reports its blocks yet
    state.replicas = 1
    assert not launcher.is_ready(url, replicas=2)
    state.replicas = 2
    assert launcher.is_ready(url, replicas=2)


def test_not_ready_where_nothing_listens() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connections are refused
        assert not launcher.is_ready(f"http://127.0.0.1:{port}")


def test_free_ports_are_bindable_and_taken_ones_skipped() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        taken = s.getsockname()[1]
        assert launcher.first_free_port([taken]) is None
        assert launcher.first_free_port([taken, 0]) == 0
    port = launcher.free_port(range(8500, 8600))
    assert 8500 <= port < 8600


# A server of our own: healthy after a moment, one model, Ctrl-C ends it with 0.
_TINY_SERVER = textwrap.dedent(
    """
    import json, signal, sys, time
    from http.server import BaseHTTPRequestHandler, HTTPServer
    # Ctrl-C as a terminal delivers it, whatever was inherited: a runner started in the
    # background by a shell without job control ignores SIGINT, and so would this child.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    born = time.monotonic()

    class H(BaseHTTPRequestHandler):
        def do_GET(self):
            ready = time.monotonic() - born > 0.3
            if self.path == "/health":
                code, body = (200 if ready else 503), b"{}"
            elif self.path == "/v1/models":
                code, body = 200, json.dumps({"data": [{"id": "tiny"}]}).encode()
            else:
                code, body = 404, b""
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    print("serving", flush=True)
    try:
        HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
    except KeyboardInterrupt:
        sys.exit(0)
    """
)


def test_launch_waits_for_readiness_and_stops_with_ctrl_c(tmp_path: Path) -> None:
    port = launcher.free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-c", _TINY_SERVER, str(port)]
    with launcher.launch(cmd, url, tmp_path / "tiny.log", {}, timeout_s=60) as server:
        assert server.model == "tiny" and launcher.is_ready(url)
        assert server.proc.poll() is None
    assert server.stopped == (0, [])  # SIGINT, exit code 0, nothing of it left
    assert server.stop() == (0, [])  # once
    assert "serving" in launcher.tail(tmp_path / "tiny.log")


def test_launch_reports_a_server_that_exits_with_its_log(tmp_path: Path) -> None:
    cmd = [sys.executable, "-c", "print('bad config'); raise SystemExit(3)"]
    url = f"http://127.0.0.1:{launcher.free_port()}"
    with (
        pytest.raises(RuntimeError, match=r"exited with 3:\nbad config"),
        launcher.launch(cmd, url, tmp_path / "x.log", {}, timeout_s=60),
    ):
        pass


def test_closed_loop_keeps_each_users_order(monkeypatch: pytest.MonkeyPatch) -> None:
    order: list[tuple[int, ...] | str] = []

    async def fake(client: object, url: str, model: str, req: BenchRequest, t0: float):
        order.append(req.prompt)
        await asyncio.sleep(0)
        return RequestResult(ok=True, tokens=req.max_tokens)

    monkeypatch.setattr("pagefleet.bench.client.stream_completion", fake)
    per_user = [[BenchRequest("a1", 1), BenchRequest("a2", 1)], [BenchRequest("b1", 1)]]
    results, wall = asyncio.run(closed_loop("http://bench.invalid", "m", per_user, [0.0, 0.0]))
    assert len(results) == 3 and wall >= 0
    assert order.index("a1") < order.index("a2")


# -- the report writer, the checkpoint ------------------------------------------------


def test_report_has_the_command_the_table_and_the_plot(tmp_path: Path) -> None:
    out = str(tmp_path / "results" / "x")
    plt = pyplot()
    fig, ax = plt.subplots()
    ax.plot([1, 2], [3, 4])
    png = save_png(fig, out, 50)
    assert png == tmp_path / "results" / "x.png" and png.stat().st_size > 0
    body = markdown_table(["a", "b"], [[1, "two"]])
    assert body == "| a | b |\n|---|---|\n| 1 | two |"
    path = write_report(out, "Title", body, command="pagefleet bench x --y")
    text = path.read_text()
    assert path.name == "x.md" and text.startswith("# Title\n\nCommand: `pagefleet bench x --y` (")
    assert "| 1 | two |" in text and text.endswith("![Title](x.png)\n")


def _level(
    server: str, users: int, tok_s: float, offline: float | None = None
) -> serve.LevelResult:
    """`users` requests of 10 tokens over 10 * users / tok_s seconds."""
    results = [
        RequestResult(ok=True, ttft=0.1, e2e=1.0, tokens=10, gaps=[0.01]) for _ in range(users)
    ]
    return serve.LevelResult(server, users, results, 10 * users / tok_s, offline)


def test_serve_report_says_the_threads_and_has_the_ratio_columns(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_bench_parser(parser)
    args = parser.parse_args(
        [
            "serve",
            "--scenario",
            "long-prompt",
            "--threads",
            "2",
            "--offline-ratio",
            "--logprobs",
            "2",
        ]
    )
    serve.apply_scenario(args)
    args.vllm_python, args.vllm_version, args.out = "/v/python", "0.32.0", str(tmp_path / "serve")
    levels = [
        _level("pagefleet", 1, 20.0, 25.0),
        _level("pagefleet", 16, 150.0, 200.0),
        _level(serve.VLLM_NAME, 1, 25.0, 20.0),
        _level(serve.VLLM_NAME, 16, 200.0, 250.0),
    ]
    text = serve.report(levels, args, ["a note"]).read_text()
    assert "Compute threads: **2** on each side" in text and "`num_threads: 2`" in text
    assert "VLLM_CPU_OMP_THREADS_BIND=0-1, VLLM_CPU_NUM_OF_RESERVED_CPU=0" in text
    assert "CPU build 0.32.0 at its defaults (no enforce_eager)" in text
    assert (
        "exactly 1200 token ids" in text and "logprobs 2" in text and "max_model_len 2048" in text
    )
    assert "- a note" in text and (tmp_path / "serve.png").stat().st_size > 0
    header = next(line for line in text.splitlines() if line.startswith("| server"))
    assert "| output tok/s | offline tok/s | served / offline | / vLLM tok/s |" in header
    assert "| pagefleet | 16 | 16/16 | 150.0 | 200.0 | 0.75x | 0.75x |" in text
    assert f"| {serve.VLLM_NAME} | 1 | 1/1 | 25.0 | 20.0 | 1.25x | - |" in text
    assert (
        f"output tok/s pagefleet / {serve.VLLM_NAME}: **0.80x** at 1 users, **0.75x** at 16" in text
    )
    assert "served / offline, pagefleet: **0.80x** at 1 users, **0.75x** at 16 users" in text
    # No vLLM and no offline run: neither column.
    args.vllm_python, args.offline_ratio, args.threads = None, False, 1
    text = serve.report([_level("a", 1, 5.0), _level("a", 4, 10.0)], args, []).read_text()
    assert "offline tok/s" not in text and "/ vLLM" not in text and "vLLM mode" not in text
    assert "Compute threads: **1**" in text and "a: 1 -> 4 users throughput factor **2.0x**" in text


def test_vllm_threads_are_its_default_for_one_on_two_cores_else_bound() -> None:
    assert vllm_child.vllm_thread_env(1, cpus=2) == {}
    assert vllm_child.vllm_thread_env(None, cpus=16) == {}
    bound = {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    assert vllm_child.vllm_thread_env(2, cpus=2) == bound
    assert vllm_child.vllm_thread_env(1, cpus=16)["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert "auto" in vllm_child.describe_vllm_threads({})
    cmd = vllm_child.api_server_command("py", "/m/smollm", 8501, "float32", max_model_len=2048)
    assert cmd[cmd.index("--max-model-len") + 1] == "2048"
    assert "--enforce-eager" not in cmd and cmd[cmd.index("--served-model-name") + 1] == "smollm"


_FAKE_ENGINE = """
import json, os
__version__ = "9.9"
class SamplingParams:
    def __init__(self, **kw):
        self.__dict__.update(kw)
class _Out:
    def __init__(self, n):
        self.token_ids = [0] * n
class _Res:
    def __init__(self, n):
        self.outputs = [_Out(n)]
class LLM:
    def __init__(self, model, **kw):
        self.log = os.environ["FAKE_ENGINE_LOG"]
        self._write({"model": model, "kw": kw})
    def _write(self, item):
        with open(self.log, "a") as f:
            f.write(json.dumps(item) + "\\n")
    def generate(self, prompts, params, use_tqdm=True):
        self._write({"prompts": prompts, "params": [vars(p) for p in params]})
        return [_Res(p.max_tokens) for p in params]
"""


def test_offline_runs_each_level_in_rounds_through_the_engines_llm(tmp_path: Path) -> None:
    (tmp_path / "fake_engine.py").write_text(_FAKE_ENGINE)
    log = tmp_path / "log.jsonl"
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "FAKE_ENGINE_LOG": str(log)}
    work = serve.workload([1, 2], 2, 5, logprobs=1, prompt_tokens=3, vocab_size=64)
    version, tok_s = serve.offline(
        sys.executable, "fake_engine", str(tmp_path), {"dtype": "float32"}, env, work
    )
    assert version == "9.9" and len(tok_s) == 2 and all(t > 0 for t in tok_s)
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert calls[0] == {"model": str(tmp_path.resolve()), "kw": {"dtype": "float32"}}
    batches = [c["prompts"] for c in calls[1:]]
    # The warm-up (2 users x 1), then per level a round per request of a user.
    assert [len(b) for b in batches] == [2, 1, 1, 2, 2]
    level2 = work.levels[1][1]
    assert batches[3] == [{"prompt_token_ids": list(u[0].prompt)} for u in level2]
    params = calls[2]["params"][0]
    assert params == {
        "temperature": TEMPERATURE,
        "max_tokens": 5,
        "ignore_eos": True,
        "logprobs": 1,
    }


def test_ensure_model_uses_a_checkpoint_that_is_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[tuple[Path, str]] = []

    def make_model(path: Path, preset: str) -> Path:
        made.append((Path(path), preset))
        path.mkdir(parents=True)
        (path / "config.json").write_text(json.dumps({"vocab_size": 1024}))
        (path / "model.safetensors").write_bytes(b"")
        return path

    monkeypatch.setattr("pagefleet.cluster.make_model.make_model", make_model)
    path, vocab = checkpoint.ensure_model(str(tmp_path / "m"), "tiny")
    assert (Path(path), vocab) == ((tmp_path / "m").resolve(), 1024)
    assert made == [(tmp_path / "m", "tiny")]
    # There now (any checkpoint, ours or not): used as it is, never rewritten.
    assert checkpoint.ensure_model(str(tmp_path / "m"), "smollm-135m")[1] == 1024
    assert len(made) == 1


# -- the results writers' pytest runner -----------------------------------------------
