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

    __slots__ = ("_matcher",)

    def __init__(self, matcher: LLMatcher) -> None:
        self._matcher = matcher

    def fork(self) -> GrammarState:
        """An independent copy at the same place (for a forked sample)."""
        return GrammarState(self._matcher.deep_copy())

    def accept(self, token: int) -> bool:
        """Consume one sampled token; False if the grammar does not allow it (error state)."""
        return self._matcher.consume_token(token)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` ([rows, ceil(vocab / 32)] int32, CPU)."""
        # Imported on first use: llguidance.torch compiles a kernel at import, which loads
        # torch._dynamo and inductor (2 s of every engine start) for a constraint alone.
        from llguidance.torch import fill_next_token_bitmask

        fill_next_token_bitmask(self._matcher, bitmask, row)

    @property
    def is_finished(self) -> bool:
        """The grammar takes no more tokens (complete, or refused a token)."""
        return self._matcher.is_stopped()

    @property
    def is_error(self) -> bool:
        return self._matcher.is_error()

    @property
    def error(self) -> str:
        return self._matcher.get_error()
