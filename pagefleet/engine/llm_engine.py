"""The engine (add_request / step / abort) and the offline `LLM` API on top of it."""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from dataclasses import fields
from typing import Any

from tqdm.auto import tqdm

from .beam_search import BeamSearchOutput, BeamSearchParams, run_beam_search
from .checkpoint import generation_defaults
from .config import EngineConfig
from .errors import EngineBrokenError, EngineOverloadedError, StepFailedError
from .executor import ExecutorFactory
from .input_processor import InputProcessor, PromptType
from .loader import eos_token_ids, load_tokenizer
from .output_accumulator import OutputAccumulator
from .output_delta import RequestOutputDelta
from .output_processor import OutputProcessor
from .outputs import RequestOutput
from .sampling_params import SamplingParams
from .startup import StartupTimeline
from .stats import EngineStats
from .token_engine import TokenEngine

logger = logging.getLogger("pagefleet.engine")

__all__ = ["LLM", "EngineBrokenError", "LLMEngine", "PromptType", "StepFailedError"]


class LLMEngine:
    """One replica's engine: a queue of requests advanced one model step at a time.

    `add_request` validates and queues; `step` runs one iteration of the
    scheduler and the model and returns what changed; `abort_request` drops a
    request and frees its blocks at once. The work is done by three parts
    with one job each: the input processor (prompts and params in), the
    token engine (token ids, blocks, the model) and the output processor
    (text, stop strings, per-step deltas). `step_deltas` hands out the deltas
    as they are (what the engine core sends its caller); `step` builds vLLM's
    cumulative RequestOutputs from them (an `OutputAccumulator`).
    """

    def __init__(
        self,
        config: EngineConfig,
        executor_factory: ExecutorFactory | None = None,
        startup: StartupTimeline | None = None,
    ) -> None:
        """`startup`: the timeline its start-up phases are marked on (a new one if None)."""
        self.config = config
        self.startup = startup if startup is not None else StartupTimeline(time.time())
        self.tokenizer = load_tokenizer(config.tokenizer_path)
        self.startup.mark("tokenizer")
        self.token_engine = TokenEngine.from_config(
            config,
            eos_token_ids(config.checkpoint, self.tokenizer),
            executor_factory,
            tokenizer=self.tokenizer,
            startup=self.startup,
        )
        self.capacity = self.token_engine.capacity
        self.vocab_size = self.token_engine.vocab_size
        self.input_processor = InputProcessor(
            self.tokenizer,
            self.vocab_size,
            self.capacity.max_model_len,
            config.max_num_seqs,
            self.token_engine.grammars,
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self.accumulator = OutputAccumulator()

    # -- requests -------------------------------------------------------------

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """A prompt as (text or None, token ids), validated against this model."""
        return self.input_processor.tokenize(prompt)

    def validate_params(self, params: SamplingParams) -> None:
        """Checks that depend on this engine (vocabulary, capacity) and on types."""
        self.input_processor.validate_params(params)

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams) -> list[int]:
        """Queue a request and return its prompt's token ids; ValueError (nothing queued)
        for anything wrong with it, EngineOverloadedError when `max_waiting_requests`
        requests already wait."""
        request = self.input_processor.process(request_id, prompt, params)
        limit = self.config.max_waiting_requests
        if limit is not None and self.token_engine.num_waiting_requests >= limit:
            raise EngineOverloadedError(
                f"the engine queue is full ({limit} requests waiting); retry later"
            )
        if request_id in self.output_processor:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.token_engine.add(request)
        self.output_processor.add(request)
        self.accumulator.add(request_id, request.prompt, request.prompt_token_ids)
        return request.prompt_token_ids

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.token_engine.abort(ids)
        for rid in ids:
            self.output_processor.abort(rid)
            self.accumulator.discard(rid)

    def has_unfinished_requests(self) -> bool:
        return self.token_engine.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor)

    def unfinished_request_ids(self) -> list[str]:
        return self.output_processor.request_ids()

    # -- stepping -------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One scheduler decision and one model step; the requests that changed, each as
        a whole (vLLM's RequestOutput; `new_token_ids`/`new_text`: what this step added).
        See `step_deltas` for what happens when a step fails."""
        return [self.accumulator.apply(d) for d in self.step_deltas(keep_outputs=True)]

    def step_deltas(self, keep_outputs: bool = False) -> list[RequestOutputDelta]:
        """One scheduler decision and one model step; each changed request's news only.

        keep_outputs: `step` builds whole outputs from these deltas (else the
        accumulator forgets each request as it finishes).

        A step that raises anywhere (scheduling, copy-on-write copies, the
        model, sampling, or the output side: detokenizing, stop strings)
        raises `StepFailedError` naming the requests scheduled in it, which
        are then aborted on both sides: their blocks are free and no output of
        theirs comes later. Requests not in the step are untouched and the
        next step serves them (see `TokenEngine.step` for why each failure
        point leaves nothing else behind). The exception is `EngineBrokenError`
        (tensor-parallel ranks out of step): the step's requests are aborted
        likewise, but the engine cannot step again.
        """
        try:
            step_output = self.token_engine.step()
        except StepFailedError as e:
            self._abort_outputs(e.request_ids)
            raise
        except EngineBrokenError:
            # The token side aborted the step's requests; drop whatever it no longer holds.
            self._abort_outputs(
                [r for r in self.output_processor.request_ids() if r not in self.token_engine]
            )
            raise
        if step_output is None:
            return []
        try:
            processed = self.output_processor.process(step_output)
            for hit in processed.stop_string_hits:
                self.token_engine.finish_sequence(hit.request_id, hit.index, "stop", hit.stop)
        except Exception as e:
            # The token side has advanced these requests but their outputs are
            # half-made: end them on both sides rather than emit a gap.
            self.abort_request(step_output.scheduled)
            raise StepFailedError(step_output.scheduled, e) from e
        if not keep_outputs:
            for d in processed.deltas:
                if d.finished:
                    self.accumulator.discard(d.request_id)
        return processed.deltas

    def _abort_outputs(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.output_processor.abort(rid)
            self.accumulator.discard(rid)

    # -- introspection ----------------------------------------------------------

    def stats(self, with_prefix: bool = True) -> EngineStats:
        """A snapshot; with_prefix=False leaves out the cached hashes and digest (per-step use)."""
        return self.token_engine.stats(with_prefix)

    def close(self) -> None:
        """Stop tensor-parallel ranks and leave the process group (idempotent)."""
        token_engine = getattr(self, "token_engine", None)  # absent if it failed to start
        if token_engine is not None:
            token_engine.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def check_block_accounting(self) -> None:
        """Raise AssertionError unless the pool balances (and is empty when idle)."""
        self.token_engine.check_block_accounting()


_CONFIG_FIELDS = {f.name for f in fields(EngineConfig)}


def _prompt_list(prompts: PromptType | Seq[PromptType]) -> list[PromptType]:
    """One prompt (text, token ids or dict) or a sequence of them, as a list of prompts."""
    if isinstance(prompts, str | dict) or (
        prompts and isinstance(prompts, list) and isinstance(prompts[0], int)
    ):
        return [prompts]
    return list(prompts)


class LLM:
    """Offline batch generation, vLLM's `LLM` shape.

    >>> llm = LLM(model="models/tiny", num_kv_blocks=48, max_num_seqs=12)
    >>> outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8))
    """

    def __init__(self, model: str, **kwargs: Any) -> None:
        unknown = set(kwargs) - _CONFIG_FIELDS
        if unknown:
            raise TypeError(f"unknown LLM arguments: {', '.join(sorted(unknown))}")
        config = EngineConfig(model=model, **kwargs)
        self.engine = LLMEngine(config)
        self._counter = itertools.count()
        self._defaults = generation_defaults(config.checkpoint, config.generation_config)

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` samples with when given no params: the checkpoint's
        generation_config.json defaults (`EngineConfig.generation_config`), else
        SamplingParams' own."""
        return SamplingParams(**self._defaults)

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Seq[PromptType],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order."""
        prompts = _prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = (
            [sampling_params] * len(prompts)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        # Validate (and tokenize, once) everything before queueing anything.
        tokenized = [self.engine.tokenize(p) for p in prompts]
        for sp in params:
            self.engine.validate_params(sp)
        ids = [f"offline-{next(self._counter)}" for _ in prompts]
        for rid, (text, token_ids), sp in zip(ids, tokenized, params, strict=True):
            self.engine.add_request(rid, {"prompt": text, "prompt_token_ids": token_ids}, sp)
        return self._run(ids, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(
            total=len(ids), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm
        )
        start = time.perf_counter()
        in_toks = out_toks = 0
        try:
            while self.engine.has_unfinished_requests():
                for d in self.engine.step_deltas(keep_outputs=True):
                    o = self.engine.accumulator.apply_final(d)
                    if o is not None:
                        done[o.request_id] = o
                        in_toks += len(o.prompt_token_ids)
                        out_toks += len(o.outputs[0].token_ids)
                        elapsed = time.perf_counter() - start
                        bar.set_postfix_str(
                            f"est. speed input: {in_toks / elapsed:.2f} toks/s, "
                            f"output: {out_toks / elapsed:.2f} toks/s",
                            refresh=False,
                        )
                        bar.update(1)
        except BaseException:
            self.engine.abort_request([i for i in ids if i not in done])
            raise
        finally:
            bar.close()
        return [done[i] for i in ids]

    def beam_search(
        self, prompts: PromptType | Seq[PromptType], params: BeamSearchParams
    ) -> list[BeamSearchOutput]:
        """Beam search (vLLM's shape); outputs in input order, best beam first."""
        ids = [self.engine.tokenize(p)[1] for p in _prompt_list(prompts)]
        return run_beam_search(self.engine.token_engine, self.engine.tokenizer, ids, params)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def check_block_accounting(self) -> None:
        self.engine.check_block_accounting()

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
