"""The OpenAI-compatible HTTP layer (FastAPI), laid out as vLLM's `entrypoints/openai/`.

| module | its one job |
|---|---|
| `app.py` | `create_app`: gate, error handlers, routers, the OpenAPI document; `reconfigure`: new live settings in place |
| `gate.py` | the API key, the body size and its read deadline, before anything is parsed; the arrival stamp |
| `header_limits.py` | the bound on header fields (431), installed in Serve's proxy through its callback |
| `errors.py` | OpenAI's error body; every failure mapped to a status by type |
| `protocol.py` | request bodies (pydantic); checks a request alone allows |
| `response_models.py` | response bodies (pydantic), whole and streamed |
| `fields.py` | known request fields pagefleet does not implement: a 400 naming each; unknown ones logged |
| `serving.py` | validation against the engine (constraints on the validator's threads), tokenization, all under the deadline |
| `structured.py` | a request's output constraint (`response_format`, `guided_*`, `structured_outputs`) and its size limits |
| `schemas.py` | JSON schemas closed as vLLM's default backend reads them |
| `tools.py` | what `tools` / `tool_choice` ask: the constraint, the template's tools, the parser |
| `tool_parsers.py` | tool calls read out of a sample's text as it streams (Hermes blocks, call lists) |
| `model_tool_parsers.py` | `auto` tool calls by model family (vLLM's `tool_call_parser` names); the choice from a template |
| `reasoning_parsers.py` | reasoning read out of a sample's text (vLLM's `reasoning_parser` names) |
| `chat_parsing.py` | one chat choice's text through its reasoning, then its tool-call parser |
| `beam.py` | `use_beam_search`: vLLM's online beam search over one-token engine requests |
| `tokenizer.py` | every tokenizer call, on a thread of its own |
| `fanout.py` | one request's prompts on the engines, merged; admission; the deadline |
| `response_size.py` | the bound on one non-streamed response's size |
| `completions.py`, `chat.py` | a route each, and the builder of its chunks or body |
| `responses/` | `/v1/responses` over the chat path: protocol, serving, store, router |
| `observability.py` | `X-Request-Id`, the per-request log line, the ingress's HTTP metrics |
| `logprobs.py` | logprob tables in OpenAI's two shapes |
| `sse.py` | typed chunks as server-sent events |
| `tokenize.py`, `models.py`, `service.py` | /tokenize and /detokenize; /v1/models; /health, /version, /metrics |
| `openapi.py` | the OpenAPI document, made to say what the server enforces |
| `backend.py` | `EngineBackend`: the seam to the engines (Serve handle or in-process) |
| `state.py` | what the routes share, from `app.state` |
"""

from __future__ import annotations

from .app import create_app, reconfigure
from .backend import EngineBackend
from .errors import RETRY_AFTER_S, APIError

__all__ = ["RETRY_AFTER_S", "APIError", "EngineBackend", "create_app", "reconfigure"]
