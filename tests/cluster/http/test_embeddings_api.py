"""`/v1/embeddings` through the official `openai` SDK over a real HTTP server and an
in-process engine replica: the vectors equal transformers' pooled, normalized final
hidden states."""

from __future__ import annotations

import base64
from collections.abc import Iterator

import numpy as np
import openai
import pytest
import torch

from tests.cluster.http.test_api import ENGINE, Harness, serving
from tests.conftest import PROMPT_TEXTS, tokenizer_for
from tests.engine.test_embeddings import hf_embedding


@pytest.fixture(scope="module", params=["last", "mean"])
def pooled(request: pytest.FixtureRequest, llama_dir: str) -> Iterator[tuple[Harness, str]]:
    with serving(llama_dir, {"engine": {**ENGINE, "pooling": request.param}}) as h:
        yield h, request.param


def client(h: Harness) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{h.url}/v1", api_key="none", max_retries=0)


def test_embeddings_equal_transformers(pooled: tuple[Harness, str], llama_dir: str) -> None:
    h, pooling = pooled
    texts = PROMPT_TEXTS[:4]
    ids = [tokenizer_for(llama_dir).encode(t) for t in texts]
    out = client(h).embeddings.create(model="tiny", input=texts)
    assert [d.index for d in out.data] == [0, 1, 2, 3]
    assert out.usage.prompt_tokens == out.usage.total_tokens == sum(map(len, ids))
    for prompt, d in zip(ids, out.data, strict=True):
        want = hf_embedding(llama_dir, prompt, pooling)
        torch.testing.assert_close(torch.tensor(d.embedding), want, atol=1e-5, rtol=1e-4)
    # Token ids (one list, and a list of lists) are the same inputs.
    one = client(h).embeddings.create(model="tiny", input=ids[0])
    assert one.data[0].embedding == out.data[0].embedding
    many = client(h).embeddings.create(model="tiny", input=ids[1:3])
    assert [d.embedding for d in many.data] == [d.embedding for d in out.data[1:3]]
    h.check_idle_and_balanced()


def test_base64_is_little_endian_float32(pooled: tuple[Harness, str]) -> None:
    h, _ = pooled
    texts = PROMPT_TEXTS[:2]
    floats = client(h).embeddings.create(model="tiny", input=texts, encoding_format="float")
    # The SDK decodes base64 itself when it asked for it; the raw body shows the bytes.
    raw = h.client.post(
        "/v1/embeddings", json={"model": "tiny", "input": texts, "encoding_format": "base64"}
    ).json()
    for d, f in zip(raw["data"], floats.data, strict=True):
        vec = np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4")
        assert vec.tolist() == f.embedding
    h.check_idle_and_balanced()


def test_refusals_name_the_field(pooled: tuple[Harness, str]) -> None:
    h, _ = pooled
    with pytest.raises(openai.BadRequestError) as e:
        client(h).embeddings.create(model="tiny", input="hi", dimensions=8)
    assert e.value.body["param"] == "dimensions"  # type: ignore[index]
    for body, param in [
        ({"input": []}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": [10**9]}, "input"),
        ({"input": list(range(1, 200))}, "input"),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "hi", "truncate_prompt_tokens": 3}, "truncate_prompt_tokens"),
    ]:
        r = h.client.post("/v1/embeddings", json=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param, r.text
    r = h.client.post("/v1/embeddings", json={"model": "other", "input": "hi"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    h.check_idle_and_balanced()
