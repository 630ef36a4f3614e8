"""One sequence's place in its constraint's grammar: an llguidance matcher of its own.

Each sequence of a constrained request carries a `GrammarState`. It has seen
exactly the sequence's output tokens, in order: the token engine makes it
consume every token sampled for the sequence (`accept`), and nothing else
moves it. So it survives preemption by recompute untouched (recomputing
rebuilds K/V, not tokens), and a forked sample (n > 1, best_of, a beam) gets a
deep copy (`fork`), after which the two advance apart.

Before each sampling step the sampler asks for the tokens the grammar allows
next, as one row of a bitmask (`fill_bitmask`: bit t of the row set iff token
t is allowed; llguidance's layout, 32 tokens per int32 word). EOS is allowed
exactly where the grammar may end. Once the grammar can take no more tokens
(`is_finished`: a closed JSON value, a complete choice, or EOS consumed where
the grammar accepts it) the sequence is finished by the token engine.

A state made with `after` tokens (the end of a reasoning block) is inactive
until the sequence's output ends with them: till then it masks nothing, takes
tokens without moving its matcher, and is never finished; the matcher sees only
what follows them. With an `optional_start` token besides (`<think>`, for a model
that may skip its reasoning) the first token decides: it may be the grammar's
first or that token (the mask allows both); that token makes the state wait for
`after`, any other activates it at once and goes to the matcher.

A continuation (a request resumed with `output_offset` tokens of its output
already produced, at the end of its prompt) gets a state advanced over those
tokens when it is admitted (`advance`), so it stands where the interrupted
request's stood.

A token the matcher refuses puts it in llguidance's error state for good
(`is_error`). With the mask applied that happens only when every token the
grammar allows was banned after it (min_tokens holding off EOS and stop tokens
where the grammar allows nothing else); the token engine ends such a sequence.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llguidance import LLMatcher

if TYPE_CHECKING:
    import torch


class GrammarState:
    """A matcher that has consumed exactly one sequence's output tokens."""

    __slots__ = ("_after", "_matcher", "_start", "_tail")

    def __init__(
        self, matcher: LLMatcher, after: tuple[int, ...] = (), optional_start: int | None = None
    ) -> None:
        self._matcher = matcher
        self._after = after  # () once active
        self._start = optional_start if after else None  # None once the first token is in
        self._tail: tuple[int, ...] = ()

    @property
    def active(self) -> bool:
        """Whether the grammar constrains the next token (its `after` tokens are out, or
        the first token may be the grammar's)."""
        return not self._after or self._start is not None

    def fork(self) -> GrammarState:
        """An independent copy at the same place (for a forked sample)."""
        copy = GrammarState(self._matcher.deep_copy(), self._after, self._start)
        copy._tail = self._tail
        return copy

    def accept(self, token: int) -> bool:
        """Consume one sampled token; False if the grammar does not allow it (error state)."""
        if self._start is not None:
            opened, self._start = token == self._start, None
            if not opened:
                self._after = ()
        if self._after:
            self._tail = (*self._tail, token)[-len(self._after) :]
            if self._tail == self._after:
                self._after = ()
            return True
        return self._matcher.consume_token(token)

    def advance(self, tokens: list[int]) -> bool:
        """Consume tokens already produced (a continuation's); False if one is refused."""
        return all(self.accept(t) for t in tokens)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` ([rows, ceil(vocab / 32)] int32, CPU)."""
        # Imported on first use: llguidance.torch compiles a kernel at import, which loads
        # torch._dynamo and inductor (2 s of every engine start) for a constraint alone.
        from llguidance.torch import fill_next_token_bitmask

        fill_next_token_bitmask(self._matcher, bitmask, row)
        if self._start is not None:
            bit = 1 << (self._start % 32)
            bitmask[row, self._start // 32] |= bit - (1 << 32) if bit >= 1 << 31 else bit

    @property
    def is_finished(self) -> bool:
        """The grammar takes no more tokens (complete, or refused a token)."""
        return not self._after and self._matcher.is_stopped()

    @property
    def is_error(self) -> bool:
        return self._matcher.is_error()

    @property
    def error(self) -> str:
        return self._matcher.get_error()
