"""generation_config.json's sampling defaults over HTTP (vLLM's `generation_config: auto`): a
field a request leaves out takes the checkpoint's value, a field it sets wins, and the
checkpoint's max_new_tokens caps max_tokens as in vLLM. Oracle: `LLM.generate`."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from typing import Any

import pytest

from pagefleet.cluster.config import Limits
from pagefleet.cluster.http.protocol import ChatCompletionRequest, CompletionRequest
from pagefleet.engine import LLM, SamplingParams
from pagefleet.engine.checkpoint import generation_defaults
from tests.cluster.http.test_api import ENGINE, Harness, serving

SHIPPED = {
    "temperature": 0.7,
    "top_p": 0.8,
    "top_k": 1,
    "min_p": 0.05,
    "repetition_penalty": 1.05,
    "max_new_tokens": 5,
}
DEFAULTS = {
    "temperature": 0.7,
    "top_p": 0.8,
    "top_k": 1,
    "min_p": 0.05,
    "repetition_penalty": 1.05,
    "max_tokens": 5,
}
PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def instruct_dir(llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("instruct") / "tiny"
    shutil.copytree(llama_dir, folder)
    shipped = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps(shipped | SHIPPED))
    return str(folder)


@pytest.fixture(scope="module")
def srv(instruct_dir: str) -> Iterator[Harness]:
    defaults = generation_defaults(instruct_dir)
    assert defaults == DEFAULTS
    with serving(instruct_dir, {"engine": ENGINE}, sampling_defaults=defaults) as h:
        yield h


@pytest.fixture(scope="module")
def llm(instruct_dir: str) -> Iterator[LLM]:
    with LLM(model=instruct_dir, **ENGINE) as llm:
        yield llm


def test_an_unset_field_takes_the_checkpoints_default_and_a_set_one_wins() -> None:
    limits = Limits()
    req = CompletionRequest(prompt=PROMPT, temperature=0.2, top_k=-1)
    assert req.to_sampling_params(limits, 5, None, DEFAULTS) == SamplingParams(
        max_tokens=5, temperature=0.2, top_p=0.8, top_k=0, min_p=0.05, repetition_penalty=1.05
    )
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], top_p=0.5)
    assert chat.to_sampling_params(limits, 5, None, DEFAULTS) == SamplingParams(
        max_tokens=5, temperature=0.7, top_p=0.5, top_k=1, min_p=0.05, repetition_penalty=1.05
    )
    assert req.to_sampling_params(limits, 5) == SamplingParams(max_tokens=5, temperature=0.2)


def complete(srv: Harness, **fields: Any) -> dict[str, Any]:
    r = srv.client.post("/v1/completions", json={"prompt": PROMPT, **fields})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def oracle(llm: LLM, params: SamplingParams | None) -> str:
    out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    llm.check_block_accounting()
    return out.text


def test_completions_take_the_checkpoints_defaults(srv: Harness, llm: LLM) -> None:
    # Unset: top_k 1 (so the greedy tokens), repetition_penalty 1.05, 5 tokens at most.
    assert complete(srv)["text"] == oracle(llm, None)
    assert complete(srv)["text"] == oracle(llm, SamplingParams(**DEFAULTS))
    # Set fields win: fewer tokens, no penalty, greedy.
    assert complete(srv, max_tokens=3)["text"] == oracle(
        llm, SamplingParams(**(DEFAULTS | {"max_tokens": 3}))
    )
    unpenalised = SamplingParams(temperature=0, max_tokens=5, repetition_penalty=1.0)
    assert complete(srv, temperature=0, repetition_penalty=1.0)["text"] == oracle(llm, unpenalised)
    # vLLM: the checkpoint's max_new_tokens also caps a larger max_tokens.
    assert complete(srv, max_tokens=12)["text"] == oracle(llm, None)
    srv.check_idle_and_balanced()


def test_chat_takes_the_checkpoints_max_tokens(srv: Harness) -> None:
    r = srv.client.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] <= 5
    assert body["usage"]["completion_tokens"] == 5 or body["choices"][0]["finish_reason"] == "stop"
    srv.check_idle_and_balanced()
