"""The token engine: requests as token ids in, one model step at a time, token ids out.

It owns the scheduler, the block manager, the model runner and the executor
of the other tensor-parallel ranks, and decides every stop that token ids
alone decide (EOS, stop tokens, max_tokens, max_model_len). It knows nothing
of text: tokenizing, stop strings and RequestOutputs are the input and output
processors' (this is what vLLM v1 calls its EngineCore). Beam search drives it through the
same public methods (`add`, `step`, `fork`, `replace_last_token`,
`finish_sequence`).

Structured outputs: a constrained request's grammar is compiled on the
`GrammarCompiler`'s worker thread; until it is ready the request's sequences
wait here, outside the scheduler (never admitted, holding no block), while
every other request steps. Each step first hands the ready ones to the
scheduler, each sequence with its own matcher. After a step each sampled
token is consumed by its sequence's matcher, and a sequence whose grammar is
complete (it can take no more tokens) finishes with "stop" at once: the EOS
that vLLM samples after a complete grammar (its mask then allows only EOS)
is not sampled here. The token-id stops are checked first, as vLLM does:
max_tokens ("length") wins over a grammar completed by the same token, and
EOS, where the grammar allows it, stops as usual. ignore_eos and min_tokens
do not hold a complete grammar open (it can take nothing but EOS); before it
is complete, min_tokens bans EOS and the stop tokens as for any request (the
grammar mask comes first). A matcher that refuses a token (possible only when
that ban left the grammar nothing it allows) ends its sequence with "abort".

Continuations (`SamplingParams.output_offset` = k: the prompt's last k
tokens are output an earlier run of the same request produced): every
output count (max_tokens, min_tokens) covers those k tokens too, each
sequence's grammar is advanced over them when it is admitted, and seeded
noise is indexed by the whole output's position (`Sequence.sample_seed`).

Embedding requests (`SamplingParams.embed`) are scheduled like any prompt
(chunked, preempted, never reading a prefix-cache hit) but sample nothing:
the step that computes a prompt's last token gets its pooled vector from the
runner, finishes it with "stop" (its blocks back in the pool) and hands the
vector on in its `RequestUpdate`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import TYPE_CHECKING, NoReturn, Protocol

import torch

from .block_manager import BlockManager
from .config import EngineConfig, ResolvedCapacity
from .distributed import destroy_tp, init_tp, wait_ranks_ready
from .errors import EngineBrokenError, RanksOutOfStepError, StepFailedError
from .executor import Executor, ExecutorFactory
from .grammar_compiler import GrammarCompiler
from .handoffs import EngineRequest, RequestUpdate, SampleUpdate, TokenStepOutput
from .model_runner import ModelRunner, ModelRunnerOutput
from .models import resolve_model
from .models.llama import LlamaArgs
from .prefix_hash import prefix_hash_salt
from .scheduler import Scheduler, SchedulerOutput, SchedulingError
from .sequence import Sequence
from .startup import StartupTimeline
from .stats import ITERATION_TOKEN_BUCKETS, EngineStats, iteration_bucket
from .workers import LocalProcessExecutor, threads_per_rank

if TYPE_CHECKING:
    from llguidance import LLMatcher
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger("pagefleet.engine")

# How long a step with nothing to schedule waits for a grammar being compiled before
# returning (the caller's loop then looks at its inbox and calls again).
_GRAMMAR_WAIT_S = 0.01
_REFUSED_CONTINUATION = (
    "the continuation's earlier output tokens (output_offset) do not match its constraint"
)


class StepExecutor(Protocol):
    """What computes a scheduled step's tokens (`ModelRunner.execute`)."""

    def execute(
        self, out: SchedulerOutput, eos_ids: frozenset[int], send: Callable[..., object] | None
    ) -> ModelRunnerOutput: ...


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


class TokenEngine:
    """Every unfinished request's sequences, advanced one scheduled model step at a time.

    Invariant: a request id is in `_groups` exactly while some sequence of
    it is unfinished, and every finished sequence's blocks are free.
    """

    def __init__(
        self,
        runner: StepExecutor,
        scheduler: Scheduler,
        capacity: ResolvedCapacity,
        eos_token_ids: frozenset[int],
        vocab_size: int,
        *,
        executor: Executor | None = None,
        grammars: GrammarCompiler | None = None,
        clock: Callable[[], float] = time.monotonic,
        compile_seconds: float | None = None,
    ) -> None:
        """An engine over parts already built (`from_config` builds them for a model).

        `runner` computes each step's tokens (`ModelRunner`, or a simulator's);
        `clock` times the steps (`busy_budget_seconds`); `executor` drives the other
        tensor-parallel ranks, `grammars` compiles structured outputs' grammars."""
        self.runner = runner
        self.scheduler = scheduler
        self.block_manager = scheduler.block_manager
        self.capacity = capacity
        self.eos_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.executor = executor
        self.grammars = grammars
        self.clock = clock
        # Start-up's compilation of the forward, in seconds (None: the model runs eagerly).
        self.compile_seconds = compile_seconds
        # A request's sequences (one, or its n samples once forked), by request id.
        self._groups: dict[str, list[Sequence]] = {}
        self._never_scheduled: set[str] = set()
        # Constrained requests whose grammar is still compiling, by request id (their
        # sequences are in `_groups` but not yet in the scheduler).
        self._awaiting_grammar: dict[str, Future[LLMatcher]] = {}
        # Why the engine can no longer step (its tensor-parallel ranks are out of step).
        self._broken: str | None = None
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        self._busy_budget_seconds = 0.0
        self._iteration_counts = [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)
        self._iteration_tokens = 0

    @classmethod
    def from_config(
        cls,
        config: EngineConfig,
        eos_token_ids: frozenset[int],
        executor_factory: ExecutorFactory | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        startup: StartupTimeline | None = None,
    ) -> TokenEngine:
        """The engine of `config`'s model: its runner (and other ranks), pool and scheduler.

        `tokenizer`: the model's, for structured outputs (without one a
        constrained request is refused); `startup`: where the runner marks its phases."""
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        args = resolve_model(config.hf_config()).args
        executor = cls._start_ranks(config, args, executor_factory)
        try:
            runner = cls._load_runner(config, args, executor, startup)
        except BaseException:
            if executor is not None:
                executor.close()  # no rank outlives a failed start
            raise
        capacity = runner.capacity
        block_manager = BlockManager(
            capacity.num_kv_blocks,
            capacity.block_size,
            config.enable_prefix_caching,
            # Salted with the model as configured: every replica of it, and the
            # router hashing prompts for it, agree; another model never matches.
            hash_salt=prefix_hash_salt(config.model, capacity.block_size),
            protected_fraction=config.prefix_cache_protected_fraction,
            sliding_window=args.sliding_window,
        )
        scheduler = Scheduler(
            block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=capacity.max_num_batched_tokens,
            enable_chunked_prefill=config.enable_chunked_prefill,
            scheduling_policy=config.scheduling_policy,
        )
        grammars = (
            GrammarCompiler(tokenizer, args.vocab_size, eos_token_ids)
            if tokenizer is not None
            else None
        )
        compiled = runner.compile_seconds if runner.compiled is not None else None
        return cls(
            runner,
            scheduler,
            capacity,
            eos_token_ids,
            args.vocab_size,
            executor=executor,
            grammars=grammars,
            compile_seconds=compiled,
        )

    @staticmethod
    def _start_ranks(
        config: EngineConfig, args: LlamaArgs, executor_factory: ExecutorFactory | None
    ) -> Executor | None:
        """The other tensor-parallel ranks' executor (None with one rank)."""
        tp = config.tensor_parallel_size
        if tp == 1:
            return None
        check_tp_shapes(args, tp)
        # The other ranks first: they wait in the rendezvous until rank 0 (this process) joins.
        executor = (executor_factory or LocalProcessExecutor)(config)
        torch.set_num_threads(threads_per_rank(config))
        return executor

    @staticmethod
    def _load_runner(
        config: EngineConfig,
        args: LlamaArgs,
        executor: Executor | None,
        startup: StartupTimeline | None = None,
    ) -> ModelRunner:
        """Rank 0's model runner, joined with the other ranks when there are any."""
        if executor is None:
            return ModelRunner(config, args, startup)
        failed = executor.failure
        tp = config.tensor_parallel_size
        init_tp(0, tp, executor.rendezvous, config.device, config.device_visibility, failed)
        runner = ModelRunner(config, args, startup)
        wait_ranks_ready(failed)  # every shard loaded before the first step
        return runner

    # -- requests -------------------------------------------------------------

    def add(self, request: EngineRequest) -> None:
        rid, ids, params = request.request_id, request.prompt_token_ids, request.params
        if rid in self._groups:
            raise ValueError(f"request id {rid!r} is already in use")
        seq = Sequence(
            request_id=rid,
            prompt_token_ids=ids,
            params=params,
            prompt=request.prompt,
            arrival_time=request.arrival_time,
            cache_salt=request.cache_salt,
        )
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs = [None]
        group = [seq]
        if params.num_samples > 1:
            if len(ids) > 1:
                seq.num_forks_pending = params.num_samples - 1  # forks once its prompt is in
            else:  # nothing to share: start the samples apart
                group += [seq.fork(i) for i in range(1, params.num_samples)]
        constraint = params.structured_outputs
        if constraint is not None:
            if self.grammars is None:
                raise ValueError("this engine has no tokenizer: it cannot serve structured outputs")
            future = self.grammars.submit(constraint)
        self._groups[rid] = group
        self._never_scheduled.add(rid)
        if constraint is not None:
            self._awaiting_grammar[rid] = future
            return
        for member in group:
            self.scheduler.add(member)

    def abort(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._never_scheduled.discard(rid)
            self._awaiting_grammar.pop(rid, None)  # its sequences are in no queue, hold no block
            for seq in self._groups.pop(rid, []):
                self.scheduler.finish(seq, "abort")

    def __contains__(self, request_id: str) -> bool:
        """Whether `request_id` is unfinished here."""
        return request_id in self._groups

    def sequences(self, request_id: str) -> list[Sequence]:
        """The request's live sequences (read-only: for inspection and tests)."""
        return list(self._groups.get(request_id, []))

    def finish_sequence(
        self, request_id: str, index: int, reason: str, stop_reason: str | int | None = None
    ) -> None:
        """End one sample now (a stop string, a pruned beam) and free its blocks."""
        group = self._groups.get(request_id, [])
        for seq in group:
            if seq.index == index:
                self.scheduler.finish(seq, reason, stop_reason)
        self._drop_if_done(request_id)

    def fork(self, request_id: str, index: int, new_index: int) -> None:
        """A running copy of sample `index` as `new_index`, sharing all its blocks."""
        parent = self._sequence(request_id, index)
        if any(s.index == new_index for s in self._groups[request_id]):
            raise ValueError(f"request {request_id!r} already has a sample {new_index}")
        self._groups[request_id].append(self.scheduler.fork_running(parent, new_index))

    def replace_last_token(self, request_id: str, index: int, token: int) -> None:
        """Swap a sample's newest (not yet computed) token, as beam search chooses."""
        seq = self._sequence(request_id, index)
        if seq.grammar is not None:  # its matcher has consumed the token being replaced
            raise ValueError("beam search does not support structured outputs")
        self.block_manager.replace_last_token(seq, token)

    def _sequence(self, request_id: str, index: int) -> Sequence:
        for seq in self._groups.get(request_id, []):
            if seq.index == index and not seq.is_finished:
                return seq
        raise ValueError(f"request {request_id!r} has no live sample {index}")

    def _drop_if_done(self, request_id: str) -> None:
        group = self._groups.get(request_id)
        if group is not None and all(s.is_finished for s in group):
            del self._groups[request_id]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0 or bool(self._awaiting_grammar)

    def get_num_unfinished_requests(self) -> int:
        return len(self._groups)

    @property
    def num_waiting_requests(self) -> int:
        """Requests not scheduled even once (preempted ones were admitted: not counted)."""
        return len(self._never_scheduled)

    # -- stepping -------------------------------------------------------------

    def step(self) -> TokenStepOutput | None:
        """One scheduler decision and one model step; None when nothing was scheduled.

        A step that raises fails only its own requests: those scheduled in it
        (when scheduling itself raised, those it had taken plus the one it was
        deciding on). They are aborted, every sample of each, so their blocks
        return to the pool, and `StepFailedError` names them; every other
        request is untouched (a waiting one still waits, a running one keeps
        its progress) and the next step serves them. This holds wherever the
        step raises, because until the scheduler's update the only state the
        step has changed is its own requests' blocks and queue places, and
        from the update on only its own requests' progress:

        - in scheduling: the touched sequences may hold new blocks or sit
          between the queues; ending them frees the blocks wherever they are.
          A sequence preempted earlier in the same decision is back at the
          front of the queue, exactly as after a step that succeeds.
        - in the copy-on-write copies: a sequence whose shared last block was
          about to be written already points at its fresh block, whose copy
          never happened. It is aborted with its request, and the fresh block
          is freed with no prefix hash (only full, computed blocks get one,
          after a step succeeds), so nothing ever reads its contents: it is
          only handed out again as space to be written.
        - in the forward pass or sampling: the K/V written went only into the
          step's own new slots, never into a cached block; they are freed
          unregistered, like the copies above.
        - in the update or the stop checks: some of the step's sequences have
          progressed or forked; the whole request ends, children included.

        On a tensor-parallel engine the other ranks stay in step with rank 0
        for every failure but one (see `ModelRunner.execute`): rank 0 failing
        after they started the step's collectives. That raises
        `RanksOutOfStepError` (an `EngineBrokenError`): the step's requests
        are aborted as above, and every later step raises at once, so the
        engine can only be closed (which stops the ranks without talking to
        them) and rebuilt.
        """
        if self._broken is not None:
            raise EngineBrokenError(f"the engine can no longer step: {self._broken}")
        out = self._schedule()
        if out.is_empty and self._awaiting_grammar:
            # Nothing to run but grammars being compiled: wait a little for one.
            wait(list(self._awaiting_grammar.values()), _GRAMMAR_WAIT_S, FIRST_COMPLETED)
            out = self._schedule()
        if out.is_empty:
            return None
        try:
            return self._run_step(out)
        except RanksOutOfStepError as e:
            self._broken = str(e)
            if self.executor is not None:
                self.executor.out_of_step = True
            e.request_ids = self._abort_step([s.request_id for s in out.seqs])
            raise
        except Exception as e:
            self._fail_step([s.request_id for s in out.seqs], e)

    def _schedule(self) -> SchedulerOutput:
        """Admit the requests whose grammar is ready, then one scheduler decision."""
        if self._awaiting_grammar:
            self._admit_compiled()
        try:
            return self.scheduler.schedule()
        except SchedulingError as e:
            self._fail_step([s.request_id for s in e.seqs], e.__cause__ or e)

    def _admit_compiled(self) -> None:
        """Queue every request whose grammar is compiled, each sequence with its own matcher.

        A grammar that failed to compile (llguidance refused it against this
        vocabulary, though it passed validation without one) fails its request
        alone: `StepFailedError` naming it, its cause the InvalidRequestError.
        """
        assert self.grammars is not None
        for rid, future in list(self._awaiting_grammar.items()):
            if not future.done():
                continue
            del self._awaiting_grammar[rid]
            error = future.exception()
            if error is not None:
                self._fail_step([rid], error)
            template = future.result()
            constraint = self._groups[rid][0].params.structured_outputs
            after = (constraint.after_token_ids if constraint else None) or ()
            start = constraint.optional_start_token_id if constraint else None
            for seq in self._groups[rid]:
                seq.grammar = self.grammars.new_state(template, after, start)
                if not seq.grammar.advance(seq.generated_token_ids):
                    self._fail_step([rid], ValueError(_REFUSED_CONTINUATION))
                self.scheduler.add(seq)

    def _fail_step(self, request_ids: list[str], cause: BaseException) -> NoReturn:
        """Abort a failed step's requests and raise StepFailedError naming them."""
        raise StepFailedError(self._abort_step(request_ids), cause) from cause

    def _abort_step(self, request_ids: list[str]) -> list[str]:
        """Abort a failed step's requests (each once, in order); returns their ids.

        Besides what `abort` ends, a step can leave sequences the scheduler
        holds but `_groups` does not: samples forked by an update that raised
        before the token engine recorded them. They are swept up here.
        """
        ids = list(dict.fromkeys(request_ids))
        self.abort(ids)
        failed = set(ids)
        for seq in [*self.scheduler.running, *self.scheduler.waiting]:
            if seq.request_id in failed:
                self.scheduler.finish(seq, "abort")
        return ids

    def _run_step(self, out: SchedulerOutput) -> TokenStepOutput:
        scheduled_time = self.clock()
        first_scheduled = []
        if self._never_scheduled:
            for seq in out.seqs:
                if seq.request_id in self._never_scheduled:
                    self._never_scheduled.discard(seq.request_id)
                    first_scheduled.append(seq.request_id)
        send = None if self.executor is None else self.executor.send
        result = self.runner.execute(out, self.eos_ids, send)
        new_prompt_lps: dict[str, list[dict[int, float]]] = {}
        for seq, lps in zip(out.seqs, result.prompt_logprobs, strict=True):
            if lps:
                seq.prompt_logprobs.extend(lps)  # type: ignore[union-attr]
                new_prompt_lps[seq.request_id] = lps
        for child in self.scheduler.update(out, result.sampled):
            self._groups[child.request_id].append(child)
        self._prompt_tokens_total += sum(
            n
            for n, token in zip(out.num_scheduled_tokens, result.sampled, strict=True)
            if token is None or n > 1
        )
        step_tokens = sum(out.num_scheduled_tokens)
        self._iteration_counts[iteration_bucket(step_tokens)] += 1
        self._iteration_tokens += step_tokens
        step_time = self.clock()
        self.count_busy(step_time - scheduled_time, step_tokens)
        # Per touched request: this step's sample updates by sequence index.
        touched: dict[str, dict[int, SampleUpdate]] = {rid: {} for rid in new_prompt_lps}
        embeddings = self._finish_pooled(out, result.pooled, touched)
        for i, seq in enumerate(out.seqs):
            token = result.sampled[i]
            if token is None:
                continue
            self._generation_tokens_total += 1
            reason, stop_token = self._token_stop(seq, token)
            grammar_complete = False
            if seq.grammar is not None and reason is None:
                reason = self._grammar_stop(seq, token)
                grammar_complete = reason == "stop"
            elif seq.grammar is not None:
                seq.grammar.accept(token)  # finishing anyway; keeps it exact for inspection
            if reason is not None:
                self.scheduler.finish(seq, reason, stop_token)
            touched.setdefault(seq.request_id, {})[seq.index] = SampleUpdate(
                seq.index,
                token,
                result.logprobs[i],
                result.chosen_logprobs[i],
                reason,
                stop_token,
                grammar_complete,
            )
        updates = []
        for rid, new in touched.items():
            group = self._groups[rid]
            if len(group) == 1 and new:  # one sample (n=1): the common case, kept cheap
                samples = list(new.values())
            else:
                samples = [
                    new.get(s.index)
                    or SampleUpdate(s.index, None, None, None, s.finish_reason, _token_reason(s))
                    for s in sorted(group, key=lambda s: s.index)
                ]
            updates.append(
                RequestUpdate(rid, samples, new_prompt_lps.get(rid, []), embeddings.get(rid))
            )
            self._drop_if_done(rid)
        return TokenStepOutput(
            step_time,
            scheduled_time,
            first_scheduled,
            updates,
            len(out.preempted),
            list(dict.fromkeys(s.request_id for s in out.seqs)),
        )

    def count_busy(self, seconds: float, tokens: int) -> None:
        """Add a step of `tokens` scheduled tokens lasting `seconds` to
        `EngineStats.busy_budget_seconds` (a simulator's steps last what its model says)."""
        self._busy_budget_seconds += seconds * tokens / self.capacity.max_num_batched_tokens

    def count_generated(self, tokens: int) -> None:
        """Add tokens sampled outside `step` (a simulator's bulk decode steps)."""
        self._generation_tokens_total += tokens

    def _finish_pooled(
        self,
        out: SchedulerOutput,
        pooled: list[list[float] | None] | None,
        touched: dict[str, dict[int, SampleUpdate]],
    ) -> dict[str, list[float]]:
        """Finish ("stop") each embedding request whose prompt this step ended; its vector."""
        embeddings: dict[str, list[float]] = {}
        for seq, vec in zip(out.seqs, pooled or (), strict=False):
            if vec is None:
                continue
            self.scheduler.finish(seq, "stop")
            touched.setdefault(seq.request_id, {})[0] = SampleUpdate(
                0, None, None, None, "stop", None
            )
            embeddings[seq.request_id] = vec
        return embeddings

    @staticmethod
    def _grammar_stop(seq: Sequence, token: int) -> str | None:
        """Advance a constrained sequence's matcher by a token no token-id stop ended it
        on; "stop" if that completed its grammar (see the module docstring)."""
        grammar = seq.grammar
        assert grammar is not None
        if not grammar.accept(token):
            logger.warning(
                "request %s sample %d: its grammar refused token %d (%s); ending it",
                seq.request_id,
                seq.index,
                token,
                grammar.error.splitlines()[0] if grammar.error else "no error given",
            )
            return "abort"
        return "stop" if grammar.is_finished else None

    def _token_stop(self, seq: Sequence, token: int) -> tuple[str | None, int | None]:
        """Stop conditions decided by the token ids alone (EOS, stop ids, length)."""
        p = seq.params
        if seq.num_generated_tokens >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_ids:
                return "stop", None
            if token in p.stop_token_ids:
                return "stop", token
        if p.max_tokens is not None and seq.num_generated_tokens >= p.max_tokens:
            return "length", None
        if seq.num_tokens >= self.capacity.max_model_len:
            return "length", None
        return None, None

    # -- introspection ----------------------------------------------------------

    def stats(self, with_prefix: bool = True) -> EngineStats:
        bm = self.block_manager
        grammars = self.grammars
        return EngineStats(
            num_total_blocks=bm.num_total_blocks,
            num_free_blocks=bm.num_free_blocks,
            block_size=bm.block_size,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + self._num_awaiting_grammar_seqs(),
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens_total=self._prompt_tokens_total,
            generation_tokens_total=self._generation_tokens_total,
            prefix_cache_queries=bm.prefix_cache_queries,
            prefix_cache_hits=bm.prefix_cache_hits,
            num_cached_blocks=bm.num_cached_blocks,
            cached_block_hashes=bm.cached_block_hashes() if with_prefix else frozenset(),
            prefix_digest=bm.prefix_digest() if with_prefix else b"",
            prefix_hash_salt=bm.hash_salt,
            num_demand_blocks=self._demand_blocks(),
            grammar_compiles=grammars.num_compiles if grammars else 0,
            grammar_compile_seconds=grammars.compile_seconds if grammars else 0.0,
            grammar_cache_hits=grammars.cache_hits if grammars else 0,
            grammar_cache_misses=grammars.cache_misses if grammars else 0,
            num_prefill_tokens=self._prefill_tokens(),
            num_hot_cached_blocks=bm.num_hot_cached_blocks(),
            busy_budget_seconds=self._busy_budget_seconds,
            iteration_tokens_counts=tuple(self._iteration_counts),
            iteration_tokens_sum=self._iteration_tokens,
        )

    def _awaiting_grammar_seqs(self) -> list[Sequence]:
        return [s for rid in self._awaiting_grammar for s in self._groups[rid]]

    def _num_awaiting_grammar_seqs(self) -> int:
        return sum(len(self._groups[rid]) for rid in self._awaiting_grammar)

    def _prefill_tokens(self) -> int:
        """Tokens the unfinished sequences must compute before they next sample
        (`EngineStats.num_prefill_tokens`): a running sequence's uncomputed tokens when
        more than the one a decode step computes; a waiting one's tokens less the
        leading blocks the prefix cache holds for it (at most all but its last token)."""
        bm = self.block_manager
        bs = bm.block_size
        total = 0
        for seq in self.scheduler.running:
            n = seq.num_schedulable_tokens
            if n > 1:
                total += n
        for seq in (*self.scheduler.waiting, *self._awaiting_grammar_seqs()):
            cached = 0
            reads_cache = seq.params.prompt_logprobs is None and not seq.params.embed
            if bm.enable_prefix_caching and reads_cache:
                usable = (seq.num_tokens - 1) // bs
                cached = bm.cached_run(bm.block_hashes(seq)[:usable]) * bs
            total += seq.num_tokens - cached
        return total

    def _demand_blocks(self) -> int:
        """Blocks the unfinished sequences still need to reach their length cap.

        A waiting request with n samples forks later: each future sample needs
        its own output blocks (the prompt's are shared). A waiting request's
        leading prompt blocks that a running sequence already holds, or that an
        earlier waiting request will compute, are shared too and not counted:
        otherwise a queue of requests behind one long system prompt would look
        like a full replica to the router. With every layer windowed, a sequence
        never holds more than its window's blocks (`BlockManager.blocks_to_hold`).
        """
        bm = self.block_manager
        bs, max_len = bm.block_size, self.capacity.max_model_len
        counted: set[int] = set()  # prompt block hashes some waiting request already needs
        total = 0
        waiting = (*self.scheduler.waiting, *self._awaiting_grammar_seqs())
        for seq in (*self.scheduler.running, *waiting):
            cap = seq.params.max_tokens
            cap = None if cap is None else cap - seq.params.output_offset
            target = max_len if cap is None else min(max_len, seq.num_prompt_tokens + cap)
            shared = 0
            if not seq.block_table and bm.enable_prefix_caching:
                hashes = bm.block_hashes(seq)[: (seq.num_prompt_tokens - 1) // bs]
                for h in hashes:
                    if h not in counted and not bm.holds(h):
                        break
                    shared += 1
                counted.update(hashes)
            held = len(seq.block_table) - seq.num_freed_blocks
            total += max(0, bm.blocks_to_hold(target) - held - shared)
            if seq.num_forks_pending:
                out = target - seq.num_prompt_tokens
                total += seq.num_forks_pending * bm.blocks_to_hold(out)
        return total

    def check_block_accounting(self) -> None:
        """Raise AssertionError unless the pool balances (and is empty when idle)."""
        self.block_manager.check_accounting()
        if not self.has_unfinished_requests() and self.block_manager.num_used_blocks:
            raise AssertionError(
                f"{self.block_manager.num_used_blocks} blocks leaked with no request left"
            )

    def close(self) -> None:
        """Stop the other tensor-parallel ranks and leave the process group (idempotent)."""
        grammars = getattr(self, "grammars", None)  # absent if the start failed before it
        if grammars is not None:
            grammars.close()
        if self.executor is not None:
            self.executor.close()
            self.executor = None
            destroy_tp()


def _token_reason(seq: Sequence) -> int | None:
    """A finished sequence's stop token, when a stop token ended it."""
    return seq.stop_reason if isinstance(seq.stop_reason, int) else None
