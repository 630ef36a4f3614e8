"""The response store deployment: one copy of the stored `/v1/responses` for every
ingress replica (`http/responses/store.py` is the store; this is its home under Serve).

One replica, so a response stored through one ingress is found through any other;
the store bounds itself (count and age). `ServeResponseStore` is the ingress's view of
it: `http.responses.ResponseStore` over the deployment's handle.
"""

from __future__ import annotations

import contextvars
import uuid
from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle

from .http.responses import MemoryResponseStore, StoredResponse


@serve.deployment(ray_actor_options={"num_cpus": 0}, num_replicas=1, max_ongoing_requests=1000)
class ResponseStoreDeployment:
    def __init__(self, max_entries: int, ttl_s: float) -> None:
        self._store = MemoryResponseStore(max_entries, ttl_s)

    async def put(self, response_id: str, stored: StoredResponse) -> None:
        await self._store.put(response_id, stored)

    async def get(self, owner: str, response_id: str) -> StoredResponse | None:
        return await self._store.get(owner, response_id)

    async def delete(self, owner: str, response_id: str) -> bool:
        return await self._store.delete(owner, response_id)


class ServeResponseStore:
    """The store deployment through its handle."""

    def __init__(self, handle: DeploymentHandle) -> None:
        self._handle = handle

    async def _call(self, method: str, *args: Any) -> Any:
        # Each call its own Serve request id: calls made while serving one HTTP request
        # would share that request's, as the engine calls beside them do.
        def call() -> Any:
            serve.context._set_request_context(_internal_request_id=uuid.uuid4().hex)
            return getattr(self._handle, method).remote(*args)

        return await contextvars.copy_context().run(call)

    async def put(self, response_id: str, stored: StoredResponse) -> None:
        await self._call("put", response_id, stored)

    async def get(self, owner: str, response_id: str) -> StoredResponse | None:
        return await self._call("get", owner, response_id)

    async def delete(self, owner: str, response_id: str) -> bool:
        return await self._call("delete", owner, response_id)
