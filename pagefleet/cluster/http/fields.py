"""Request fields pagefleet does not model: refused by name, or dropped with a log line.

A request body's fields that the protocol's models do not declare land in the
model's `model_extra`. Those OpenAI's or vLLM's request schemas know are looked
up here: each has the values that ask for nothing (absent, null, the schema's
default, or a value pagefleet's behaviour already is) and any other value is a 400
whose `param` names the field, so a client never gets an answer that ignored what
it asked. A field neither schema knows is dropped, as vLLM drops it, with one
debug log line naming it. `docs/api.md` lists every field and its fate.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from .errors import APIError

logger = logging.getLogger("pagefleet.http")


@dataclass(frozen=True)
class Refused:
    """A known field pagefleet does not implement: `accepted` are the values that ask
    for nothing it lacks; `why` ends the 400's message."""

    why: str
    accepted: tuple[Any, ...] = (None,)


# Known fields that ask for nothing pagefleet lacks, whatever their value: identifiers
# for abuse monitoring and cache-bucketing hints (the router finds cached prefixes itself),
# and vLLM's `request_id` (engine requests are always named by the server, whatever a
# client sends: two clients sending the same id must both run).
ACCEPTED = frozenset({"safety_identifier", "prompt_cache_key", "request_id"})
_NO_STORE = "responses are not stored by this server"
_SHARED: dict[str, Refused] = {
    # OpenAI's
    "metadata": Refused(_NO_STORE),
    "store": Refused(_NO_STORE, (None, False)),
    "service_tier": Refused("there is one service tier", (None, "auto", "default")),
    # vLLM's
    "logits_processors": Refused("custom logits processors are not loaded"),
    "return_tokens_as_token_ids": Refused("use return_token_ids", (None, False)),
    "spaces_between_special_tokens": Refused(
        "special tokens are decoded as the tokenizer joins them", (None, True)
    ),
    "guided_decoding_backend": Refused(
        "the backend is llguidance", (None, "auto", "guidance", "llguidance")
    ),
    "guided_whitespace_pattern": Refused("JSON is generated compact"),
    "structural_tag": Refused("structural tags are not supported"),
    "kv_transfer_params": Refused("disaggregated prefill is not supported"),
    "vllm_xargs": Refused("no extension reads them"),
    "mm_processor_kwargs": Refused("the served models are text-only"),
    "prompt_embeds": Refused("prompts are text or token ids"),
}

COMPLETION_FIELDS: dict[str, Refused] = {
    **_SHARED,
    "suffix": Refused("insertion (fill-in-the-middle) is not supported"),
}

CHAT_FIELDS: dict[str, Refused] = {
    **_SHARED,
    "best_of": Refused("best_of is a completions field; use n", (None, 1)),
    "audio": Refused("the served models are text-only"),
    "modalities": Refused("the served models are text-only", (None, ["text"])),
    "prediction": Refused("predicted outputs are not supported"),
    "moderation": Refused("there is no moderation"),
    "prompt_cache_options": Refused("prefix caching is automatic, without breakpoints"),
    "prompt_cache_retention": Refused(
        "cached prefixes stay while the KV cache holds them", (None, "in_memory")
    ),
    "verbosity": Refused("no template reads it"),
    "web_search_options": Refused("there is no web search"),
    "echo": Refused("the reply is never prefixed with the last message", (None, False)),
    "chat_template": Refused("a request may not bring its own template"),
}


RESPONSES_FIELDS: dict[str, Refused] = {
    "service_tier": _SHARED["service_tier"],
    "background": Refused("responses run in the foreground", (None, False)),
    "background_options": Refused("responses run in the foreground"),
    "conversation": Refused("conversations continue by previous_response_id"),
    "context_management": Refused("the context is not compacted"),
    "include": Refused("no extra output is included", (None, [])),
    "max_tool_calls": Refused("built-in tools are not run"),
    "prompt": Refused("stored prompt templates are not supported"),
    "reasoning": Refused("reasoning settings are the chat template's (reasoning_parser)"),
    "top_logprobs": Refused("responses carry no logprobs", (None, 0)),
    "truncation": Refused("a conversation past the context is a 400", (None, "disabled")),
    "stream_options": Refused("no stream option is supported", (None,)),
    "image": Refused("the served models are text-only"),
    "moderation": Refused("there is no moderation"),
    "prompt_cache_options": CHAT_FIELDS["prompt_cache_options"],
    "prompt_cache_retention": CHAT_FIELDS["prompt_cache_retention"],
    "access_programs": Refused("not supported"),
}


def refuse_unsupported(extra: dict[str, Any] | None, known: dict[str, Refused]) -> None:
    """400 naming the first known field whose value asks for what is not implemented;
    fields neither schema knows are logged (debug) and dropped."""
    unknown = []
    for name, value in (extra or {}).items():
        rule = known.get(name)
        if name in ACCEPTED:
            continue
        if rule is None:
            unknown.append(name)
        elif not any(value == a and type(value) is type(a) for a in rule.accepted):
            raise APIError(400, f"{name} is not supported by this server: {rule.why}", name)
    if unknown:
        logger.debug("request fields dropped (neither OpenAI's nor vLLM's): %s", sorted(unknown))
