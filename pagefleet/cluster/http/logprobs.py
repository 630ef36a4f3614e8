"""Logprob tables as OpenAI returns them: completions' parallel lists, chat's entries."""

from __future__ import annotations

from typing import Any

from .response_models import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob
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


def prompt_logprobs_table(
    tok: AsyncTokenizer, ids: list[int], lps: list[dict[int, float] | None], k: int
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: per prompt token (None for the first), its own and the k
    most likely tokens' `{logprob, rank, decoded_token}` by token id (rank: 1 for the
    most likely; null for a prompt token outside the top k)."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for tid, top in zip(ids, lps, strict=False):
        if top is None:
            out.append(None)
            continue
        ranked = sorted(top.items(), key=lambda kv: -kv[1])
        ranks = {t: r for r, (t, _) in enumerate(ranked[:k], 1)}
        out.append(
            {
                str(t): {"logprob": v, "rank": ranks.get(t), "decoded_token": tok.token_str(t)}
                for t, v in ranked
                if t in ranks or t == tid
            }
        )
    return out
