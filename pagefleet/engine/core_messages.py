"""What crosses between an engine core and its caller: commands in, events out.

The caller (`AsyncLLMEngine`, through a `core_host`) and the core (`EngineCore`,
in a thread or a process of its own) share only these types. Commands are plain
picklable dataclasses; events cross a pipe once per step as typed msgpack
(`encode_events` / `decode_events`), holding each request's news only
(`output_delta.py`), never pickled engine objects. This module loads no torch:
a caller whose core runs in a child process (a Serve replica) never imports the
engine proper.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import msgspec

from .output_delta import RequestOutputDelta
from .sampling_params import SamplingParams
from .startup import StartupTimeline
from .stats import EngineStats

if TYPE_CHECKING:
    from .input_processor import PromptType


# -- commands (caller -> core) ----------------------------------------------------


@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt: PromptType
    params: SamplingParams
    # vLLM's name: the caller's span as W3C headers, when the request is traced.
    trace_headers: dict[str, str] | None = None


@dataclass(frozen=True)
class AbortRequests:
    request_ids: tuple[str, ...]


@dataclass(frozen=True)
class Query:
    """Ask the core something; the answer comes back in `CoreEvents.replies`.

    name: "stats" (a full EngineStats) or "check_accounting" (None, or the
    AssertionError's message when the block pool does not balance).
    """

    query_id: int
    name: str


@dataclass(frozen=True)
class Shutdown:
    pass


Command = AddRequest | AbortRequests | Query | Shutdown


# -- events (core -> caller) --------------------------------------------------------


@dataclass(frozen=True)
class RequestError:
    """Why a request failed: the name of its error type (errors.py: InvalidRequestError,
    EngineOverloadedError or RequestFailedError) and the message."""

    request_id: str
    error: str
    message: str


# A query's answer: EngineStats for "stats", None or a message for "check_accounting".
Reply = EngineStats | str | None


class CoreEvents(msgspec.Struct, array_like=True):
    accepted: list[str] = msgspec.field(default_factory=list)
    # The prompt ids of accepted requests whose prompt came as text (the caller had
    # none to build whole outputs with); never for a prompt given as ids.
    prompt_token_ids: dict[str, list[int]] = msgspec.field(default_factory=dict)
    rejected: list[RequestError] = msgspec.field(default_factory=list)
    outputs: list[RequestOutputDelta] = msgspec.field(default_factory=list)
    failed: list[RequestError] = msgspec.field(default_factory=list)
    replies: dict[int, Reply] = msgspec.field(default_factory=dict)
    stats: EngineStats | None = None

    def __bool__(self) -> bool:
        return bool(
            self.accepted
            or self.rejected
            or self.outputs
            or self.failed
            or self.replies
            or self.stats is not None
        )


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(CoreEvents)


def encode_events(events: CoreEvents) -> bytes:
    return _encoder.encode(events)


def decode_events(data: bytes) -> CoreEvents:
    return _decoder.decode(data)


@dataclass(frozen=True)
class CoreReady:
    """Sent once the engine is built: what a client needs to know of it."""

    max_model_len: int
    vocab_size: int
    block_size: int
    num_kv_blocks: int
    max_num_seqs: int
    stats: EngineStats
    # Seconds start-up spent compiling the forward (None: the model runs eagerly).
    compile_seconds: float | None = None
    # The engine's start-up phases (its process, imports, tokenizer, weights, compile...).
    startup: StartupTimeline | None = None


class Inbox(Protocol):
    def get(self, block: bool) -> list[Command]:
        """Every command waiting; with block=True wait for at least one."""
        ...
