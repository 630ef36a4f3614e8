"""Verdicts on constraints, reached on a bounded pool of threads and cached by constraint.

An ingress checks every constraint before it sends a request: llguidance
builds it against the model's vocabulary under `grammar_spec.GRAMMAR_LIMITS`
and moves it one token (`grammar_spec.validate` with a tokenizer). That runs
here, on `workers` threads of the validator's own (llguidance releases the GIL
while it works), never on the event loop nor on the thread that tokenizes
prompts. The caller waits for a verdict with a time-out of its own and, past
it, `forget`s the constraint: one not started yet is cancelled, one running
runs on to its verdict (llguidance's limits bound it) and is cached.

Verdicts (None: accepted, else the message to fail the request with) are kept
in an LRU of `cache_size` entries by `StructuredOutputsParams.key`, checks in
flight included, so N requests with one constraint check it once. Until the
vocabulary is given (`set_vocabulary`) a check is llguidance's syntax check
alone. Torch-free.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

from llguidance import LLTokenizer

from .grammar_spec import ll_tokenizer, validate
from .sampling_params import StructuredOutputsParams

Key = tuple[str, str]


class ConstraintValidator:
    """Constraint verdicts by key (an LRU), reached on a bounded thread pool."""

    def __init__(self, workers: int = 2, cache_size: int = 1024) -> None:
        self.cache_size = cache_size
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="pagefleet-constraints")
        self._verdicts: OrderedDict[Key, Future[str | None]] = OrderedDict()
        self._vocabulary: Future[LLTokenizer] | None = None
        self._lock = threading.Lock()

    @property
    def has_vocabulary(self) -> bool:
        return self._vocabulary is not None

    def set_vocabulary(self, tokenizer_json: str, vocab_size: int, eos: list[int]) -> None:
        """Check against this vocabulary from now on (built on the pool, once)."""
        with self._lock:
            if self._vocabulary is None:
                self._vocabulary = self._pool.submit(ll_tokenizer, tokenizer_json, vocab_size, eos)
                self._verdicts.clear()  # syntax-only verdicts: checked again

    def submit(self, params: StructuredOutputsParams) -> Future[str | None]:
        """The verdict on `params`, reached or to come."""
        key = params.key
        with self._lock:
            future = self._verdicts.get(key)
            if future is None or future.cancelled():
                future = self._pool.submit(self._check, params)
                self._verdicts[key] = future
            self._verdicts.move_to_end(key)
            while len(self._verdicts) > self.cache_size:
                self._verdicts.popitem(last=False)
        return future

    def forget(self, params: StructuredOutputsParams) -> None:
        """Give up waiting for `params`: cancelled if it has not started."""
        with self._lock:
            future = self._verdicts.get(params.key)
            if future is not None and future.cancel():
                del self._verdicts[params.key]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _check(self, params: StructuredOutputsParams) -> str | None:
        vocabulary = self._vocabulary.result() if self._vocabulary is not None else None
        return validate(params, vocabulary)
