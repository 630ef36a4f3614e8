"""OpenAI's Responses API (`/v1/responses`), as vLLM lays out an endpoint family.

| module | its one job |
|---|---|
| `protocol.py` | the request body, and its conversation as chat messages |
| `serving.py` | a response made over the chat path; its output items and stream events |
| `store.py` | stored responses (bounded, per API key) for retrieve and `previous_response_id` |
| `router.py` | the routes |
"""

from __future__ import annotations

from .router import router
from .serving import ResponsesServing
from .store import MemoryResponseStore, ResponseStore, StoredResponse

__all__ = ["MemoryResponseStore", "ResponseStore", "ResponsesServing", "StoredResponse", "router"]
