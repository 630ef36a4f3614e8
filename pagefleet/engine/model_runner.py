"""Turns a step's scheduled sequences into tensors, runs the model, samples.

Owns the model weights and the KV cache. A step's tokens are flattened into
one batch (decodes first, then prompt chunks), with their positions, cache
slots and the per-sequence block tables the attention kernels read; logits
are computed only for the last token of each sequence that samples.

Sampling (and so the grammar masks of structured outputs) happens on this
rank alone (rank 0, the driver): under tensor parallelism the other ranks
run only `forward`, and the logits they help compute are gathered here.

Embedding requests (`SamplingParams.embed`) sample nothing: rank 0 pools the
final hidden states (after the final norm, full on every rank) of their
prompt rows. 'last' takes the prompt's last token's state from the chunk that
ends the prompt; 'mean' sums each chunk's rows into the sequence's
`pooled_sum` (restarted by a chunk from token 0, as after preemption) and
divides by the prompt's length at the end. The vector is L2-normalized.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagefleet.kernels import (
    AttentionMetadata,
    build_attention_metadata,
    cpu_build,
    cpu_paged_decode,
    cpu_paged_prefill,
    cpu_panel_gemm,
)

from .checkpoint import checkpoint_dtype, cpu_bf16_features
from .compiled_forward import (
    CompiledForward,
    trace_inductors_helper_now,
)
from .config import EngineConfig, ResolvedCapacity, resolve_dtype
from .cuda_graphs import DecodeGraphs
from .distributed import min_over_group, select_device, tp_rank
from .errors import RanksOutOfStepError
from .layers.attention import ForwardContext
from .layers.cpu_gemm import PackedWeight
from .loader import load_model
from .models.llama import LlamaArgs
from .sampler import Sampler, SamplingBatch, top_logprobs
from .scheduler import SchedulerOutput
from .sequence import Sequence
from .startup import StartupTimeline

logger = logging.getLogger("pagefleet.engine")

# Without an explicit KV size on the CPU, reserve room for max_num_seqs
# full-length sequences, but no more than this per rank (vLLM's CPU backend
# defaults to 4 GiB). On CUDA the default follows free GPU memory instead.
_DEFAULT_KV_CAP_BYTES = 2 << 30
_DEFAULT_BATCHED_TOKENS = 2048
# GPU memory kept out of the KV cache besides weights and activations: the
# CUDA context's allocations after start, cuBLAS workspaces, Triton's split
# buffers, allocator fragmentation.
_GPU_OVERHEAD_BYTES = 512 << 20


@dataclass
class ModelRunnerOutput:
    """One step's results, one entry per scheduled sequence (None where not applicable)."""

    sampled: list[int | None]
    logprobs: list[dict[int, float] | None]
    chosen_logprobs: list[float | None]
    # New prompt-token logprobs computed this step, in prompt order.
    prompt_logprobs: list[list[dict[int, float]] | None]
    # The pooled, normalized vector of each embedding request whose prompt ended this step.
    pooled: list[list[float] | None] | None = None


@dataclass
class PoolRows:
    """Embedding sequence `seq` computed prompt tokens start..end at flat rows row..."""

    seq: int
    row: int
    start: int
    end: int


@dataclass
class PromptRows:
    """Sequence `seq` scores prompt tokens lo+1..hi from flat rows row..row+hi-lo."""

    seq: int
    row: int
    lo: int
    hi: int


@dataclass
class StepInputs:
    """One step as tensors: what the driver sends to every tensor-parallel worker."""

    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    meta: AttentionMetadata
    blocks_to_copy: list[tuple[int, int]]
    logit_rows: torch.Tensor  # [rows]: flat token indices whose logits are needed

    def to(self, device: torch.device) -> StepInputs:
        if device.type == "cpu":
            return self
        # One host-to-device copy for the whole step: every index tensor is
        # packed into one int64 buffer, copied, and split again on the device.
        m = self.meta
        parts = [
            self.input_ids,
            self.positions,
            self.logit_rows,
            m.slot_mapping,
            m.block_tables.reshape(-1),
            m.context_lens,
            m.query_start_loc,
        ]
        flat = torch.cat([t.to(torch.int64) for t in parts]).to(device, non_blocking=True)
        ids, pos, rows, slots, tables, lens, starts = flat.split([t.numel() for t in parts])
        meta = AttentionMetadata(
            slot_mapping=slots,
            num_decode_tokens=m.num_decode_tokens,
            block_tables=tables.view(m.block_tables.shape).to(torch.int32),
            context_lens=lens.to(torch.int32),
            query_start_loc=starts.to(torch.int32),
            max_query_len=m.max_query_len,
            max_decode_context_len=m.max_decode_context_len,
        )
        if m.padded:  # not built for CUDA steps; kept correct if a caller asks for them
            meta = m.to(device)
        return StepInputs(ids, pos, meta, self.blocks_to_copy, rows)


def kv_heads_per_rank(num_kv_heads: int, tp: int) -> int:
    """KV heads one rank holds: split evenly, or one replicated head when fewer than ranks."""
    return num_kv_heads // tp if num_kv_heads >= tp else 1


def weight_bytes_per_rank(args: LlamaArgs, tp: int, elem: int) -> int:
    """The bytes of one rank's share of the weights (everything but norms is split over ranks)."""
    q, kv = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
    layer = args.hidden_size * (2 * q + 2 * kv)
    if args.qkv_bias:
        layer += q + 2 * kv
    embed = args.vocab_size * args.hidden_size * (1 if args.tie_word_embeddings else 2)
    split = (args.num_layers * layer + args.mlp_weights() + embed) // tp
    qk_norms = {"head": 2 * args.head_dim, "projection": q + kv}.get(args.qk_norm, 0)
    norms = (2 * args.num_layers + 1) * args.hidden_size + args.num_layers * qk_norms
    return (split + norms) * elem


def activation_bytes(args: LlamaArgs, max_tokens: int, max_seqs: int, elem: int, tp: int) -> int:
    """A bound on one step's activations: a layer's widest tensors for max_tokens, and fp32 logits."""
    q_kv = (args.num_heads + 2 * args.num_kv_heads) * args.head_dim // tp
    per_token = 4 * args.hidden_size + q_kv + 3 * args.intermediate_size // tp
    # Sampling works on fp32 [rows, vocab]: logits, probabilities, noise, a sort.
    sampling = max_seqs * args.vocab_size * 4 * 6
    return 2 * max_tokens * per_token * elem + sampling


def gpu_kv_cache_bytes(
    total: int, free: int, utilization: float, weights: int, activations: int
) -> int:
    """KV cache bytes for one GPU under vLLM's gpu_memory_utilization.

    This rank may use `utilization` of the GPU's total memory, less what is
    already taken on it (by this process's context or anyone else), less
    its weights, activations and a fixed overhead.
    """
    return int(total * utilization) - (total - free) - weights - activations - _GPU_OVERHEAD_BYTES


def resolve_capacity(
    config: EngineConfig, args: LlamaArgs, gpu_memory: tuple[int, int] | None = None
) -> ResolvedCapacity:
    """Work out KV blocks, context length and token budget for this model.

    Sizes are per tensor-parallel rank. `gpu_memory` is (free, total) bytes
    of this rank's GPU before the weights are loaded, on CUDA; it sizes the
    cache when the config gives no size.
    """
    elem = torch.empty((), dtype=config.torch_dtype).element_size()
    tp = config.tensor_parallel_size
    bytes_per_block = (
        2
        * args.num_layers
        * config.block_size
        * kv_heads_per_rank(args.num_kv_heads, tp)
        * args.head_dim
        * elem
    )

    model_max = args.max_position_embeddings
    if config.max_model_len is not None and config.max_model_len > model_max:
        raise ValueError(
            f"max_model_len {config.max_model_len} exceeds the model's "
            f"max_position_embeddings ({model_max})"
        )
    max_len = config.max_model_len or model_max

    if config.num_kv_blocks is not None:
        num_blocks = config.num_kv_blocks
    elif config.kv_cache_memory_bytes is not None:
        num_blocks = config.kv_cache_memory_bytes // bytes_per_block
    elif gpu_memory is not None:
        free, total = gpu_memory
        max_tokens = config.max_num_batched_tokens or (
            _DEFAULT_BATCHED_TOKENS
            if config.enable_chunked_prefill
            else max(_DEFAULT_BATCHED_TOKENS, max_len)
        )
        budget = gpu_kv_cache_bytes(
            total,
            free,
            config.gpu_memory_utilization,
            weight_bytes_per_rank(args, tp, elem),
            activation_bytes(args, max_tokens, config.max_num_seqs, elem, tp),
        )
        if budget < bytes_per_block:
            raise ValueError(
                f"no GPU memory left for the KV cache: {free / 2**30:.1f} of {total / 2**30:.1f} "
                f"GiB free, gpu_memory_utilization {config.gpu_memory_utilization}; raise it, "
                "free the GPU, or give kv_cache_memory_bytes"
            )
        num_blocks = budget // bytes_per_block
    else:
        wanted = config.max_num_seqs * -(-max_len // config.block_size)
        num_blocks = min(wanted, _DEFAULT_KV_CAP_BYTES // bytes_per_block)
    if num_blocks < 1:
        raise ValueError(f"KV cache budget holds no block (one block is {bytes_per_block} bytes)")

    kv_tokens = num_blocks * config.block_size
    if max_len > kv_tokens:
        if config.max_model_len is not None:
            raise ValueError(
                f"max_model_len {max_len} is larger than the KV cache ({kv_tokens} tokens); "
                "give more KV blocks or a smaller max_model_len"
            )
        logger.warning(
            "max_model_len lowered from %d to the KV cache size, %d tokens", max_len, kv_tokens
        )
        max_len = kv_tokens

    if config.max_num_batched_tokens is not None:
        budget = config.max_num_batched_tokens
    elif config.enable_chunked_prefill:
        budget = _DEFAULT_BATCHED_TOKENS
    else:
        budget = max(max_len, _DEFAULT_BATCHED_TOKENS)
    if not config.enable_chunked_prefill and budget < max_len:
        raise ValueError(
            f"max_num_batched_tokens ({budget}) must be >= max_model_len ({max_len}) "
            "when chunked prefill is disabled"
        )
    return ResolvedCapacity(num_blocks, config.block_size, max_len, budget, bytes_per_block)


def _packed_of(module: torch.nn.Module) -> list[PackedWeight]:
    """A module's pre-packed weights: none, its one (`packed`), or its list of them."""
    packed = getattr(module, "packed", None)
    if packed is None:
        return []
    return list(packed) if isinstance(packed, list) else [packed]


class ModelRunner:
    def __init__(
        self, config: EngineConfig, args: LlamaArgs, startup: StartupTimeline | None = None
    ) -> None:
        """`startup`: where to mark the weights, compile and warm-up phases."""
        self.config = config
        self._startup = startup
        # One GPU per rank (as its process sees GPUs: see EngineConfig), made current for
        # NCCL and Triton.
        self.device = select_device(config.device, tp_rank(), config.device_visibility)
        gpu_memory = None
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)  # before the weights
            # Every rank must size the same number of blocks: the least free memory decides.
            gpu_memory = (min_over_group(free, self.device), total)
        self.capacity = resolve_capacity(config, args, gpu_memory)
        runs, dtype_note = config.runtime_dtype
        if dtype_note is not None and tp_rank() == 0:
            kept = runs == checkpoint_dtype(config.hf_config())
            logger.log(logging.INFO if kept else logging.WARNING, dtype_note)
        dtype = resolve_dtype(runs)
        self.model = load_model(config.checkpoint, dtype, self.device, self.capacity.max_model_len)
        self.vocab_size = args.vocab_size
        self.packed_weights: list[PackedWeight] = []
        if self.device.type == "cpu":
            packed = self._pack_weights(min(config.max_num_seqs, 64))
            logger.info(
                "CPU GEMM: %d of the model's linear layers use pre-packed oneDNN weights "
                "(CPU capability %s%s); decode steps of up to %d rows: %s",
                packed,
                torch.backends.cpu.get_cpu_capability(),
                self._gemm_dtype_note(dtype),
                cpu_panel_gemm.MAX_ROWS,
                self._decode_gemm_note(dtype),
            )
            # Built (or loaded from its cache) here, not on the first request.
            in_place = cpu_paged_decode.available(dtype)
            chunks = cpu_paged_prefill.available(dtype, args.head_dim)
            logger.info(
                "CPU attention: decodes %s; prompt chunks %s%s",
                "read the paged cache in place (C kernel)"
                if in_place
                else "gather the cache (torch path: no C kernel for this dtype or machine)",
                "read it in place (C kernel)"
                if chunks
                else "by torch's flash attention (no C kernel for this dtype, head size or machine)",
                self._attention_products_note(dtype) if in_place or chunks else "",
            )
        cap = self.capacity
        kv_heads = self.model.num_kv_heads
        # Zeroed, not empty: padded key slots are masked, but 0 * NaN garbage
        # in a value row would still poison the weighted sum.
        # CUDA graphs pad decode batches into one scratch block past the pool's last.
        graphs = (
            self.device.type == "cuda" and not config.eager and config.tensor_parallel_size == 1
        )
        self.kv_cache = torch.zeros(
            args.num_layers,
            2,
            cap.num_kv_blocks + graphs,
            cap.block_size,
            kv_heads,
            args.head_dim,
            dtype=dtype,
            device=self.device,
        )  # [layers, k/v, blocks, block_size, kv_heads, head_dim]
        self.kv_caches = [(layer[0], layer[1]) for layer in self.kv_cache]
        self.sampler = Sampler(config.seed)
        self.compiled: CompiledForward | None = None
        self.compiler: threading.Thread | None = None  # compile_in_background's builder
        self.decode_graphs: DecodeGraphs | None = None
        self.compile_seconds = 0.0
        self._mark("weights")
        if not config.eager:
            self._compile()
        logger.info(
            "KV cache: %d blocks of %d tokens = %d tokens (%.1f MiB); "
            "maximum concurrency for %d tokens per request: %.2fx",
            cap.num_kv_blocks,
            cap.block_size,
            cap.num_kv_tokens,
            cap.num_kv_blocks * cap.kv_bytes_per_block / 2**20,
            cap.max_model_len,
            cap.max_concurrency,
        )

    def _gemm_dtype_note(self, dtype: torch.dtype) -> str:
        if dtype not in (torch.bfloat16, torch.float16):
            return ""
        name = str(dtype).removeprefix("torch.")
        if any(w.emulated for w in self.packed_weights):
            return f", {name} emulated through fp32 copies"
        return f", {name} native: {', '.join(cpu_bf16_features()) or 'the CPU'}"

    def _attention_products_note(self, dtype: torch.dtype) -> str:
        if dtype != torch.bfloat16:
            return ""
        if cpu_build.attention_bf16_pairs():
            return "; bf16 products in bf16 pairs (AVX512-BF16 vdpbf16ps), fp32 sums"
        return "; bf16 widened to fp32 for the products (no AVX512-BF16)"

    def _decode_gemm_note(self, dtype: torch.dtype) -> str:
        if any(w.has_panels for w in self.packed_weights):
            return f"the panel kernel ({cpu_panel_gemm.instructions(dtype)})"
        return "oneDNN (no panel kernel for this dtype or machine)"

    def _pack_weights(self, batch_hint: int) -> int:
        count = sum(
            m.pack(batch_hint)
            for m in self.model.modules()
            if hasattr(m, "pack") and callable(m.pack)
        )
        # Slots in module order (a layer's list of weights in its own order): what a
        # compiled forward's packed_linear and packed_moe_experts ops name.
        self.packed_weights = [w for m in self.model.modules() for w in _packed_of(m)]
        for slot, weight in enumerate(self.packed_weights):
            weight.slot = slot
        return count

    def _compile(self) -> None:
        """Compile the forward (and capture CUDA graphs) before the first request.

        Under tensor parallelism the model stays eager: its all-reduces are
        not traced.
        """
        if self.config.tensor_parallel_size > 1:
            logger.info("torch.compile: off under tensor parallelism; the model runs eagerly")
            return
        if self.config.compile_in_background and self.device.type == "cpu":
            trace_inductors_helper_now()
            self.compiler = threading.Thread(
                target=self._compile_in_background, name="pagefleet-compile", daemon=True
            )
            self.compiler.start()
            logger.info("torch.compile: building in the background; serving eagerly meanwhile")
            return
        start = time.perf_counter()
        self.compiled = CompiledForward(self.model, self.config.compile_cache_dir)
        self.compiled.warm_up(lambda n: self.forward(self._dummy_inputs(n)), on_compiled=self._mark)
        if self.device.type == "cuda":
            self.decode_graphs = DecodeGraphs.capture(self)
        # Warm-up wrote K/V into block 0; the cache starts zeroed (see __init__).
        self.kv_cache.zero_()
        self._mark("warm_up")
        self.compile_seconds = time.perf_counter() - start
        logger.info(
            "torch.compile: forward compiled in %.1f s (inductor cache %s)%s",
            self.compile_seconds,
            self.compiled.cache_dir,
            f"; CUDA graphs for decode batches {self.decode_graphs.sizes}"
            if self.decode_graphs
            else "",
        )

    def _compile_in_background(self) -> None:
        """Compile and warm up on a scratch KV block, then hand the forward to the steps.

        The steps run eagerly meanwhile; each reads `self.compiled` once, so the switch
        falls between two steps. A failure leaves the model eager."""
        start = time.perf_counter()
        try:
            compiled = CompiledForward(self.model, self.config.compile_cache_dir)
            scratch = torch.zeros_like(self.kv_cache[:, :, :1])  # the dummy steps' block 0
            caches = [(layer[0], layer[1]) for layer in scratch]
            compiled.warm_up(lambda n: self._warm_step(compiled, n, caches))
        except Exception:
            logger.exception("torch.compile failed in the background; the model stays eager")
            return
        self.compile_seconds = time.perf_counter() - start
        self.compiled = compiled
        logger.info(
            "torch.compile: forward compiled in the background in %.1f s (inductor cache %s); "
            "the next step runs it",
            self.compile_seconds,
            compiled.cache_dir,
        )

    @torch.inference_mode()
    def _warm_step(
        self,
        compiled: CompiledForward,
        num_tokens: int,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> None:
        inputs = self._dummy_inputs(num_tokens)
        ctx = ForwardContext(inputs.meta, kv_caches, self.packed_weights)
        compiled(inputs.input_ids, inputs.positions, ctx)

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Wait for a background compilation; whether the forward is compiled."""
        if self.compiler is not None:
            self.compiler.join(timeout)
        return self.compiled is not None

    def _mark(self, phase: str) -> None:
        if self._startup is not None:
            self._startup.mark(phase)

    @torch.inference_mode()
    def _dummy_inputs(self, num_tokens: int) -> StepInputs:
        """A step of `num_tokens` tokens of one sequence (a decode if one) in block 0.

        Made in inference mode, as `execute` makes a step's tensors: the graphs
        guard on it.
        """
        bs = self.capacity.block_size
        meta = build_attention_metadata(
            [num_tokens],
            [num_tokens],
            [[0] * -(-num_tokens // bs)],
            bs,
            padded=self.device.type == "cpu",
        )
        return StepInputs(
            input_ids=torch.zeros(num_tokens, dtype=torch.int64),
            positions=torch.arange(num_tokens, dtype=torch.int64),
            meta=meta,
            blocks_to_copy=[],
            logit_rows=torch.tensor([num_tokens - 1], dtype=torch.int64),
        )

    def prepare(
        self, out: SchedulerOutput
    ) -> tuple[StepInputs, list[int], list[PromptRows], list[PoolRows]]:
        """Flatten a step into tensors.

        Returns the inputs every tensor-parallel rank runs, the `out.seqs`
        index of each sampling sequence (in logits-row order), the
        prompt-logprob row ranges and the embedding sequences' rows.
        """
        n = len(out.seqs)
        # Decodes first: the attention kernels take them as one group.
        order = sorted(range(n), key=lambda i: out.num_scheduled_tokens[i] != 1)
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []  # flat token index of each sampling sequence's last token
        sample_seqs: list[int] = []
        prompt_rows: list[PromptRows] = []
        pool_rows: list[PoolRows] = []
        for i in order:
            seq = out.seqs[i]
            num_new = out.num_scheduled_tokens[i]
            start = seq.num_computed_tokens
            end = start + num_new
            first_row = len(input_ids)
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            query_lens.append(num_new)
            context_lens.append(end)
            tables.append(seq.block_table)
            if seq.params.embed:
                pool_rows.append(PoolRows(i, first_row, start, end))
            elif out.sampling[i]:
                sample_rows.append(len(input_ids) - 1)
                sample_seqs.append(i)
            if seq.params.prompt_logprobs is not None:
                # Logits at position p score prompt token p + 1; only new ones.
                lo = max(start, len(seq.prompt_logprobs or [None]) - 1)
                hi = min(end, seq.num_prompt_tokens - 1)
                if hi > lo:
                    prompt_rows.append(PromptRows(i, first_row + lo - start, lo, hi))
        logit_rows = [r for p in prompt_rows for r in range(p.row, p.row + p.hi - p.lo)]
        inputs = StepInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            # The padded layouts only the torch (CPU) path reads.
            meta=build_attention_metadata(
                query_lens,
                context_lens,
                tables,
                self.capacity.block_size,
                padded=self.device.type == "cpu",
            ),
            blocks_to_copy=list(out.blocks_to_copy),
            logit_rows=torch.tensor(logit_rows + sample_rows, dtype=torch.int64),
        )
        return inputs, sample_seqs, prompt_rows, pool_rows

    @torch.inference_mode()
    def forward(
        self, inputs: StepInputs, copy_blocks: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What every rank runs: block copies, the model, the logits of `logit_rows`.

        Returns [len(logit_rows), vocab] logits (collective under tensor parallelism)
        and the step's final hidden states [num_tokens, hidden] (full on every rank).
        copy_blocks=False: the caller already made this step's copy-on-write copies.
        """
        inputs = inputs.to(self.device)
        if copy_blocks and inputs.blocks_to_copy:
            self._copy_blocks(inputs.blocks_to_copy)
        ctx = ForwardContext(inputs.meta, self.kv_caches, self.packed_weights)
        # [num_tokens, hidden]
        if self.decode_graphs is not None and self.decode_graphs.fits(inputs):
            hidden = self.decode_graphs.run(inputs, ctx)
        elif self.compiled is not None:
            hidden = self.compiled(inputs.input_ids, inputs.positions, ctx)
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, ctx)
        if not len(inputs.logit_rows):
            return hidden.new_empty(0, self.vocab_size), hidden
        return self.model.compute_logits(hidden[inputs.logit_rows]), hidden

    @torch.inference_mode()
    def execute(
        self,
        out: SchedulerOutput,
        eos_ids: frozenset[int],
        send_to_ranks: Callable[[StepInputs], None] | None = None,
    ) -> ModelRunnerOutput:
        """Run one step for the scheduled sequences (results in `out.seqs` order).

        `send_to_ranks` (an executor's `send`, under tensor parallelism) gets
        the step's inputs before this rank runs them.

        Where a failure leaves the other tensor-parallel ranks: everything that
        can fail on this rank alone is done before they are told to run the step
        (preparing the inputs, this rank's copy-on-write copies), so a failure
        there leaves them idle, waiting for the next step. Sampling runs after
        the forward pass, whose last collective every rank has then completed,
        so a failure there leaves them idle too. A failure in between (sending,
        or this rank's share of the forward pass) leaves them inside the step's
        collectives, which this rank can no longer match: it raises
        `RanksOutOfStepError`, and the group must not be used again.
        """
        inputs, sample_seqs, prompt_rows, pool_rows = self.prepare(out)
        if inputs.blocks_to_copy:
            self._copy_blocks(inputs.blocks_to_copy)
        if send_to_ranks is None:
            logits, hidden = self.forward(inputs, copy_blocks=False)
        else:
            try:
                send_to_ranks(inputs)
                logits, hidden = self.forward(inputs, copy_blocks=False)
            except Exception as e:
                raise RanksOutOfStepError(
                    "rank 0 failed inside a tensor-parallel step "
                    f"({type(e).__name__}: {e}); the ranks are out of step"
                ) from e
        # logits: [prompt-logprob rows + sampling rows, vocab]
        result = self.sample(out, logits, sample_seqs, prompt_rows, eos_ids)
        if pool_rows:
            result.pooled = self.pool(out, hidden, pool_rows)
        return result

    def pool(
        self, out: SchedulerOutput, hidden: torch.Tensor, pool_rows: list[PoolRows]
    ) -> list[list[float] | None]:
        """Each embedding sequence's vector, where this step ended its prompt."""
        pooled: list[list[float] | None] = [None] * len(out.seqs)
        for p in pool_rows:
            seq = out.seqs[p.seq]
            rows = hidden[p.row : p.row + p.end - p.start].float()
            if self.config.pooling == "mean":
                before = seq.pooled_sum if p.start and seq.pooled_sum is not None else 0
                seq.pooled_sum = before + rows.sum(dim=0)
            if p.end < seq.num_prompt_tokens:
                continue
            vec = rows[-1] if self.config.pooling == "last" else seq.pooled_sum / p.end
            seq.pooled_sum = None
            pooled[p.seq] = F.normalize(vec, dim=0).cpu().tolist()
        return pooled

    def sample(
        self,
        out: SchedulerOutput,
        logits: torch.Tensor,
        sample_seqs: list[int],
        prompt_rows: list[PromptRows],
        eos_ids: frozenset[int],
    ) -> ModelRunnerOutput:
        n = len(out.seqs)
        result = ModelRunnerOutput([None] * n, [None] * n, [None] * n, [None] * n)
        at = 0
        for p in prompt_rows:
            seq = out.seqs[p.seq]
            count = p.hi - p.lo
            logprobs = logits[at : at + count].float().log_softmax(dim=-1)
            targets = torch.tensor(seq.token_ids[p.lo + 1 : p.hi + 1], device=logits.device)
            result.prompt_logprobs[p.seq] = top_logprobs(
                logprobs, targets, seq.params.prompt_logprobs or 0
            )
            at += count
        if not sample_seqs:
            return result
        batch = self._sampling_batch([out.seqs[i] for i in sample_seqs], eos_ids, self.vocab_size)
        sampled = self.sampler(logits[at:], batch)
        for row, i in enumerate(sample_seqs):
            result.sampled[i] = sampled.token_ids[row]
            result.logprobs[i] = sampled.logprobs[row]
            result.chosen_logprobs[i] = sampled.chosen_logprobs[row]
        return result

    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        # kv_cache: [layers, k/v, blocks, ...]; one indexed copy for all layers.
        self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]

    @staticmethod
    def _sampling_batch(
        seqs: list[Sequence], eos_ids: frozenset[int], vocab_size: int
    ) -> SamplingBatch:
        """The sampler's view of the sampling sequences (only those: a prompt chunk that
        stops short samples nothing, so it gets no grammar mask either)."""
        params = [s.params for s in seqs]
        banned = []
        for row, seq in enumerate(seqs):
            p = seq.params
            if seq.num_generated_tokens < p.min_tokens:
                stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids))
                if stop_ids:
                    banned.append((row, sorted(stop_ids)))
            if p.bad_words_token_ids:
                words = _bad_word_ends(p.bad_words_token_ids, seq.generated_token_ids)
                if words:
                    banned.append((row, words))
        batch = SamplingBatch(params=params, seeds=[s.sample_seed() for s in seqs], banned=banned)
        if any(p.needs_penalties for p in params):
            batch.prompt_token_ids = [s.original_prompt_token_ids for s in seqs]
            batch.output_token_ids = [s.generated_token_ids for s in seqs]
        grammar_rows = [
            row for row, s in enumerate(seqs) if s.grammar is not None and s.grammar.active
        ]
        if grammar_rows:
            # Filled on the CPU by each row's matcher (llguidance writes into host memory).
            bitmask = torch.empty(len(grammar_rows), -(-vocab_size // 32), dtype=torch.int32)
            for i, row in enumerate(grammar_rows):
                seqs[row].grammar.fill_bitmask(bitmask, i)  # type: ignore[union-attr]
            batch.grammar_rows, batch.grammar_bitmask = grammar_rows, bitmask
        return batch


def _bad_word_ends(words: tuple[tuple[int, ...], ...], output: list[int]) -> list[int]:
    """The tokens that would complete a bad word now: each word's last token where the
    output ends with the tokens before it (a one-token word: always)."""
    out = set()
    for word in words:
        head = list(word[:-1])
        if not head or output[len(output) - len(head) :] == head:
            out.add(word[-1])
    return sorted(out)
