"""One table from failure to HTTP status (pagefleet/cluster/http/errors.py), by type: the engine's own
error types, as Ray carries them from a replica, and Serve's; anything else is a 500
with OpenAI's body and a log line, never a 400."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx
import pytest
from ray.exceptions import ActorDiedError, RayTaskError
from ray.serve.exceptions import BackPressureError

from pagefleet.cluster.http import create_app
from pagefleet.cluster.http.errors import to_api_error
from pagefleet.cluster.replica_messages import EngineInfo
from pagefleet.engine.errors import (
    EngineDeadError,
    EngineOverloadedError,
    InvalidRequestError,
    RequestFailedError,
)
from tests.conftest import tokenizer_for


def from_replica(exc: Exception) -> Exception:
    """`exc` as a caller of a Serve replica receives it: wrapped by Ray, and an instance
    of its cause's class too."""
    return RayTaskError("generate", "Traceback: ...", exc).as_instanceof_cause()


@pytest.mark.parametrize(
    ("exc", "status", "message"),
    [
        (InvalidRequestError("prompt too long"), 400, "prompt too long"),
        (EngineOverloadedError("queue full"), 429, "The server is at capacity"),
        (BackPressureError(num_queued_requests=3, max_queued_requests=3), 429, "The server is at"),
        (EngineDeadError("rank 1 died"), 503, "the engine replica is unavailable: rank 1 died"),
        (RequestFailedError("step failed"), 500, "the engine failed the request: step failed"),
        (ValueError("a bug"), 500, "internal error: ValueError"),
        (KeyError("x"), 500, "internal error: KeyError"),
    ],
)
def test_each_failure_type_has_its_status_directly_and_through_ray(
    exc: Exception, status: int, message: str
) -> None:
    for raised in (exc, from_replica(exc)):
        err = to_api_error(raised)
        assert err.status == status, (raised, err.message)
        assert err.message.startswith(message), err.message


def test_a_dead_replica_actor_is_a_503() -> None:
    assert to_api_error(ActorDiedError()).status == 503


class _Failing:
    """A backend whose replica raises `exc` once the request is admitted."""

    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    async def info(self) -> EngineInfo:
        return EngineInfo(max_model_len=256, vocab_size=512, block_size=8, num_kv_blocks=16)

    async def generate(self, request: Any) -> Any:
        raise from_replica(self.exc)
        yield  # an async generator, as a replica stream is

    async def metric_snapshots(self) -> list[list[Any]]:
        return []

    async def healthy(self) -> bool:
        return True


@pytest.mark.parametrize(
    ("exc", "status"), [(ValueError("a bug in the replica"), 500), (InvalidRequestError("no"), 400)]
)
def test_over_http_a_bug_is_a_500_with_openais_body_and_a_log_line(
    llama_dir: str, exc: Exception, status: int, caplog: pytest.LogCaptureFixture
) -> None:
    app = create_app(_Failing(exc), tokenizer_for(llama_dir), "tiny")

    async def run() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})

    with caplog.at_level(logging.ERROR, logger="pagefleet.cluster"):
        r = asyncio.run(run())
    assert r.status_code == status, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert r.json()["error"]["code"] == status
    logged = [rec for rec in caplog.records if rec.levelno >= logging.ERROR]
    assert bool(logged) == (status == 500)


def test_every_reference_in_the_openapi_document_resolves(llama_dir: str) -> None:
    """Each error status refers to OpenAI's error body: it is in the document (it was a
    dangling reference before)."""
    app = create_app(_Failing(ValueError()), tokenizer_for(llama_dir), "tiny", api_key="k")

    async def run() -> dict[str, Any]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return (await c.get("/openapi.json")).json()

    doc = asyncio.run(run())

    def refs(node: Any) -> list[str]:
        if isinstance(node, dict):
            own = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
            return own + [r for v in node.values() for r in refs(v)]
        if isinstance(node, list):
            return [r for v in node for r in refs(v)]
        return []

    found = set(refs(doc))
    assert "#/components/schemas/ErrorResponse" in found
    schemas = doc["components"]["schemas"]
    missing = [r for r in found if r.removeprefix("#/components/schemas/") not in schemas]
    assert not missing, missing
    assert set(schemas["ErrorResponse"]["properties"]) == {"error"}
    assert set(schemas["ErrorInfo"]["properties"]) == {"message", "type", "param", "code"}
