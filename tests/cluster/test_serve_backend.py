"""The ingress's handle wrapper (`ServeBackend`) over a fake deployment handle: a request
that no engine replica can take is answered 503 at once, not held until its time-out."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from pagefleet.cluster import ingress as ingress_module
from pagefleet.cluster import leaving
from pagefleet.cluster.config import ServeConfig
from pagefleet.cluster.fleet_state import FleetState
from pagefleet.cluster.http import APIError
from pagefleet.cluster.ingress import ServeBackend
from pagefleet.cluster.replica_messages import ReplicaRequest, RequestDelta, encode_delta
from pagefleet.engine import SamplingParams


class FakeResponses:
    """What `handle.options(stream=True).generate.remote(...)` returns: an async iterator
    of deltas with `cancel()`. It yields nothing until `admit_after_s` has passed."""

    def __init__(self, admit_after_s: float | None, ends_after: int | None = None) -> None:
        self.admit_after_s = admit_after_s
        self.ends_after = ends_after  # deltas sent before the stream ends unfinished
        self.cancelled = False
        self._gen = self._deltas()

    async def _deltas(self) -> AsyncIterator[bytes]:
        """What Serve hands the ingress: each delta as the replica's msgpack bytes."""
        if self.admit_after_s is None:
            await asyncio.Event().wait()  # no replica ever takes it
        await asyncio.sleep(self.admit_after_s or 0.0)
        if self.ends_after == 0:
            return
        yield encode_delta(RequestDelta("r", 3, [], finished=False))
        if self.ends_after == 1:
            return
        yield encode_delta(RequestDelta("r", 3, [], finished=True))

    def __aiter__(self) -> FakeResponses:
        return self

    def __anext__(self) -> Any:
        return self._gen.__anext__()

    def cancel(self) -> None:
        self.cancelled = True


class FakeHandle:
    deployment_name = "EngineReplica"

    def __init__(self, admit_after_s: float | None, ends_after: int | None = None) -> None:
        self.calls: list[FakeResponses] = []
        self._admit_after_s = admit_after_s
        self._ends_after = ends_after
        self.generate = self

    def options(self, **_: Any) -> FakeHandle:
        return self

    def remote(self, request: ReplicaRequest) -> FakeResponses:
        self.calls.append(FakeResponses(self._admit_after_s, self._ends_after))
        return self.calls[-1]


def fleet(status: str = "HEALTHY", **replicas: int) -> FleetState:
    return FleetState(replicas=replicas, status=status)


def backend(
    handle: FakeHandle,
    state: FleetState | None,
    config: ServeConfig | None = None,
    asked: list[FleetState | None] | None = None,
) -> ServeBackend:
    b = ServeBackend(handle, None, config or ServeConfig(model="m"))  # type: ignore[arg-type]

    async def fleet_state() -> FleetState | None:
        if asked is not None:
            asked.append(state)
        return state

    b.fleet_state = fleet_state  # type: ignore[method-assign]
    return b


FROM_ZERO = ServeConfig(model="m", autoscaling={"min_replicas": 0, "max_replicas": 2})


def request() -> ReplicaRequest:
    return ReplicaRequest("r", [1, 2, 3], SamplingParams(max_tokens=1), stream=True)


async def drain(b: ServeBackend) -> list[RequestDelta]:
    return [d async for d in b.generate(request())]


@pytest.fixture(autouse=True)
def quick_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ingress_module, "NO_REPLICA_CHECK_S", 0.05)
    # Outside a deployment: the ingress replica's own id is not there to read.
    monkeypatch.setattr(ingress_module.serve, "get_replica_context", lambda: None)
    leaving.offered(set())  # no router in this process offers a replica yet


@pytest.mark.parametrize(
    "state",
    [fleet("UNHEALTHY", RUNNING=0), fleet("HEALTHY"), fleet("DEPLOY_FAILED", STOPPING=1)],
)
def test_no_replica_running_or_coming_is_a_prompt_503_and_the_call_is_cancelled(
    state: FleetState,
) -> None:
    handle = FakeHandle(admit_after_s=None)
    t0 = time.monotonic()
    with pytest.raises(APIError) as err:
        asyncio.run(drain(backend(handle, state)))
    assert time.monotonic() - t0 < 5.0  # prompt: no wait for an admission that never comes
    assert err.value.status == 503
    assert err.value.message == (
        f"no engine replica is running or starting ({state.status.lower()}); retry after 1 s"
    )
    assert err.value.headers == {"Retry-After": "1"}
    assert handle.calls[0].cancelled  # Serve must not hand it to a replica later


@pytest.mark.parametrize(
    ("state", "config"),
    [
        (fleet(RUNNING=1), None),
        (None, None),  # the controller cannot say: keep waiting (bounded by the time-out)
        (fleet("UPSCALING", STARTING=1), None),  # a replacement on its way
        (fleet("UPSCALING", RECOVERING=1, STOPPING=1), None),
        (fleet("HEALTHY"), FROM_ZERO),  # scaled to zero: Serve's cold start adds one
        (fleet("UPSCALING", STARTING=1), FROM_ZERO),
    ],
)
def test_a_slow_admission_waits_while_a_replica_runs_or_is_coming(
    state: FleetState | None, config: ServeConfig | None
) -> None:
    handle = FakeHandle(admit_after_s=0.3)  # six checks' worth
    deltas = asyncio.run(drain(backend(handle, state, config)))
    assert [d.finished for d in deltas] == [False, True]
    assert not handle.calls[0].cancelled


def test_a_slow_admission_asks_the_controller_only_while_no_router_offers_a_replica() -> None:
    asked: list[FleetState | None] = []
    leaving.offered({"r1"})
    b = backend(FakeHandle(admit_after_s=0.3), fleet("UNHEALTHY"), asked=asked)
    assert [d.finished for d in asyncio.run(drain(b))] == [False, True]
    assert asked == []  # r1 takes it when it has room: no 503 from a stale status
    leaving.offered(set())
    with pytest.raises(APIError):
        asyncio.run(drain(backend(FakeHandle(admit_after_s=0.3), fleet("UNHEALTHY"), asked=asked)))
    assert asked == [fleet("UNHEALTHY")]


@pytest.mark.parametrize("ends_after", [0, 1])
def test_a_replica_stream_that_ends_before_its_final_delta_is_a_503(ends_after: int) -> None:
    # A killed replica's stream can end with no error of its own: the client must not
    # get a truncated 200 (or a stream with no finish_reason) for it.
    handle = FakeHandle(admit_after_s=0.0, ends_after=ends_after)
    got: list[RequestDelta] = []

    async def collect() -> None:
        async for d in backend(handle, fleet(RUNNING=1)).generate(request()):
            got.append(d)

    with pytest.raises(APIError) as err:
        asyncio.run(collect())
    assert err.value.status == 503
    assert err.value.message == "the engine replica ended the request's stream before it finished"
    assert [d.finished for d in got] == [False] * ends_after


def test_health_is_the_controllers_view_and_never_calls_a_replica() -> None:
    handle = FakeHandle(admit_after_s=None)  # a call to a replica would never return

    def healthy(state: FleetState | None, config: ServeConfig | None = None) -> bool:
        return asyncio.run(asyncio.wait_for(backend(handle, state, config).healthy(), 1.0))

    assert healthy(fleet(RUNNING=1, STARTING=1))
    assert healthy(fleet("UNHEALTHY", RUNNING=1))  # one replica left still serves
    assert not healthy(fleet("UPSCALING", STARTING=2))
    assert not healthy(fleet("UNHEALTHY"))
    assert not healthy(None)
    # Scaled to zero by choice: a request would start a replica, so stay in rotation.
    assert healthy(fleet("HEALTHY"), FROM_ZERO)
    assert healthy(fleet("UPSCALING", STARTING=1), FROM_ZERO)
    assert not healthy(fleet("UNHEALTHY"), FROM_ZERO)
    assert handle.calls == []


def test_fleet_state_reads_serve_status() -> None:
    from ray.serve._private.common import ReplicaState
    from ray.serve.schema import DeploymentStatus

    class Obj:
        def __init__(self, **kw: Any) -> None:
            self.__dict__.update(kw)

    dep = Obj(
        status=DeploymentStatus.UPSCALING,
        replica_states={ReplicaState.RUNNING: 1, ReplicaState.STARTING: 2},
    )
    status = Obj(applications={"app": Obj(deployments={"EngineReplica": dep})})
    state = FleetState.from_serve_status(status, "app", "EngineReplica")
    assert state == FleetState({"RUNNING": 1, "STARTING": 2}, "UPSCALING")
