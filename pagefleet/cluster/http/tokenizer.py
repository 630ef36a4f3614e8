"""The ingress's tokenizer, off the event loop.

Tokenizing a 2 MiB body takes a good part of a second: on the event loop it would
stall every other stream of the ingress. Every tokenizer call (encode, chat
template, decode) runs on one thread of its own: one, because a Hugging Face fast
tokenizer is not safe to call from several threads at once ("Already borrowed").
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from .errors import APIError
from .protocol import ChatMessage
from .response_size import TokenWidths

_T = TypeVar("_T")


@dataclass(frozen=True)
class TemplateInputs:
    """What a chat template renders besides the messages."""

    # apply_chat_template's own parameters: never a template variable from a request.
    RESERVED: ClassVar[frozenset[str]] = frozenset(
        {
            "conversation",
            "tools",
            "documents",
            "chat_template",
            "add_generation_prompt",
            "continue_final_message",
            "tokenize",
            "padding",
            "truncation",
            "max_length",
            "return_tensors",
            "return_dict",
            "return_assistant_tokens_mask",
            "tokenizer_kwargs",
        }
    )

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    documents: list[dict[str, str]] | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)


def load_tokenizer(path: str) -> Any:
    """The checkpoint's tokenizer, as the engine loads it (AutoTokenizer: the model's own
    tokenizer class, whose pre-tokenizer may differ from a generic fast tokenizer's).

    Note: transformers (5.x) imports torch inside AutoTokenizer whenever torch is
    installed, so an ingress process that loads one has torch in memory although no
    pagefleet module it runs imports it (the import-linter contracts hold that).
    """
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


class AsyncTokenizer:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._thread = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="pagefleet-tokenizer"
        )
        self._widths: TokenWidths | None = None

    async def run(self, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, lambda: fn(*args, **kwargs))

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return (await self.encode_all([text], add_special_tokens))[0]

    async def encode_all(
        self, texts: list[str], add_special_tokens: bool = True
    ) -> list[list[int]]:
        def run() -> list[list[int]]:
            # One batch call: the tokenizer's Rust side works without the GIL meanwhile.
            return self.tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]

        try:
            return await self.run(run)
        except Exception as e:  # e.g. lone surrogates, which JSON allows and UTF-8 does not
            raise APIError(400, f"the text cannot be tokenized: {e}", "prompt") from None

    async def decode(self, ids: list[int]) -> str:
        return await self.run(self.tokenizer.decode, ids)

    async def chat_prompt(self, messages: list[ChatMessage], inputs: TemplateInputs) -> str:
        """The conversation as the model's chat template renders it, with `inputs` (tools,
        documents, the request's template variables); a template without tool support
        leaves the tools out, as with vLLM."""
        if not messages:
            raise APIError(400, "messages must not be empty", "messages")
        convo = [m.for_template() for m in messages]

        def render() -> str:
            return self.tokenizer.apply_chat_template(
                convo,
                tools=inputs.tools or None,
                documents=inputs.documents,
                tokenize=False,
                add_generation_prompt=inputs.add_generation_prompt,
                continue_final_message=inputs.continue_final_message,
                **inputs.kwargs,
            )

        try:
            return await self.run(render)
        except Exception as e:  # a template that rejects the conversation (e.g. roles)
            raise APIError(400, f"chat template failed: {e}", "messages") from None

    async def widths(self, vocab_size: int) -> TokenWidths:
        """The vocabulary's widest token (response_size.py), read once."""
        if self._widths is None:
            self._widths = await self.run(TokenWidths.of, self.tokenizer, vocab_size)
        return self._widths

    def to_json(self) -> str | None:
        """The tokenizer's own JSON (a fast tokenizer's; None for another): what
        constraints are checked against. Call it on the tokenizer's thread (`run`)."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        return None if backend is None else backend.to_str()

    @property
    def eos_ids(self) -> list[int]:
        eos = getattr(self.tokenizer, "eos_token_id", None)
        return [eos] if isinstance(eos, int) else []

    def token_str(self, token_id: int) -> str:
        """One token's text (cheap: for logprob tables, on the loop)."""
        return self.tokenizer.decode([token_id])
