"""Logprob tables as OpenAI returns them: completions' parallel lists, chat's entries."""

from __future__ import annotations

from .protocol import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob
from .tokenizer import AsyncTokenizer


def completion_logprobs(
    tok: AsyncTokenizer, ids: list[int], lps: list[dict[int, float] | None], offset: int
) -> CompletionLogprobs:
    """`ids`' tokens with their logprobs (None for a prompt's first token), the text
    offsets counted from `offset`."""
    out = CompletionLogprobs()
    pos = offset
    for tid, top in zip(ids, lps, strict=True):
        text = tok.token_str(tid)
        out.tokens.append(text)
        out.text_offset.append(pos)
        pos += len(text)
        if top is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
        else:
            out.token_logprobs.append(top.get(tid))
            out.top_logprobs.append({tok.token_str(t): v for t, v in top.items()})
    return out


def chat_logprobs(
    tok: AsyncTokenizer, ids: list[int], lps: list[dict[int, float]], k: int
) -> ChatLogprobs:
    content = []
    for tid, top in zip(ids, lps, strict=True):
        text = tok.token_str(tid)
        ranked = sorted(top.items(), key=lambda kv: -kv[1])[:k]
        content.append(
            ChatTokenLogprob(
                token=text,
                logprob=top.get(tid, float("-inf")),
                bytes=list(text.encode()),
                top_logprobs=[
                    TopLogprob(token=(s := tok.token_str(t)), logprob=v, bytes=list(s.encode()))
                    for t, v in ranked
                ],
            )
        )
    return ChatLogprobs(content=content)
