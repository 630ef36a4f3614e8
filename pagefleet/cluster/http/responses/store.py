"""Stored responses: what `previous_response_id`, GET and DELETE find.

A stored response is its body and the conversation that led to it, its own output
included (chat messages, instructions excluded). Each belongs to the API key that made
it: another key's lookup finds nothing (a 404, as for an id never made). The store is
bounded: at most `max_entries` responses (the oldest goes first) and none older than
`ttl_s`. `MemoryResponseStore` is the store itself; a Serve ingress reaches one shared
copy through a deployment (`pagefleet/cluster/response_store.py`), so every ingress
replica finds what any other stored.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class StoredResponse:
    owner: str  # the digest of the API key that made it ("" without a key)
    body: dict[str, Any]
    history: list[dict[str, Any]] = field(default_factory=list)


class ResponseStore(Protocol):
    async def put(self, response_id: str, stored: StoredResponse) -> None: ...

    async def get(self, owner: str, response_id: str) -> StoredResponse | None: ...

    async def delete(self, owner: str, response_id: str) -> bool: ...


class MemoryResponseStore:
    def __init__(self, max_entries: int = 10_000, ttl_s: float = 3600.0) -> None:
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._entries: collections.OrderedDict[str, tuple[float, StoredResponse]] = (
            collections.OrderedDict()
        )

    def _expire(self) -> None:
        oldest = time.monotonic() - self.ttl_s
        while self._entries and (
            len(self._entries) > self.max_entries or next(iter(self._entries.values()))[0] < oldest
        ):
            self._entries.popitem(last=False)

    async def put(self, response_id: str, stored: StoredResponse) -> None:
        self._entries[response_id] = (time.monotonic(), stored)
        self._entries.move_to_end(response_id)
        self._expire()

    async def get(self, owner: str, response_id: str) -> StoredResponse | None:
        self._expire()
        entry = self._entries.get(response_id)
        if entry is None or entry[1].owner != owner:
            return None
        return entry[1]

    async def delete(self, owner: str, response_id: str) -> bool:
        if await self.get(owner, response_id) is None:
            return False
        del self._entries[response_id]
        return True

    def __len__(self) -> int:
        return len(self._entries)
