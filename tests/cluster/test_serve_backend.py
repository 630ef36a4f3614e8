"""The ingress's handle wrapper (`ServeBackend`) over a fake deployment handle: a request
that no engine replica can take is answered 503 at once, not held until its time-out."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from pagefleet.cluster import app as app_module
from pagefleet.cluster.api import APIError
from pagefleet.cluster.app import ServeBackend
from pagefleet.cluster.config import ServeConfig
from pagefleet.cluster.messages import EngineRequest, RequestDelta
from pagefleet.engine.sampling import SamplingParams


class FakeResponses:
    """What `handle.options(stream=True).generate.remote(...)` returns: an async iterator
    of deltas with `cancel()`. It yields nothing until `admit_after_s` has passed."""

    def __init__(self, admit_after_s: float | None) -> None:
        self.admit_after_s = admit_after_s
        self.cancelled = False
        self._gen = self._deltas()

    async def _deltas(self) -> AsyncIterator[RequestDelta]:
        if self.admit_after_s is None:
            await asyncio.Event().wait()  # no replica ever takes it
        await asyncio.sleep(self.admit_after_s or 0.0)
        yield RequestDelta("r", 3, [], finished=False)
        yield RequestDelta("r", 3, [], finished=True)

    def __aiter__(self) -> FakeResponses:
        return self

    def __anext__(self) -> Any:
        return self._gen.__anext__()

    def cancel(self) -> None:
        self.cancelled = True


class FakeHandle:
    deployment_name = "EngineReplica"

    def __init__(self, admit_after_s: float | None) -> None:
        self.calls: list[FakeResponses] = []
        self._admit_after_s = admit_after_s
        self.generate = self

    def options(self, **_: Any) -> FakeHandle:
        return self

    def remote(self, request: EngineRequest) -> FakeResponses:
        self.calls.append(FakeResponses(self._admit_after_s))
        return self.calls[-1]


def backend(handle: FakeHandle, running: int | None) -> ServeBackend:
    b = ServeBackend(handle, None, ServeConfig(model="m"))  # type: ignore[arg-type]

    async def running_replicas() -> int | None:
        return running

    b._running_replicas = running_replicas  # type: ignore[method-assign]
    return b


def request() -> EngineRequest:
    return EngineRequest("r", [1, 2, 3], SamplingParams(max_tokens=1), stream=True)


async def drain(b: ServeBackend) -> list[RequestDelta]:
    return [d async for d in b.generate(request())]


@pytest.fixture(autouse=True)
def quick_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(app_module, "NO_REPLICA_CHECK_S", 0.05)
    # Outside a deployment: the ingress replica's own id is not there to read.
    monkeypatch.setattr(app_module.serve, "get_replica_context", lambda: None)


def test_no_running_replica_is_a_prompt_503_and_the_call_is_cancelled() -> None:
    handle = FakeHandle(admit_after_s=None)
    t0 = time.monotonic()
    with pytest.raises(APIError) as err:
        asyncio.run(drain(backend(handle, running=0)))
    assert time.monotonic() - t0 < 1.0
    assert err.value.status == 503
    assert err.value.message.startswith("no engine replica is running")
    assert err.value.headers == {"Retry-After": "1"}
    assert handle.calls[0].cancelled  # Serve must not hand it to a replica later


@pytest.mark.parametrize("running", [1, None])
def test_a_slow_admission_waits_while_a_replica_runs_or_none_can_be_told(
    running: int | None,
) -> None:
    handle = FakeHandle(admit_after_s=0.3)  # six checks' worth
    deltas = asyncio.run(drain(backend(handle, running=running)))
    assert [d.finished for d in deltas] == [False, True]
    assert not handle.calls[0].cancelled
