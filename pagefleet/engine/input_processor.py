"""Requests in: prompts and sampling parameters checked and tokenized for one engine.

Everything a caller can get wrong raises ValueError with the reason, before
anything is queued: a server turns ValueError into a 400 and goes on, while
any other exception would mean a bug in the engine.
"""

from __future__ import annotations

import operator
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from transformers import PreTrainedTokenizerBase

from .handoffs import EngineRequest
from .sampling_params import SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from .grammar_compiler import GrammarCompiler

PromptType = str | list[int] | dict[str, Any]

_PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "cache_salt"})
# SamplingParams fields that must hold integers (None allowed where the field
# defaults to None); its own checks compare them but let 2.5 or True through.
_INT_FIELDS = (
    "max_tokens",
    "top_k",
    "min_tokens",
    "seed",
    "n",
    "best_of",
    "logprobs",
    "prompt_logprobs",
    "priority",
    "output_offset",
    "sample_index",
)
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
_BOOL_FIELDS = ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output")


def cache_salt(prompt: PromptType) -> str | None:
    """A prompt dict's `cache_salt` (vLLM's): a non-empty str, or None when not given."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError("cache_salt must be a non-empty string")
    return salt


class InputProcessor:
    """Turns (request id, prompt, params) into an `EngineRequest` this engine can run."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        max_model_len: int,
        max_num_seqs: int,
        grammars: GrammarCompiler | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.grammars = grammars

    def process(self, request_id: str, prompt: PromptType, params: SamplingParams) -> EngineRequest:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"a request id is a non-empty str, got {request_id!r}")
        text, ids = self.tokenize(prompt)
        self.validate_params(params)
        if params.output_offset >= len(ids):
            raise ValueError(
                f"output_offset ({params.output_offset}) must be less than the prompt's "
                f"{len(ids)} tokens: a continuation's prompt is the prompt, then the output so far"
            )
        if params.bad_words and params.bad_words_token_ids is None:
            params = replace(params, bad_words_token_ids=self.bad_words_token_ids(params.bad_words))
        salt = cache_salt(prompt)
        return EngineRequest(request_id, text, ids, params, time.monotonic(), salt)

    def bad_words_token_ids(self, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        """Each bad word's tokens as it would begin the text and, where a leading space
        makes it other tokens of the same count, as it would follow a word (vLLM's rule)."""
        out: list[tuple[int, ...]] = []
        for word in words:
            bare = tuple(self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = tuple(self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            out.append(bare)
            if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
                out.append(spaced)
        return tuple(w for w in out if w)

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """A prompt as (text or None, token ids), validated against this model."""
        if isinstance(prompt, str):
            text: str | None = prompt
            ids = self._encode(prompt)
        elif isinstance(prompt, dict):
            unknown = set(prompt) - _PROMPT_KEYS
            if unknown:
                raise ValueError(
                    f"unsupported prompt keys {sorted(map(str, unknown))}; "
                    "a prompt dict has 'prompt' and/or 'prompt_token_ids', and may have "
                    "'cache_salt'"
                )
            text = prompt.get("prompt")
            if text is not None and not isinstance(text, str):
                raise ValueError(f"'prompt' must be a str, got {type(text).__name__}")
            if "prompt_token_ids" in prompt:
                ids = self._token_ids(prompt["prompt_token_ids"])
            elif text is not None:
                ids = self._encode(text)
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        elif isinstance(prompt, list | tuple):
            text, ids = None, self._token_ids(prompt)
        else:
            raise ValueError(
                "a prompt is a str, a list of token ids or {'prompt_token_ids': [...]}, "
                f"got {type(prompt).__name__}"
            )
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens; this model takes at most "
                f"{self.max_model_len - 1} so that one can be generated (max_model_len)"
            )
        return text, ids

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=True)

    def _token_ids(self, ids: object) -> list[int]:
        if not isinstance(ids, list | tuple):
            raise ValueError(
                f"prompt token ids must be a list of integers, got {type(ids).__name__}"
            )
        try:
            # operator.index accepts ints and integer scalars (numpy, torch), not floats.
            out = [operator.index(t) for t in ids if not isinstance(t, bool)]
        except TypeError:
            out = []
        if len(out) != len(ids) or any(not 0 <= t < self.vocab_size for t in out):
            raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size})")
        return out

    def validate_params(self, params: SamplingParams) -> None:
        """Checks that SamplingParams' own cannot make: types, and this engine's limits."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        for name in _INT_FIELDS:
            value = getattr(params, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        for name in _FLOAT_FIELDS:
            value = getattr(params, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"{name} must be a number, got {value!r}")
        for name in _BOOL_FIELDS:
            if not isinstance(getattr(params, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(params, name)!r}")
        if any(isinstance(t, bool) for t in params.stop_token_ids):
            raise ValueError("stop_token_ids must be integers")
        if any(t >= self.vocab_size for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be < vocab size {self.vocab_size}")
        if any(t >= self.vocab_size for t, _ in params.logit_bias or ()):
            raise ValueError(f"logit_bias keys must be token ids < vocab size {self.vocab_size}")
        if any(t >= self.vocab_size for t in params.allowed_token_ids or ()):
            raise ValueError(f"allowed_token_ids must be < vocab size {self.vocab_size}")
        if params.num_samples > self.max_num_seqs:
            raise ValueError(
                f"n / best_of ({params.num_samples}) exceeds max_num_seqs ({self.max_num_seqs})"
            )
        constraint = params.structured_outputs
        if constraint is not None:
            if not isinstance(constraint, StructuredOutputsParams):
                raise ValueError(
                    "structured_outputs must be a StructuredOutputsParams, "
                    f"got {type(constraint).__name__}"
                )
            if self.grammars is None:
                raise ValueError("this engine cannot serve structured outputs (no tokenizer)")
            self.grammars.check(constraint)  # InvalidRequestError naming the constraint
            if any(not 0 <= t < self.vocab_size for t in constraint.after_token_ids or ()):
                raise ValueError(f"after_token_ids must be < vocab size {self.vocab_size}")
            start = constraint.optional_start_token_id
            if start is not None and not 0 <= start < self.vocab_size:
                raise ValueError(f"optional_start_token_id must be < vocab size {self.vocab_size}")
