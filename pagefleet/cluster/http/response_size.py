"""An upper bound on one response's size, from what the request asks for.

A non-streamed response is built whole in the ingress before it is sent, so one
request's response is memory one client can make the ingress hold. The limits bound
each factor (prompts, samples, tokens, logprobs), but their product does not bound
itself: 32 prompts x n=8 x 20 logprobs x a 2,048-token echoed context is about a
gigabyte of JSON. `limits.max_response_bytes` bounds the product: before a request is
queued the ingress computes the most its JSON body could be, and refuses (400) a
request whose bound is above the limit.

The bound, per returned sample of T tokens (T = max_tokens, plus the prompt when
echoed), with W the longest token's JSON string (escapes and quotes included) and
U its UTF-8 bytes, both read off the tokenizer's whole vocabulary once:

- text: T * W
- completions' logprobs with k top entries: T * (W + 41 + (k + 1) * (W + 27)); that
  is the token string, its logprob, its text offset and up to k + 1 top entries
  (the chosen token may rank below the top k), with their separators
- chat's logprobs: T * (k + 2) * (W + 4U + 50) (token, logprob, bytes, and as many
  for each top entry)
- plus `PER_SAMPLE_BYTES` for the choice's fixed fields and `PER_RESPONSE_BYTES` for
  the envelope (id, model, usage).

Floats are counted at 25 characters (`repr` of any double fits), integers at 11.
A streamed response is sent as it is made (one step's chunk at a time), so it is
not held and not bounded here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

FLOAT_CHARS = 25
INT_CHARS = 11
PER_SAMPLE_BYTES = 256
PER_RESPONSE_BYTES = 1024


@dataclass(frozen=True)
class TokenWidths:
    """The widest token of a vocabulary: as a JSON string and as UTF-8 bytes."""

    json_chars: int
    utf8_bytes: int

    @classmethod
    def of(cls, tokenizer: Any, vocab_size: int) -> TokenWidths:
        texts = tokenizer.batch_decode([[t] for t in range(vocab_size)])
        return cls(
            json_chars=max(len(json.dumps(t, ensure_ascii=False)) for t in texts),
            utf8_bytes=max(len(t.encode("utf-8", "surrogatepass")) for t in texts),
        )


def sample_bytes(widths: TokenWidths, tokens: int, logprobs: int | None, chat: bool) -> int:
    """The most one returned sample of `tokens` tokens can add to a response."""
    w, u = widths.json_chars, widths.utf8_bytes
    per_token = w
    if logprobs is not None:
        k = logprobs
        if chat:
            per_token += (k + 2) * (w + 4 * u + FLOAT_CHARS + 25)
        else:
            per_token += w + FLOAT_CHARS + INT_CHARS + 5 + (k + 1) * (w + FLOAT_CHARS + 2)
    return PER_SAMPLE_BYTES + tokens * per_token


def response_bytes(
    widths: TokenWidths,
    tokens_per_sample: list[int],
    samples_per_prompt: int,
    logprobs: int | None,
    chat: bool,
) -> int:
    """The most a response's JSON body can be: `tokens_per_sample[i]` tokens in each of
    the `samples_per_prompt` samples of prompt i."""
    per_prompt = (sample_bytes(widths, t, logprobs, chat) for t in tokens_per_sample)
    return PER_RESPONSE_BYTES + samples_per_prompt * sum(per_prompt)
