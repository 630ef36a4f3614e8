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
each sequence starts from a deep copy of it (`new_state`). Templates are kept
in an LRU of `cache_size` entries by `StructuredOutputsParams.key`, in-flight
compilations included, so N requests with one schema compile it once: one
miss and N - 1 hits, however close together they come. A compilation that
fails is cached like one that succeeds (the same constraint fails the same
way against the same vocabulary), so a repeated bad request fails at once.

The counters are exact: `cache_misses` counts compilations started,
`cache_hits` requests served by a grammar compiled or compiling already,
`num_compiles` / `compile_seconds` compilations finished and the time they
took (matcher construction and its first mask; the one-off conversion of
the tokenizer before the first one is not counted). The Hugging Face
tokenizer is serialized once on the caller's thread, so the worker never
touches the object the engine tokenizes and detokenizes with.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

from llguidance import LLMatcher, LLTokenizer
from transformers import PreTrainedTokenizerBase

from .errors import InvalidRequestError
from .grammar_spec import describe, grammar_spec, validate
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
    ) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = (
            vocab_size  # the model's: its logits may have more rows than the tokenizer
        )
        self._eos = sorted(eos_token_ids)
        self._ll_tokenizer: LLTokenizer | None = None
        self._tokenizer_json: str | None = None  # its serialization, taken on the caller's thread
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple[str, str], Future[LLMatcher]] = OrderedDict()
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
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)  # its requests keep their own reference
        return future

    @staticmethod
    def new_state(template: LLMatcher, after: tuple[int, ...] = ()) -> GrammarState:
        """A fresh sequence's state: a copy of the template, which is never advanced
        (inactive until the output ends with `after`)."""
        return GrammarState(template.deep_copy(), after)

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- the worker thread --------------------------------------------------------

    def _compile(self, params: StructuredOutputsParams) -> LLMatcher:
        tokenizer = self._tokenizer()
        start = time.perf_counter()
        try:
            matcher = LLMatcher(tokenizer, grammar_spec(params), log_level=0)
            if not matcher.is_error():
                matcher.compute_bitmask()  # the lazy lexer's first states, off the step loop
        except ValueError as e:
            raise InvalidRequestError(describe(params, str(e))) from None
        finally:
            with self._lock:
                self.num_compiles += 1
                self.compile_seconds += time.perf_counter() - start
        if matcher.is_error():
            raise InvalidRequestError(describe(params, matcher.get_error()))
        return matcher

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
            spec = json.loads(self._tokenizer_json)
            spec["padding"] = spec["truncation"] = None  # what encoding the prompt may set
            self._ll_tokenizer = LLTokenizer(
                json.dumps(spec), n_vocab=self.vocab_size, eos_token=self._eos or None
            )
            self._tokenizer_json = None
        return self._ll_tokenizer
