"""The seam between the HTTP layer and the engines: what the app is built over.

The Serve ingress passes one that calls the engine replica deployment through a
streaming handle (`pagefleet/cluster/ingress.py`); in-process tests pass one over a local
`LLMReplica` (`pagefleet/cluster/replica.py`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from ..replica_messages import EngineInfo, ReplicaRequest, RequestDelta


class EngineBackend(Protocol):
    async def info(self) -> EngineInfo: ...

    def generate(self, request: ReplicaRequest) -> AsyncIterator[RequestDelta]: ...

    async def metric_snapshots(self) -> list[list[Any]]: ...

    async def healthy(self) -> bool: ...
