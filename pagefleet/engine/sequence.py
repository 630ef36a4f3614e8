"""One request's state inside the engine.

A seeded sequence's randomness is a pure function of (seed, sample index,
output index): `sample_seed` hashes the three (splitmix64) into the seed of
the noise its next token is drawn with. No generator carries history, so a
continuation (`SamplingParams.output_offset`: its prompt ends with the output
already produced) draws exactly what the uninterrupted request would have.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from .grammar_state import GrammarState


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """A request being generated.

    `token_ids` is prompt + output so far. `num_computed_tokens` counts the
    tokens whose K/V are in the cache; the next step computes
    token_ids[num_computed_tokens:] (all of the prompt on admission, one token
    per step while decoding, a chunk at a time under chunked prefill).
    Preemption by recompute resets it to 0. `block_table`, `block_hashes`
    and `num_registered_blocks` are mutated only by the BlockManager.

    A request with n > 1 samples starts as one sequence; once all its prompt
    but the last token is computed, it forks (`num_forks_pending`) into n
    sequences sharing the prompt's blocks, told apart by `index`.

    A constrained request's sequences each carry their own `grammar` (set
    when its grammar is compiled, before the sequence is first scheduled); a
    fork copies it. Preemption leaves it as it is: it has consumed exactly
    the output tokens, which recomputing does not change.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    index: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    cache_salt: str | None = None  # the request's: mixed into its block hashes
    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    # Prompt tokens its latest admission found in the prefix cache (vLLM's num_cached_tokens).
    num_cached_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    num_registered_blocks: int = 0
    # Leading block-table entries already back in the pool: out of every layer's
    # sliding window (the entries stay, so positions keep their blocks' indices).
    num_freed_blocks: int = 0
    num_forks_pending: int = 0
    # The prompt logprobs computed so far (shared by a request's samples): the
    # runner computes each once, even across preemption.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    grammar: GrammarState | None = None
    # An embedding request under mean pooling: the sum of its computed tokens' final
    # hidden states (fp32), reset when its prefill restarts from token 0.
    pooled_sum: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    def sample_seed(self) -> int | None:
        """The seed of the noise this sequence's next token is drawn with (None: unseeded)."""
        p = self.params
        if p.seed is None:
            return None
        return token_seed(p.seed, p.sample_index + self.index, self.num_generated_tokens)

    def fork(self, index: int) -> Sequence:
        """A sibling sample: same tokens and progress, its own index and noise (no blocks yet)."""
        child = Sequence(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            params=self.params,
            prompt=self.prompt,
            index=index,
            arrival_time=self.arrival_time,
            cache_salt=self.cache_salt,
        )
        child.token_ids = list(self.token_ids)
        child.num_computed_tokens = self.num_computed_tokens
        child.block_hashes = list(self.block_hashes)
        child.status = self.status
        child.prompt_logprobs = self.prompt_logprobs
        child.grammar = self.grammar.fork() if self.grammar is not None else None
        return child

    @property
    def num_schedulable_tokens(self) -> int:
        """Tokens the scheduler may compute now: a request about to fork stops one short."""
        end = self.num_tokens - (1 if self.num_forks_pending else 0)
        return end - self.num_computed_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def num_generated_tokens(self) -> int:
        """Output tokens of the whole request: a continuation's earlier ones included."""
        return self.params.output_offset + self.num_output_tokens

    @property
    def generated_token_ids(self) -> list[int]:
        """The whole request's output so far (a continuation's earlier tokens included)."""
        return self.token_ids[self.num_prompt_tokens - self.params.output_offset :]

    @property
    def original_prompt_token_ids(self) -> list[int]:
        """The prompt without a continuation's earlier output tokens."""
        return self.prompt_token_ids[: self.num_prompt_tokens - self.params.output_offset]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED


_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def token_seed(seed: int, sample_index: int, output_index: int) -> int:
    """A 62-bit seed for one token's noise: splitmix64 over (seed, sample, output index)."""
    x = _splitmix64(seed & _MASK64)
    x = _splitmix64(x ^ sample_index)
    return _splitmix64(x ^ output_index) >> 2
