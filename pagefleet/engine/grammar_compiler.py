"""Constraints compiled against the model's vocabulary, off the step loop, cached by key.

Compiling a constraint means building an llguidance `LLMatcher` for it over
the model's tokenizer: the grammar's lexer and parser tables, plus the first
token mask (llguidance builds its lexer states lazily; computing one mask
here moves that first, slowest part off the step loop too). It runs on one
worker thread, so a slow schema never holds up a step: the token engine keeps
a constrained request out of the scheduler until its grammar's future is
done (`TokenEngine._admit_compiled`), and every other request keeps stepping.
llguidance releases the GIL while it builds a matcher.

A compiled grammar is a matcher that has consumed nothing (the template);
each sequence starts from a deep copy of it (`new_state`). It is built under
llguidance's limits (`grammar_spec.GRAMMAR_LIMITS`) and checked one token
deep (`grammar_spec.check_matcher`), so a constraint that would fail on its
first tokens fails here, on the worker, and never reaches the step loop.
Templates are kept in an LRU by `StructuredOutputsParams.key`, in-flight
compilations included, so N requests with one schema compile it once: one
miss and N - 1 hits, however close together they come. The LRU holds at most
`cache_size` entries and `cache_bytes` bytes, each entry weighing what the
process's resident memory grew by while it compiled (at least its
constraint's text; compilations run one at a time); the oldest go first, the newest always
stays. A compilation that fails is cached like one that succeeds (the same
constraint fails the same way against the same vocabulary), so a repeated bad
request fails at once.

The counters are exact: `cache_misses` counts compilations started,
`cache_hits` requests served by a grammar compiled or compiling already,
`num_compiles` / `compile_seconds` compilations finished and the time they
took (matcher construction and its first mask; the one-off conversion of
the tokenizer before the first one is not counted). The Hugging Face
tokenizer is serialized once on the caller's thread, so the worker never
touches the object the engine tokenizes and detokenizes with.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

from llguidance import LLMatcher, LLTokenizer
from transformers import PreTrainedTokenizerBase

from .errors import InvalidRequestError
from .grammar_spec import (
    GRAMMAR_LIMITS,
    check_matcher,
    describe,
    grammar_spec,
    ll_tokenizer,
    validate,
)
from .grammar_state import GrammarState
from .sampling_params import StructuredOutputsParams


class GrammarCompiler:
    """Compiled grammars by constraint key (an LRU), compiled on one worker thread."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        cache_size: int = 64,
        cache_bytes: int = 256 * 1024 * 1024,
    ) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = (
            vocab_size  # the model's: its logits may have more rows than the tokenizer
        )
        self._eos = sorted(eos_token_ids)
        self._ll_tokenizer: LLTokenizer | None = None
        self._tokenizer_json: str | None = None  # its serialization, taken on the caller's thread
        self.cache_size = cache_size
        self.cache_bytes = cache_bytes
        self._cache: OrderedDict[tuple[str, str], Future[LLMatcher]] = OrderedDict()
        self._weights: dict[tuple[str, str], int] = {}  # a finished compilation's bytes
        self._lock = threading.Lock()  # the counters the worker updates
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagefleet-grammar")
        self.cache_hits = 0
        self.cache_misses = 0
        self.num_compiles = 0
        self.compile_seconds = 0.0

    def check(self, params: StructuredOutputsParams) -> None:
        """Raise InvalidRequestError (a ValueError) naming the constraint if llguidance
        rejects it; free for a constraint already compiled or compiling."""
        if params.key in self._cache:
            return
        message = validate(params)
        if message is not None:
            raise InvalidRequestError(message)

    def submit(self, params: StructuredOutputsParams) -> Future[LLMatcher]:
        """The compiled template for `params`, done or to come (a failure: InvalidRequestError)."""
        key = params.key
        future = self._cache.get(key)
        if future is not None:
            self._cache.move_to_end(key)
            self.cache_hits += 1
            return future
        self.cache_misses += 1
        if self._ll_tokenizer is None and self._tokenizer_json is None:
            self._tokenizer_json = self._serialize_tokenizer()
        future = self._pool.submit(self._compile, params)
        self._cache[key] = future
        self._evict()
        return future

    @property
    def cached_bytes(self) -> int:
        """What the cached compilations weigh (those still compiling count nothing yet)."""
        with self._lock:
            return sum(self._weights.get(k, 0) for k in self._cache)

    def _evict(self) -> None:
        """Drop the oldest entries past `cache_size` or `cache_bytes`, never the newest
        (its requests, and those of any dropped entry, keep their own reference)."""
        while len(self._cache) > 1 and (
            len(self._cache) > self.cache_size or self.cached_bytes > self.cache_bytes
        ):
            self._cache.popitem(last=False)
        with self._lock:  # also what was weighed after its entry had gone
            for key in [k for k in self._weights if k not in self._cache]:
                del self._weights[key]

    @staticmethod
    def new_state(
        template: LLMatcher, after: tuple[int, ...] = (), optional_start: int | None = None
    ) -> GrammarState:
        """A fresh sequence's state: a copy of the template, which is never advanced
        (inactive until the output ends with `after`; with `optional_start`, only if the
        output opens with that token)."""
        return GrammarState(template.deep_copy(), after, optional_start)

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- the worker thread --------------------------------------------------------

    def _compile(self, params: StructuredOutputsParams) -> LLMatcher:
        tokenizer = self._tokenizer()
        start, resident = time.perf_counter(), _resident_bytes()
        try:
            matcher, error = self._build(tokenizer, params)
        finally:
            with self._lock:
                self.num_compiles += 1
                self.compile_seconds += time.perf_counter() - start
        if matcher is None:
            # Raised where no frame holds the refused matcher: the cached error keeps none.
            raise InvalidRequestError(describe(params, error or "rejected"))
        with self._lock:
            self._weights[params.key] = max(len(params.key[1]), 1, _resident_bytes() - resident)
        return matcher

    @staticmethod
    def _build(
        tokenizer: LLTokenizer, params: StructuredOutputsParams
    ) -> tuple[LLMatcher | None, str | None]:
        """(the template, None), or (None, why llguidance refused it)."""
        try:
            spec = grammar_spec(params)
        except ValueError as e:
            return None, str(e)
        # check_matcher computes the first mask: the lazy lexer's first states, here.
        matcher = LLMatcher(tokenizer, spec, log_level=0, limits=GRAMMAR_LIMITS)
        error = check_matcher(matcher)
        return (matcher, None) if error is None else (None, error)

    def _serialize_tokenizer(self) -> str:
        """The tokenizer as its JSON (tens of ms, once, on the step loop's thread: the
        Hugging Face tokenizer is the engine's, and is not read from two threads)."""
        backend = getattr(self._hf_tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ValueError("structured outputs need a fast (Rust) Hugging Face tokenizer")
        return backend.to_str()

    def _tokenizer(self) -> LLTokenizer:
        """llguidance's view of the vocabulary, built once on the worker (about a second
        for a 50k vocabulary), as `llguidance.hf.from_tokenizer` builds it."""
        if self._ll_tokenizer is None:
            assert self._tokenizer_json is not None
            self._ll_tokenizer = ll_tokenizer(self._tokenizer_json, self.vocab_size, self._eos)
            self._tokenizer_json = None
        return self._ll_tokenizer


def _resident_bytes() -> int:
    """This process's resident memory (0 where /proc is not there to read it)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
