"""The streamed chunks' cheap encoding (sse.ChunkEnvelope over plain dicts) writes the
very bytes the protocol's pydantic chunk models do, for every shape a chunk takes."""

from __future__ import annotations

import pytest

from pagefleet.cluster.http.response_models import (
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    CompletionStreamChoice,
    CompletionStreamResponse,
    DeltaMessage,
    TopLogprob,
)
from pagefleet.cluster.http.sse import ChunkEnvelope, event

COMPLETION_LOGPROBS = CompletionLogprobs(
    text_offset=[3, 4],
    token_logprobs=[-0.25, -1.0000001],
    tokens=[" h\u00e9", '"q"'],
    top_logprobs=[{" h\u00e9": -0.25, "x": -3.5}, None],
)
CHAT_LOGPROBS = ChatLogprobs(
    content=[
        ChatTokenLogprob(
            token="\u00e9\n",
            logprob=-0.125,
            bytes=[195, 169, 10],
            top_logprobs=[TopLogprob(token="a", logprob=-2.0, bytes=[97])],
        )
    ]
)


@pytest.mark.parametrize("with_usage", [False, True])
@pytest.mark.parametrize(
    "choice",
    [
        {
            "index": 0,
            "text": " hello",
            "logprobs": None,
            "finish_reason": None,
            "stop_reason": None,
        },
        {"index": 3, "text": "", "logprobs": None, "finish_reason": "stop", "stop_reason": "\n\n"},
        {
            "index": 1,
            "text": '\u00e9"\\</',
            "logprobs": None,
            "finish_reason": "length",
            "stop_reason": 7,
        },
        {
            "index": 0,
            "text": "ab",
            "logprobs": COMPLETION_LOGPROBS.model_dump(),
            "finish_reason": None,
            "stop_reason": None,
        },
    ],
)
def test_completion_chunks_match_the_pydantic_models(choice: dict, with_usage: bool) -> None:
    envelope = ChunkEnvelope("cmpl-1", "text_completion", 1700000000, "m\u00e9", with_usage)
    model_choice = CompletionStreamChoice(
        **{**choice, "logprobs": COMPLETION_LOGPROBS if choice["logprobs"] else None}
    )
    chunk = CompletionStreamResponse(
        id="cmpl-1", created=1700000000, model="m\u00e9", choices=[model_choice]
    )
    assert envelope.event([choice]) == event(chunk, with_usage)


@pytest.mark.parametrize("with_usage", [False, True])
@pytest.mark.parametrize(
    ("delta", "logprobs", "finish", "stop"),
    [
        ({"role": "assistant", "content": ""}, None, None, None),
        ({"content": " hi"}, None, None, None),
        ({}, None, "stop", 2),
        ({"content": "x"}, CHAT_LOGPROBS, "length", None),
    ],
)
def test_chat_chunks_match_the_pydantic_models(
    delta: dict,
    logprobs: ChatLogprobs | None,
    finish: str | None,
    stop: int | None,
    with_usage: bool,
) -> None:
    envelope = ChunkEnvelope("chatcmpl-1", "chat.completion.chunk", 5, "m", with_usage)
    choice = {
        "index": 2,
        "delta": delta,
        "logprobs": None if logprobs is None else logprobs.model_dump(),
        "finish_reason": finish,
        "stop_reason": stop,
    }
    model_choice = ChatCompletionStreamChoice(
        index=2,
        delta=DeltaMessage(**delta),
        logprobs=logprobs,
        finish_reason=finish,
        stop_reason=stop,
    )
    chunk = ChatCompletionStreamResponse(
        id="chatcmpl-1", created=5, model="m", choices=[model_choice]
    )
    assert envelope.event([choice]) == event(chunk, with_usage)
