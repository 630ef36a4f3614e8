"""One engine replica: token ids in, `RequestDelta`s out. No HTTP here.

`LLMReplica` is the framework-free part (also what the API's in-process tests
drive); `EngineReplica` is its Ray Serve deployment. The engine core runs in a
child process of the replica (`AsyncLLMEngine.from_config(in_process=False)`):
the replica's event loop only relays requests in and per-step deltas out, so
Serve's own work (streaming, serialization) never competes with the engine
for one GIL.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from pagefleet.engine import RequestOutputDelta
from pagefleet.engine.output_delta import merge
from pagefleet.engine.startup import StartupTimeline

from .config import ServeConfig
from .metrics import ReplicaMetrics
from .replica_messages import EngineInfo, ReplicaRequest, RequestDelta, admitted_delta, delta_of
from .tracing import (
    GEN_AI,
    carrier_of,
    context_of,
    latency_attributes,
    params_attributes,
    trace_settings,
    tracer,
)

if TYPE_CHECKING:
    from pagefleet.engine import ExecutorFactory

logger = logging.getLogger("pagefleet.cluster")

MetricsPush = Callable[[str, list[Any]], Awaitable[None]]


def prompt_of(request: ReplicaRequest) -> dict[str, Any]:
    """The engine's prompt dict of a request: its token ids, and its cache_salt if any."""
    prompt: dict[str, Any] = {"prompt_token_ids": request.prompt_token_ids}
    if request.cache_salt is not None:
        prompt["cache_salt"] = request.cache_salt
    return prompt


class LLMReplica:
    def __init__(
        self,
        config: ServeConfig,
        replica_id: str = "0",
        *,
        in_process: bool = False,
        push_metrics: MetricsPush | None = None,
        metrics_period_s: float = 0.5,
        executor_factory: ExecutorFactory | None = None,
        start_abort: Callable[[], str | None] | None = None,
        startup: StartupTimeline | None = None,
    ) -> None:
        """`executor_factory`/`start_abort`: tensor-parallel ranks the caller started (Serve);
        `startup`: the start-up's timeline so far (the caller's phases; a new one if None)."""
        # Here, not at the top: the driver of `pagefleet serve` imports this module to bind
        # the deployment, and the engine proper loads torch (seconds it need not spend).
        from pagefleet.engine import AsyncLLMEngine

        self.config = config
        self.replica_id = replica_id
        self.startup = startup if startup is not None else StartupTimeline(time.time())
        self.engine = AsyncLLMEngine.from_config(
            config.engine_config(),
            in_process=in_process,
            executor_factory=executor_factory,
            start_abort=start_abort,
            tracing=trace_settings(config),
        )
        ready = self.engine.ready
        if ready.startup is not None:
            self.startup.extend(ready.startup)
        self.metrics = ReplicaMetrics(config.model_name, replica_id)
        self.metrics.update(ready.stats)
        engine = config.engine_config()
        self.metrics.cache_config(
            ready.block_size, ready.num_kv_blocks, engine.enable_prefix_caching
        )
        self._tracer = tracer(config.observability.otlp_traces_endpoint, "pagefleet-replica")
        self._push = push_metrics
        self._metrics_period_s = metrics_period_s
        self._pusher: asyncio.Task[None] | None = None
        self.startup.mark("ready")
        self.info_ = EngineInfo(
            ready.max_model_len,
            ready.vocab_size,
            ready.block_size,
            ready.num_kv_blocks,
            ready.compile_seconds,
            self.startup.durations(),
        )
        self._log_startup()

    def _log_startup(self) -> None:
        self.metrics.startup(self.startup)
        logger.info("replica %s start-up: %s", self.replica_id, self.startup.summary())

    async def info(self) -> EngineInfo:
        return self.info_

    async def generate(self, request: ReplicaRequest) -> AsyncIterator[RequestDelta]:
        """Stream a request's deltas (one final delta when request.stream is False).

        The first delta is always an empty one, sent as soon as the engine has queued the
        request: the ingress waits for it before it answers 200, so a full queue
        (EngineOverloadedError) or bad input reaches the client as an HTTP status.
        """
        if not self.startup.has("first_request"):
            self.startup.mark("first_request")
            self._log_startup()
        span = self._start_span(request)
        try:
            async for delta in self._generate(request, span):
                yield delta
        finally:
            if span is not None:
                span.end()

    async def _generate(self, request: ReplicaRequest, span: Any) -> AsyncIterator[RequestDelta]:
        num_prompt = len(request.prompt_token_ids)
        last: float | None = None
        first = True
        generated: dict[int, int] = {}  # tokens per sample so far
        whole: RequestOutputDelta | None = None  # a non-streamed request's deltas merged
        async for out in self.engine.generate(
            prompt_of(request),
            request.params,
            request.request_id,
            announce_admission=True,
            deltas=True,
            trace_headers=None if span is None else carrier_of(span),
        ):
            if not isinstance(out, RequestOutputDelta):  # Admitted: the engine queued it
                yield admitted_delta(request, self.replica_id)
                continue
            now = time.monotonic()
            self.metrics.observe_output(
                out, num_prompt, first, None if last is None else now - last
            )
            first, last = False, now
            for c in out.outputs:
                generated[c.index] = generated.get(c.index, 0) + len(c.token_ids)
            if out.finished:
                self.metrics.observe_finished(out, num_prompt, generated, request.params)
                if span is not None:
                    span.set_attributes(_finished_attributes(out, num_prompt, generated))
            if request.stream:
                yield delta_of(out, num_prompt)
            else:
                whole = out if whole is None else merge(whole, out)
                if whole.finished:
                    yield delta_of(whole, num_prompt)

    def _start_span(self, request: ReplicaRequest) -> Any:
        """vLLM's `llm_request` span of a request, a child of the ingress's (None: no
        tracing); the engine core's span of it is its child."""
        if self._tracer is None:
            return None
        from opentelemetry.trace import SpanKind

        attributes = {
            GEN_AI["request_id"]: request.request_id,
            GEN_AI["model"]: self.config.model_name,
            "pagefleet.replica": self.replica_id,
            **params_attributes(request.params),
        }
        return self._tracer.start_span(
            "llm_request",
            context=context_of(request.trace_context),
            kind=SpanKind.SERVER,
            attributes=attributes,
        )

    def check_health(self) -> None:
        self.engine.check_health()

    async def check_block_accounting(self) -> dict[str, Any]:
        """Wait until idle, then check the pool (for tests and operators)."""
        await asyncio.wait_for(self.engine.wait_idle(), 60)
        await self.engine.check_block_accounting()
        stats = await self.engine.fetch_stats()
        return {
            "replica": self.replica_id,
            "free": stats.num_free_blocks,
            "total": stats.num_total_blocks,
        }

    def metric_families(self) -> list[Any]:
        self.metrics.update(self.engine.stats())
        return self.metrics.families()

    def start_pusher(self) -> None:
        """Push this replica's metrics to the hub every period, from a task of its own
        (started with the deployment, on its event loop)."""
        if self._push is not None and self._pusher is None:
            self._pusher = asyncio.get_running_loop().create_task(self._push_loop())

    async def _push_loop(self) -> None:
        assert self._push is not None
        while True:
            try:
                await self._push(self.replica_id, self.metric_families())
            except Exception:  # the hub restarts with Serve; keep serving meanwhile
                logger.warning("could not push metrics", exc_info=True)
            await asyncio.sleep(self._metrics_period_s)

    async def shutdown(self) -> None:
        if self._pusher is not None:
            self._pusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pusher
        await self.engine.shutdown()


def _finished_attributes(
    out: RequestOutputDelta, num_prompt: int, generated: dict[int, int]
) -> dict[str, Any]:
    """vLLM's usage and latency attributes of a finished request, for `llm_request`."""
    return {
        GEN_AI["prompt_tokens"]: num_prompt,
        GEN_AI["completion_tokens"]: sum(generated.values()),
        **latency_attributes(out.metrics),
    }


class LocalBackend:
    """`api.EngineBackend` over an `LLMReplica` in this process (tests, no Ray)."""

    def __init__(self, replica: LLMReplica) -> None:
        self.replica = replica

    async def info(self) -> EngineInfo:
        return await self.replica.info()

    def generate(self, request: ReplicaRequest) -> AsyncIterator[RequestDelta]:
        return self.replica.generate(request)

    async def metric_snapshots(self) -> list[list[Any]]:
        """The replica's series, and the ingress's own in this process (`INGRESS_SERIES`:
        not every `pagefleet:` series the process holds, such as a router's)."""
        from prometheus_client import REGISTRY

        from .http.observability import INGRESS_SERIES

        own = [f for f in REGISTRY.collect() if f.name in INGRESS_SERIES]
        return [self.replica.metric_families(), own]

    async def healthy(self) -> bool:
        return not self.replica.engine.is_dead
