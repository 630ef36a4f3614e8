"""One sample's output as the caller sees it: tokens, logprobs, text, finish."""

from __future__ import annotations

import sys
from collections.abc import Sequence as Seq

from transformers import PreTrainedTokenizerBase

from .detokenizer import IncrementalDetokenizer
from .handoffs import SampleUpdate
from .output_delta import CompletionOutputDelta
from .sampling_params import SamplingParams


class SampleState:
    """One sample's text and finish, as vLLM's output processor keeps them.

    It keeps the text (stop strings are searched in it) but hands out only news:
    `emit` returns the tokens, logprobs and text that no earlier delta had.
    Invariant: every text handed out (whole or as a delta) is a prefix of the
    final text. While stop strings that are cut from the output are in play,
    the last (longest stop - 1) characters are held back, since they may yet
    begin one; a stop token ending the sample is not decoded into the text
    (unless include_stop_str_in_output), and bytes of an incomplete character
    are never emitted at all.

    A continuation (`output_offset` earlier tokens at the end of its prompt)
    starts with the earlier output's text already counted as handed out, but
    for the held-back tail: its deltas continue the interrupted stream's text
    exactly, and a stop string that began in the earlier output is found.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        params: SamplingParams,
    ) -> None:
        self.params = params
        self._detok = IncrementalDetokenizer(
            tokenizer, prompt_token_ids, params.skip_special_tokens
        )
        self.num_tokens = 0
        # Since the last emit: the new tokens and their logprobs.
        self._new_ids: list[int] = []
        self._new_logprobs: list[dict[int, float]] | None = (
            [] if params.logprobs is not None else None
        )
        self.cumulative_logprob = 0.0
        self.text = ""
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self._holdback = (
            max(len(s) for s in params.stop) - 1
            if params.stop and not params.include_stop_str_in_output
            else 0
        )
        self._streamed = 0  # characters of `text` handed out so far
        if params.output_offset:
            self._resume(tokenizer, prompt_token_ids, params.output_offset)

    def _resume(
        self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int], offset: int
    ) -> None:
        """A continuation: replay the earlier output tokens (the prompt's last `offset`),
        so the text and its hold-back stand where the interrupted sample's did, and the
        first delta begins with the characters the interrupted stream was holding back."""
        self._detok = IncrementalDetokenizer(
            tokenizer, prompt_token_ids[:-offset], self.params.skip_special_tokens
        )
        for token in prompt_token_ids[-offset:]:
            self.text += self._detok.push(token)
        self._streamed = max(0, len(self.text) - self._holdback)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def update(self, update: SampleUpdate) -> str | None:
        """Take one step's news; return the stop string that ended the sample, if one did."""
        if self.finished:  # the output side ended it already (a stop string)
            return None
        stop = None
        if update.token is not None:
            self.num_tokens += 1
            self._new_ids.append(update.token)
            if self._new_logprobs is not None:
                self._new_logprobs.append(update.logprobs or {})
            if update.chosen_logprob is not None:
                self.cumulative_logprob += update.chosen_logprob
            stop = self._append_text(
                update.token,
                stop_terminated=update.finish_reason == "stop" and not update.grammar_complete,
            )
        if stop is not None:
            self.finish_reason, self.stop_reason = "stop", stop
        elif update.finish_reason is not None:
            self.finish_reason, self.stop_reason = update.finish_reason, update.stop_reason
        return stop

    def _append_text(self, token: int, stop_terminated: bool) -> str | None:
        p = self.params
        if stop_terminated and not p.include_stop_str_in_output:
            return None  # the stop token's own text is not output
        before = len(self.text)
        self.text += self._detok.push(token)
        # Stop strings count only once more than min_tokens tokens are out (vLLM's rule).
        if (
            not p.stop
            or len(self.text) == before
            or p.output_offset + self.num_tokens <= p.min_tokens
        ):
            return None
        hit = find_stop_string(self.text, len(self.text) - before, p.stop)
        if hit is None:
            return None
        start, stop = hit
        self.text = self.text[: start + len(stop) if p.include_stop_str_in_output else start]
        return stop

    def emit(self, index: int) -> CompletionOutputDelta:
        """What no earlier delta had: the new tokens, their logprobs and the text now
        visible (`index`: the sample's index in the output)."""
        visible = len(self.text) if self.finished else max(0, len(self.text) - self._holdback)
        delta = self.text[self._streamed : visible] if visible > self._streamed else ""
        self._streamed = max(self._streamed, visible)
        ids, self._new_ids = self._new_ids, []
        logprobs = self._new_logprobs
        if logprobs is not None:
            self._new_logprobs = []
        return CompletionOutputDelta(
            index=index,
            token_ids=ids,
            text=delta,
            logprobs=logprobs,
            cumulative_logprob=self.cumulative_logprob if self.params.needs_logprobs else None,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )


def find_stop_string(text: str, new_chars: int, stops: Seq[str]) -> tuple[int, str] | None:
    """The stop string the newest `new_chars` characters completed, as (start, stop).

    Of several, the one that ends first (as if the text came a character at
    a time), ties going to the earlier in `stops`: vLLM's choice.
    """
    best: tuple[int, str] | None = None
    best_end = sys.maxsize
    for s in stops:
        start = text.find(s, max(0, len(text) - new_chars - len(s) + 1))
        if start != -1 and start + len(s) < best_end:
            best, best_end = (start, s), start + len(s)
    return best
