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

import torch
from tqdm.auto import tqdm

from .beam_search import BeamSearchOutput, BeamSearchParams, run_beam_search
from .block_manager import BlockManager
from .config import EngineConfig
from .detokenizer import IncrementalDetokenizer
from .distributed import destroy_tp, free_port, init_tp
from .loader import eos_token_ids, load_tokenizer
from .model_runner import ModelRunner
from .models import resolve_model
from .models.llama import LlamaArgs
from .outputs import CompletionOutput, RequestOutput
from .prefix_hash import prefix_hash_salt
from .sampling import SamplingParams
from .scheduler import Scheduler
from .sequence import Sequence
from .stats import EngineStats
from .workers import WorkerGroup, threads_per_rank

logger = logging.getLogger("pagefleet.engine")

PromptType = str | list[int] | dict[str, Any]


def check_tp_shapes(args: LlamaArgs, tp: int) -> None:
    """Refuse, with the reason, a model whose heads cannot be split over `tp` ranks."""
    if args.num_heads % tp:
        raise ValueError(
            f"num_attention_heads ({args.num_heads}) is not divisible by tensor_parallel_size ({tp})"
        )
    kv = args.num_kv_heads
    if kv % tp and tp % kv:
        # e.g. 3 KV heads over 2 ranks: a rank's query heads would use KV heads
        # unevenly (1.5 each), which no uniform grouped-query layout expresses.
        raise ValueError(
            f"num_key_value_heads ({kv}) and tensor_parallel_size ({tp}) must divide one another: "
            "KV heads are split evenly over ranks, or replicated when there are fewer than ranks"
        )


class LLMEngine:
    """One replica's engine: a queue of requests advanced one model step at a time.

    `add_request` validates and queues; `step` runs one iteration of the
    scheduler and the model and returns what changed; `abort_request` drops a
    request and frees its blocks at once.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        spec = resolve_model(config.hf_config())
        self.tokenizer = load_tokenizer(config.tokenizer_path)
        self.eos_ids = eos_token_ids(config.model, self.tokenizer)
        self._workers: WorkerGroup | None = None
        if config.tensor_parallel_size > 1:
            check_tp_shapes(spec.args, config.tensor_parallel_size)
            # Workers first: they wait in the rendezvous until rank 0 (this process) joins.
            init_method = f"tcp://127.0.0.1:{free_port()}"
            self._workers = WorkerGroup(config, init_method)
            torch.set_num_threads(threads_per_rank(config))
        try:
            if self._workers is not None:
                init_tp(0, config.tensor_parallel_size, init_method, config.device)
            self.runner = ModelRunner(config, spec.args)
        except BaseException:
            self.close()  # no worker outlives a failed start
            raise
        self.runner.workers = self._workers
        self.capacity = self.runner.capacity
        self.vocab_size = spec.args.vocab_size
        self.block_manager = BlockManager(
            self.capacity.num_kv_blocks,
            self.capacity.block_size,
            config.enable_prefix_caching,
            # Salted with the model as configured: every replica of it, and the
            # router hashing prompts for it, agree; another model never matches.
            hash_salt=prefix_hash_salt(config.model, self.capacity.block_size),
        )
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=self.capacity.max_num_batched_tokens,
            enable_chunked_prefill=config.enable_chunked_prefill,
        )
        # A request's sequences (one, or its n samples once forked), by request id.
        self._groups: dict[str, list[Sequence]] = {}
        self._detokenizers: dict[tuple[str, int], IncrementalDetokenizer] = {}
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0

    # -- requests -------------------------------------------------------------

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """A prompt as (text or None, token ids), validated against this model."""
        if isinstance(prompt, str):
            text: str | None = prompt
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
        elif isinstance(prompt, dict) and "prompt" in prompt:
            text = prompt["prompt"]
            ids = self.tokenizer.encode(text, add_special_tokens=True)
        elif isinstance(prompt, list):
            text, ids = None, list(prompt)
        else:
            raise ValueError(
                "a prompt is a str, a list of token ids or {'prompt_token_ids': [...]}"
            )
        if not ids:
            raise ValueError("the prompt is empty")
        if any(not isinstance(t, int) or not 0 <= t < self.vocab_size for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size})")
        if len(ids) >= self.capacity.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens; this model takes at most "
                f"{self.capacity.max_model_len - 1} so that one can be generated (max_model_len)"
            )
        return text, ids

    def validate_params(self, params: SamplingParams) -> None:
        """Checks that depend on this engine (vocabulary, capacity)."""
        if any(t >= self.vocab_size for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be < vocab size {self.vocab_size}")
        if params.num_samples > self.config.max_num_seqs:
            raise ValueError(
                f"n / best_of ({params.num_samples}) exceeds max_num_seqs ({self.config.max_num_seqs})"
            )

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams) -> None:
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self.tokenize(prompt)
        self.validate_params(params)
        seq = Sequence(request_id=request_id, prompt_token_ids=ids, params=params, prompt=text)
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs = [None]
        group = [seq]
        if params.num_samples > 1:
            if len(ids) > 1:
                seq.num_forks_pending = params.num_samples - 1  # forks once its prompt is in
            else:  # nothing to share: start the samples apart
                group += [seq.fork(i) for i in range(1, params.num_samples)]
        self._groups[request_id] = group
        for member in group:
            self._track(member)
            self.scheduler.add(member)

    def _track(self, seq: Sequence) -> None:
        self._detokenizers[(seq.request_id, seq.index)] = IncrementalDetokenizer(
            self.tokenizer, seq.prompt_token_ids, seq.params.skip_special_tokens
        )

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            for seq in self._groups.pop(rid, []):
                self._detokenizers.pop((rid, seq.index), None)
                self.scheduler.finish(seq, "abort")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def get_num_unfinished_requests(self) -> int:
        return len(self._groups)

    def unfinished_request_ids(self) -> list[str]:
        return list(self._groups)

    # -- stepping -------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One scheduler decision and one model step; returns the requests that changed."""
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        result = self.runner.execute(out, self.eos_ids)
        for seq, new_prompt_lps in zip(out.seqs, result.prompt_logprobs, strict=True):
            if new_prompt_lps:
                seq.prompt_logprobs.extend(new_prompt_lps)  # type: ignore[union-attr]
        for child in self.scheduler.update(out, result.sampled):
            self._groups[child.request_id].append(child)
            self._track(child)
        self._prompt_tokens_total += sum(
            n
            for n, token in zip(out.num_scheduled_tokens, result.sampled, strict=True)
            if token is None or n > 1
        )
        now = time.monotonic()
        changed: dict[str, list[tuple[Sequence, int, str]]] = {}
        for i, seq in enumerate(out.seqs):
            token = result.sampled[i]
            if token is None:
                continue
            self._generation_tokens_total += 1
            if seq.first_token_time is None:
                seq.first_token_time = now
            if result.chosen_logprobs[i] is not None:
                seq.cumulative_logprob += result.chosen_logprobs[i]  # type: ignore[operator]
            if seq.logprobs is not None:
                seq.logprobs.append(result.logprobs[i] or {})
            changed.setdefault(seq.request_id, []).append(
                (seq, token, self._process_token(seq, token))
            )
        return [self._output(rid, deltas) for rid, deltas in changed.items()]

    def _process_token(self, seq: Sequence, token: int) -> str:
        """Detokenize the new token, finish the sequence if a stop condition holds.

        Returns the text that may be streamed now: a stop string is cut off,
        and while stop strings are in play the last (longest stop - 1)
        characters are held back, since they may yet begin one.
        """
        p = seq.params
        detok = self._detokenizers[(seq.request_id, seq.index)]
        new_text = detok.push(token)
        reason, stop_reason = self._token_stop(seq, token)
        if reason is not None:
            new_text += detok.flush()
        seq.output_text += new_text
        if p.stop and seq.num_output_tokens >= p.min_tokens:
            hit = _find_stop(seq.output_text, p.stop, len(new_text))
            if hit is not None:
                idx, stop_str = hit
                keep = idx + len(stop_str) if p.include_stop_str_in_output else idx
                seq.output_text = seq.output_text[:keep]
                reason, stop_reason = "stop", stop_str
        if reason is not None:
            self.scheduler.finish(seq, reason, stop_reason)
        visible = len(seq.output_text)
        if p.stop and not seq.is_finished:
            visible = max(seq.streamed_text_len, visible - max(len(s) for s in p.stop) + 1)
        delta = seq.output_text[seq.streamed_text_len : visible]
        seq.streamed_text_len = visible
        return delta

    def _token_stop(self, seq: Sequence, token: int) -> tuple[str | None, int | None]:
        """Stop conditions decided by the token ids alone (EOS, stop ids, length)."""
        p = seq.params
        if seq.num_output_tokens >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_ids:
                return "stop", None
            if token in p.stop_token_ids:
                return "stop", token
        if p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens:
            return "length", None
        if seq.num_tokens >= self.capacity.max_model_len:
            return "length", None
        return None, None

    def _output(self, request_id: str, deltas: list[tuple[Sequence, int, str]]) -> RequestOutput:
        group = self._groups[request_id]
        finished = all(s.is_finished for s in group)
        new = {s.index: (token, text) for s, token, text in deltas}
        members = sorted(group, key=lambda s: s.index)
        params = members[0].params
        if finished:
            self._groups.pop(request_id)
            for s in group:
                self._detokenizers.pop((request_id, s.index), None)
            if params.num_samples > params.n:  # best_of: keep the n most likely
                members = sorted(members, key=lambda s: -s.cumulative_logprob)[: params.n]
        outputs = []
        for pos, s in enumerate(members):
            token, text = new.get(s.index, (None, ""))
            outputs.append(
                CompletionOutput(
                    index=pos if finished else s.index,
                    text=s.output_text,
                    token_ids=s.output_token_ids,
                    finish_reason=s.finish_reason,
                    stop_reason=s.stop_reason,
                    cumulative_logprob=s.cumulative_logprob if params.needs_logprobs else None,
                    logprobs=s.logprobs,
                    new_token_ids=[] if token is None else [token],
                    new_text=text,
                )
            )
        head = members[0]
        metrics = {"arrival_time": head.arrival_time}
        first = [s.first_token_time for s in group if s.first_token_time is not None]
        if first:
            metrics["first_token_time"] = min(first)
        return RequestOutput(
            request_id=request_id,
            prompt=head.prompt,
            prompt_token_ids=head.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            prompt_logprobs=head.prompt_logprobs,
            metrics=metrics,
        )

    # -- introspection ----------------------------------------------------------

    def stats(self, with_prefix: bool = True) -> EngineStats:
        """A snapshot; with_prefix=False leaves out the cached hashes and digest (per-step use)."""
        bm = self.block_manager
        return EngineStats(
            num_total_blocks=bm.num_total_blocks,
            num_free_blocks=bm.num_free_blocks,
            block_size=bm.block_size,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens_total=self._prompt_tokens_total,
            generation_tokens_total=self._generation_tokens_total,
            prefix_cache_queries=bm.prefix_cache_queries,
            prefix_cache_hits=bm.prefix_cache_hits,
            num_cached_blocks=bm.num_cached_blocks,
            cached_block_hashes=bm.cached_block_hashes() if with_prefix else frozenset(),
            prefix_digest=bm.prefix_digest() if with_prefix else b"",
            prefix_hash_salt=bm.hash_salt,
        )

    def close(self) -> None:
        """Stop tensor-parallel workers and leave the process group (idempotent)."""
        if self._workers is not None:
            self._workers.close()
            self._workers = None
            destroy_tp()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def check_block_accounting(self) -> None:
        """Raise AssertionError unless the pool balances (and is empty when idle)."""
        self.block_manager.check_accounting()
        if not self.has_unfinished_requests() and self.block_manager.num_used_blocks:
            raise AssertionError(
                f"{self.block_manager.num_used_blocks} blocks leaked with no request left"
            )


def _find_stop(text: str, stops: Seq[str], new_len: int) -> tuple[int, str] | None:
    """Earliest stop string that the newest `new_len` characters completed."""
    best: tuple[int, str] | None = None
    for s in stops:
        start = max(0, len(text) - new_len - len(s) + 1)
        idx = text.find(s, start)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, s)
    return best


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
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self._counter = itertools.count()

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
            sampling_params = SamplingParams()
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
                for o in self.engine.step():
                    if o.finished:
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
        return run_beam_search(self.engine, ids, params)

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
