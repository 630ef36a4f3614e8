"""Sampling parameters (vLLM / OpenAI semantics): what a request asks of the sampler.

Torch-free: the ingress and the router validate and carry these without loading
torch; the sampler that applies them is `sampler.py`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

_GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20
_CONSTRAINTS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on a request's output (vLLM's `structured_outputs`): exactly one of

    - `json`: a JSON schema (a dict, or its JSON text); the output is one JSON value
      that validates against it;
    - `json_object`: any JSON object;
    - `regex`: the whole output matches this regular expression;
    - `choice`: the output is exactly one of these strings;
    - `grammar`: a Lark grammar (llguidance's dialect).

    The schema is kept as canonical JSON text (no spaces; keys in the order given, since
    the output's properties follow the schema's order) so equal schemas are equal params
    and one compiled grammar serves them (`key`).

    `after_token_ids`: the constraint applies only once the output has ended with these
    tokens (the end of a reasoning block, `</think>`); the tokens before are free.
    `optional_start_token_id` makes that wait optional (a model that may skip its
    reasoning, as Qwen3 may): the first token is the constraint's or this one (`<think>`);
    only an output that opens with it waits for `after_token_ids`, any other is
    constrained from its first token.
    """

    json: str | dict | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    after_token_ids: tuple[int, ...] | None = None
    optional_start_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.after_token_ids is not None:
            after = tuple(self.after_token_ids)
            if not after or any(isinstance(t, bool) or not isinstance(t, int) for t in after):
                raise ValueError("after_token_ids must be a non-empty list of token ids")
            object.__setattr__(self, "after_token_ids", after)
        start = self.optional_start_token_id
        if start is not None and (isinstance(start, bool) or not isinstance(start, int)):
            raise ValueError("optional_start_token_id must be a token id")
        if start is not None and self.after_token_ids is None:
            raise ValueError("optional_start_token_id needs after_token_ids")
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as e:
                    raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
            if not isinstance(schema, dict | bool):
                raise ValueError("a JSON schema must be an object (or true/false)")
            # Key order is kept: a schema's property order is the order the output's
            # properties are generated in (as OpenAI does), so it is part of the schema.
            canonical = json.dumps(schema, separators=(",", ":"))
            object.__setattr__(self, "json", canonical)
        if self.choice is not None:
            choice = tuple(self.choice)
            if not choice or any(not isinstance(c, str) or not c for c in choice):
                raise ValueError("choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", choice)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string")
        given = [n for n in _CONSTRAINTS if getattr(self, n) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured outputs take exactly one of json, json_object, regex, choice, "
                f"grammar; got {given or 'none'}"
            )

    @property
    def kind(self) -> str:
        """Which constraint it is: one of json, json_object, regex, choice, grammar."""
        return next(n for n in _CONSTRAINTS if getattr(self, n) not in (None, False))

    @property
    def key(self) -> tuple[str, str]:
        """What a compiled grammar is cached by: the kind and its canonical text."""
        kind = self.kind
        value = getattr(self, kind)
        text = "\x00".join(value) if kind == "choice" else "" if kind == "json_object" else value
        return kind, text  # type: ignore[return-value]


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the tokens of one request.

    temperature 0 means greedy. top_k 0 (or -1) and top_p 1 disable those
    filters. `stop` strings end generation and are not included in the text;
    `stop_token_ids` end it too. `min_tokens` holds off EOS and stop tokens.
    `n` samples share the prompt's KV blocks (copy-on-write); with `best_of`
    > n, best_of are generated and the n with the highest cumulative logprob
    returned. `logprobs` / `prompt_logprobs` = k return, per token, the chosen
    token's and the k most likely tokens' logprobs: the log-softmax of the
    model's raw logits, before penalties and temperature (as vLLM reports).
    `structured_outputs` constrains every sample's tokens to a grammar (the
    allowed-token mask applies before penalties, temperature and the filters).

    vLLM's logits processors: `logit_bias` adds its value to a token's logit;
    `allowed_token_ids` leaves only those tokens samplable; `bad_words` are never
    generated (each word's tokens, with and without a leading space: a word's last
    token is banned wherever the tokens before it end the output). The engine
    tokenizes `bad_words` into `bad_words_token_ids` when it takes the request.

    `priority` (vLLM's request field): lower is sooner, under an engine whose
    `scheduling_policy` is "priority" (ignored under "fcfs").

    Continuations (resuming a request elsewhere): a request whose prompt ends with
    the first `output_offset` output tokens of an earlier request with the same
    params continues it. `max_tokens`, `min_tokens` and stop-string hold-back count
    over the whole output (those tokens included); a seeded request draws each
    token's randomness from (seed, sample index, output index), so the
    continuation's tokens are exactly those the uninterrupted request would have
    sampled. `sample_index`: which of the earlier request's samples (n > 1) this
    one continues (a continuation has n = 1).

    `embed`: a pooling request (vLLM's pooling runner for a generative model). It
    runs its prompt's prefill only and returns, instead of tokens, the final hidden
    states (after the final norm) pooled as the engine's `pooling` setting says and
    L2-normalized; it samples nothing, so it takes one sample and no constraint.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    min_tokens: int = 0
    stop: tuple[str, ...] | list[str] | str | None = None
    stop_token_ids: tuple[int, ...] | list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    n: int = 1
    best_of: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | tuple[tuple[int, float], ...] | None = None
    allowed_token_ids: tuple[int, ...] | list[int] | None = None
    bad_words: tuple[str, ...] | list[str] | None = None
    bad_words_token_ids: tuple[tuple[int, ...], ...] | None = None
    priority: int = 0
    output_offset: int = 0
    sample_index: int = 0
    embed: bool = False

    def __post_init__(self) -> None:
        # Normalise list-ish inputs to tuples so the params stay hashable/frozen.
        self._normalise_logits_processors()
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        object.__setattr__(self, "stop", tuple(stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        self._validate()

    def _normalise_logits_processors(self) -> None:
        bias = self.logit_bias
        if isinstance(bias, dict):
            bias = tuple(sorted(bias.items()))
        object.__setattr__(self, "logit_bias", bias or None)
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        object.__setattr__(self, "bad_words", tuple(self.bad_words or ()))
        if self.bad_words_token_ids is not None:
            ids = tuple(tuple(w) for w in self.bad_words_token_ids)
            object.__setattr__(self, "bad_words_token_ids", ids)

    def _validate_logits_processors(self) -> None:
        for token, bias in self.logit_bias or ():
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise ValueError(f"logit_bias keys must be token ids, got {token!r}")
            if isinstance(bias, bool) or not isinstance(bias, int | float):
                raise ValueError(f"logit_bias values must be numbers, got {bias!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias}")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty")
            if any(
                isinstance(t, bool) or not isinstance(t, int) or t < 0
                for t in self.allowed_token_ids
            ):
                raise ValueError("allowed_token_ids must be non-negative integers")
        if any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            raise ValueError("bad_words must be non-empty strings")

    @property
    def token_ids_used(self) -> list[int]:
        """Every token id the params name (checked against the vocabulary by the engine)."""
        ids = list(self.stop_token_ids) + [t for t, _ in self.logit_bias or ()]
        return ids + list(self.allowed_token_ids or ())

    def _validate_continuation(self) -> None:
        for name in ("priority", "output_offset", "sample_index"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if self.output_offset < 0 or self.sample_index < 0:
            raise ValueError("output_offset and sample_index must be >= 0")
        if self.max_tokens is not None and self.output_offset >= self.max_tokens:
            raise ValueError(
                f"output_offset ({self.output_offset}) must be < max_tokens ({self.max_tokens}): "
                "max_tokens counts the whole output"
            )
        if (self.output_offset or self.sample_index) and self.num_samples > 1:
            raise ValueError(
                "a continuation (output_offset, sample_index) continues one sample: n=1"
            )

    def _validate_embed(self) -> None:
        if self.embed and (self.num_samples > 1 or self.structured_outputs is not None):
            raise ValueError("an embedding request takes one sample and no structured outputs")

    def _validate(self) -> None:
        self._validate_embed()
        self._validate_logits_processors()
        self._validate_continuation()
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 100.0 or self.temperature != self.temperature:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(
                f"top_k must be -1 (disable), 0 (disable) or positive, got {self.top_k}"
            )
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative integers")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        # Out of these ranges torch raises only later, inside a batched step (a fork's
        # generator, the top-k tensor), where it would fail every request of the step.
        if self.seed is not None and not -(2**63) <= self.seed <= 2**63 - 1:
            raise ValueError(f"seed must be a 64-bit signed integer, got {self.seed}")
        if self.top_k > 2**31 - 1:
            raise ValueError(f"top_k must be at most {2**31 - 1}, got {self.top_k}")
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) must be >= n ({self.n})")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {k}")

    @property
    def num_samples(self) -> int:
        """Sequences generated for the request (best_of, at least n)."""
        return max(self.n, self.best_of or self.n)

    @property
    def needs_logprobs(self) -> bool:
        return self.logprobs is not None or self.num_samples > self.n

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def needs_logits_processors(self) -> bool:
        """Whether logit_bias or allowed_token_ids change this row's logits."""
        return self.logit_bias is not None or self.allowed_token_ids is not None

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )
