"""Incremental detokenization that is correct across multi-byte characters.

Byte-level BPE splits one character over several tokens; decoding tokens one
at a time would emit U+FFFD halves. As vLLM (and the tokenizers library's
DecodeStream) do, the text of a window of recent tokens is compared with the
text of the same window minus the newest tokens: only the new suffix is
emitted, and nothing while it still ends in an incomplete character. Bytes
held back that way are never emitted unless a later token completes them:
a sample that ends on half a character ends without it, as vLLM's does.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

# Prompt tokens kept as left context so the first output token decodes with the
# spacing it has in context.
_PROMPT_CONTEXT = 5


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        skip_special_tokens: bool,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly '')."""
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return full[len(prefix) :]
        return ""
