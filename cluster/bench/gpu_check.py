"""The GPU check (`benchmarks/gpu_check.sh`): everything only a CUDA machine can tell us, in one run.

1. Kernels against the torch reference on the GPU: the KV store, and decode
   plus chunked prefill in one mixed step, for fp32 / fp16 / bf16, block
   sizes 1 to 128, MHA and GQA shapes, every decode split count; and one
   cache past 2^31 elements per layer (int64 offsets, for real).
2. Greedy equality with transformers on the GPU (fp32, tokens must be equal)
   for the SmolLM-135M and Llama-3.2-1B shaped checkpoints, with the KV cache
   sized from free GPU memory (the CUDA default); bf16 agreement reported.
3. Tensor parallelism: TP=2 greedy tokens equal TP=1's (skipped, with a line
   saying so, where fewer than 2 GPUs are visible).
4. The paged decode kernel alone: achieved bandwidth as a share of the GPU's
   peak memory bandwidth and of a measured device-to-device copy.
5. Offline throughput, bf16: 256 requests x 128 new tokens, pagefleet
   `LLM.generate` beside transformers' continuous batching (`generate_batch`)
   on the same GPU.

Every section runs even when an earlier one fails (its error goes into the
report); the exit status is 1 if any check failed. Writes a markdown report
(benchmarks/results/gpu.md by default) and prints it. Budget: under 8 minutes
on one H200, the models already written.
"""

from __future__ import annotations

import argparse
import gc
import shlex
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

# Peak memory bandwidth by device name, bytes/s (vendor data sheets), used when
# the device properties do not give memory clock and bus width.
_PEAK_BANDWIDTH = {  # first match wins: more specific names first
    "GH200": 4.0e12,
    "H200": 4.8e12,
    "H100 NVL": 3.9e12,
    "H100 PCIe": 2.0e12,
    "H100": 3.35e12,  # SXM
    "B200": 8.0e12,
    "A100-SXM4-80GB": 2.039e12,
    "A100-PCIE-80GB": 1.935e12,
    "A100": 1.555e12,  # 40 GB
    "L40S": 0.864e12,
    "L4": 0.3e12,
    "A10G": 0.6e12,
    "A10": 0.6e12,
}
# Tolerances against the fp32 torch reference, by cache dtype.
_TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
_NEW_TOKENS_EQ = 32
# "cuda" for the check; `--dry-run-cpu` sets "cpu" to rehearse the script's own
# plumbing on a machine without a GPU (Triton in its interpreter, the engine on
# its torch path, no timings that mean anything).
DEVICE = "cuda"


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


class Report:
    """Markdown sections, with every check's verdict counted."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.failures: list[str] = []

    def add(self, text: str) -> None:
        self.parts.append(text)
        print(text + "\n", flush=True)

    def verdict(self, ok: bool, what: str) -> str:
        if not ok:
            self.failures.append(what)
        return "ok" if ok else "FAIL"

    def section(self, title: str, fn: Callable[[Report], str]) -> None:
        """Run one section; its failure is reported, not raised."""
        start = time.perf_counter()
        try:
            body = fn(self)
        except Exception:
            self.failures.append(title)
            body = "**ERROR**\n\n```\n" + traceback.format_exc()[-3000:] + "```"
        finally:
            _free_gpu()
        self.add(f"## {title}\n\n{body}\n\n({time.perf_counter() - start:.0f} s)")


def _free_gpu() -> None:
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _table(header: list[str], rows: list[list[object]]) -> str:
    from .report import markdown_table

    return markdown_table(header, rows)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# -- 1. kernels ---------------------------------------------------------------


def _mixed_step(
    dtype: torch.dtype,
    block_size: int,
    heads: int,
    kv_heads: int,
    d: int,
    shapes: list[tuple[int, int]],
    g: torch.Generator,
    num_splits: int | None = None,
) -> tuple[float, bool]:
    """(max abs error, within tolerance) of one step on the GPU against the CPU reference."""
    from pagefleet.kernels import build_attention_metadata, triton_attention, triton_paged_attention
    from pagefleet.kernels.paged_attention import paged_attention as reference

    q_lens, ctx = [q for q, _ in shapes], [c for _, c in shapes]
    num_blocks = sum(-(-c // block_size) for c in ctx) + 16
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[free.pop() for _ in range(-(-c // block_size))] for c in ctx]
    meta = build_attention_metadata(q_lens, ctx, tables, block_size)  # with the padded layouts
    k = torch.randn(num_blocks, block_size, kv_heads, d, generator=g).to(dtype)
    v = torch.randn(num_blocks, block_size, kv_heads, d, generator=g).to(dtype)
    q = torch.randn(sum(q_lens), heads, d, generator=g).to(dtype)
    scale = d**-0.5
    ref = reference(q.float(), k.float(), v.float(), meta, scale)
    kc, vc, qc = k.to(DEVICE), v.to(DEVICE), q.to(DEVICE)
    gpu_meta = build_attention_metadata(q_lens, ctx, tables, block_size, padded=False).to(DEVICE)
    if num_splits is None:
        out = triton_paged_attention(qc, kc, vc, gpu_meta, scale)
    else:  # decode-only step with a forced split count
        out = triton_attention.paged_decode_attention(
            qc, kc, vc, gpu_meta.block_tables, gpu_meta.context_lens, scale, num_splits=num_splits
        )
    out = out.float().cpu()
    tol = _TOL[dtype]
    err = (out - ref).abs().max().item()
    return err, bool(torch.allclose(out, ref, atol=tol, rtol=tol)) and out.isfinite().all().item()


def _kernels(report: Report) -> str:
    from pagefleet.kernels import store_kv_cache, triton_attention

    g = torch.Generator().manual_seed(0)
    rows = []

    def check(dtype, block_size, heads, kv_heads, d, shapes, what, num_splits=None) -> None:
        label = f"{what} {_name(dtype)} bs{block_size} {heads}/{kv_heads} d{d}"
        try:
            err, ok = _mixed_step(dtype, block_size, heads, kv_heads, d, shapes, g, num_splits)
            shown = f"{err:.1e}"
        except Exception as exc:  # one configuration's failure must not hide the others
            ok, shown = False, f"error: {exc!r}"[:300]
            traceback.print_exc()
        rows.append(
            [
                what,
                _name(dtype),
                block_size,
                f"{heads}/{kv_heads}",
                d,
                "auto" if num_splits is None else num_splits,
                shown,
                report.verdict(ok, label),
            ]
        )

    def mixed(bs: int) -> list[tuple[int, int]]:
        # Decodes (1 token, block edges, long), then chunks with and without cached context
        # (every chunk has >= 2 tokens: single-token sequences are decodes and come first).
        chunk = max(bs, 2)
        return [
            (1, 1),
            (1, bs),
            (1, bs + 1),
            (1, 1000),
            (7, 7),
            (64, 300),
            (chunk, 2 * chunk + 3),
            (33, 33),
        ]

    # Each configuration compiles its own kernels (about 1 s each): a matrix sized to the budget.
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for heads, kv_heads, d in ((32, 8, 64), (9, 3, 64), (16, 16, 128)):
            check(dtype, 16, heads, kv_heads, d, mixed(16), "mixed step")
    for block_size in (1, 8, 32, 128):  # below 16 (key tiles span blocks) and larger blocks
        check(torch.bfloat16, block_size, 32, 8, 64, mixed(block_size), "mixed step")
    decodes = [(1, c) for c in (1, 17, 250, 1000, 3000, 4097)]
    for splits in triton_attention.SPLIT_BUCKETS:
        check(torch.bfloat16, 16, 32, 8, 128, decodes, "decode splits", num_splits=splits)

    # The store kernel, bit for bit against index_copy_.
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        k = torch.randn(64, 16, 8, 64, device=DEVICE).to(dtype)
        v = torch.randn_like(k)
        k_ref, v_ref = k.clone(), v.clone()
        qkv = torch.randn(40, 48, 64, device=DEVICE).to(
            dtype
        )  # strided K/V, as the fused QKV gives
        key, value = qkv[:, 32:40], qkv[:, 40:48]
        slots = torch.randperm(64 * 16, device=DEVICE)[:40]
        triton_attention.store_kv_cache(key, value, k, v, slots)
        k_ref.view(-1, 8, 64).index_copy_(0, slots, key)
        v_ref.view(-1, 8, 64).index_copy_(0, slots, value)
        ok = torch.equal(k, k_ref) and torch.equal(v, v_ref)
        rows.append(
            [
                "store",
                _name(dtype),
                16,
                "-/8",
                64,
                "-",
                "exact" if ok else "differs",
                report.verdict(ok, f"store {_name(dtype)}"),
            ]
        )

    try:
        rows.append(_past_two_to_the_31(report, store_kv_cache))
    except Exception as exc:
        traceback.print_exc()
        rows.append(
            [
                "> 2^31 elements",
                "bfloat16",
                16,
                "32/8",
                128,
                "auto",
                f"error: {exc!r}"[:300],
                report.verdict(False, "cache past 2^31 elements"),
            ]
        )
    header = ["kernel", "dtype", "block", "heads/kv", "head dim", "splits", "max abs err", "result"]
    tol = ", ".join(f"{_name(t)} {v:g}" for t, v in _TOL.items())
    return f"Tolerances (atol = rtol) against the fp32 torch reference: {tol}.\n\n" + _table(
        header, rows
    )


def _past_two_to_the_31(report: Report, store_kv_cache) -> list[object]:
    """A bf16 cache of more than 2^31 elements per layer (8.6 GiB for K and V): blocks at its top."""
    from pagefleet.kernels import build_attention_metadata, triton_paged_attention
    from pagefleet.kernels.paged_attention import paged_attention as reference

    bs, kv_heads, heads, d = 16, 8, 32, 128
    num_blocks = (1 << 31) // (bs * kv_heads * d) + 4096  # 135,168 blocks
    if DEVICE != "cuda":  # a CPU dry run rehearses the same steps on a small cache
        num_blocks = 128
    # Zeroed: the reference masks unused key slots with -inf, and 0 x NaN garbage would poison it.
    k_cache = torch.zeros(num_blocks, bs, kv_heads, d, device=DEVICE, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    shapes = [(1, 40), (1, 300), (20, 20), (17, 90)]
    q_lens, ctx = [q for q, _ in shapes], [c for _, c in shapes]
    # Every sequence's blocks at the very top of the cache: offsets past 2^31.
    top = list(range(num_blocks - 1, num_blocks - 64, -1))
    tables = []
    for c in ctx:
        tables.append([top.pop(0) for _ in range(-(-c // bs))])
    g = torch.Generator().manual_seed(5)
    total = sum(ctx)
    keys = torch.randn(total, kv_heads, d, generator=g).to(torch.bfloat16)
    values = torch.randn(total, kv_heads, d, generator=g).to(torch.bfloat16)
    q = torch.randn(sum(q_lens), heads, d, generator=g).to(torch.bfloat16)
    # Write every position of every sequence with the store kernel (int64 slots).
    whole = build_attention_metadata(ctx, ctx, tables, bs, padded=False)
    store_kv_cache(
        keys.to(DEVICE), values.to(DEVICE), k_cache, v_cache, whole.slot_mapping.to(DEVICE)
    )
    meta = build_attention_metadata(q_lens, ctx, tables, bs, padded=False).to(DEVICE)
    out = triton_paged_attention(q.to(DEVICE), k_cache, v_cache, meta, d**-0.5).float().cpu()
    # The reference on a small cache holding the same blocks, renumbered 0..n-1.
    used = sorted({b for t in tables for b in t})
    index = {b: i for i, b in enumerate(used)}
    small_k = k_cache[used].float().cpu()
    small_v = v_cache[used].float().cpu()
    small_tables = [[index[b] for b in t] for t in tables]
    ref = reference(
        q.float(),
        small_k,
        small_v,
        build_attention_metadata(q_lens, ctx, small_tables, bs),
        d**-0.5,
    )
    del k_cache, v_cache
    tol = _TOL[torch.bfloat16]
    err = (out - ref).abs().max().item()
    ok = bool(torch.allclose(out, ref, atol=tol, rtol=tol))
    # And the store landed where index_copy_ puts it (reads agree with writes).
    stored_ok = torch.equal(
        small_k.view(-1, kv_heads, d)[
            torch.tensor(
                [
                    index[t[p // bs]] * bs + p % bs
                    for t, c in zip(tables, ctx, strict=True)
                    for p in range(c)
                ]
            )
        ],
        keys.float(),
    )
    return [
        "> 2^31 elements",
        "bfloat16",
        bs,
        f"{heads}/{kv_heads}",
        d,
        "auto",
        f"{err:.1e}",
        report.verdict(ok and stored_ok, "cache past 2^31 elements"),
    ]


# -- 2. and 3. greedy equality --------------------------------------------------


def _prompts(model_dir: str, count: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from .offline import make_prompts

    return make_prompts(AutoTokenizer.from_pretrained(model_dir), count)


def _hf_greedy(model_dir: str, dtype: torch.dtype, prompts: list[list[int]], new: int):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(DEVICE).eval()
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device=DEVICE)
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
            )  # stops after EOS, as the engine does without ignore_eos
            outs.append(out[0, len(p) :].tolist())
    del model
    _free_gpu()
    return outs


def _pagefleet_greedy(
    model_dir: str, dtype: str, prompts: list[list[int]], new: int, **kwargs: object
) -> tuple[list[list[int]], str]:
    from pagefleet.engine import LLM, SamplingParams

    llm = LLM(model=model_dir, dtype=dtype, device=DEVICE, max_model_len=1024, **kwargs)
    try:
        cap = llm.engine.capacity
        sizing = (
            f"{cap.num_kv_blocks} blocks, "
            f"{cap.num_kv_blocks * cap.kv_bytes_per_block / 2**30:.1f} GiB per rank"
        )
        params = SamplingParams(temperature=0, max_tokens=new)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        llm.check_block_accounting()
        return [list(o.outputs[0].token_ids) for o in outs], sizing
    finally:
        llm.close()
        del llm
        _free_gpu()


def _agreement(a: list[list[int]], b: list[list[int]]) -> tuple[int, str]:
    """(prompts equal, mean tokens agreed before the first difference)."""
    equal = sum(x == y for x, y in zip(a, b, strict=True))
    prefixes = []
    for x, y in zip(a, b, strict=True):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        prefixes.append(n)
    return equal, f"{sum(prefixes) / len(prefixes):.1f}"


def _equality(models: list[str]) -> Callable[[Report], str]:
    def run(report: Report) -> str:
        rows = []
        for model_dir in models:
            prompts = _prompts(model_dir, 8)
            name = Path(model_dir).name
            for dtype, exact in (("float32", True), ("bfloat16", False)):
                hf = _hf_greedy(model_dir, getattr(torch, dtype), prompts, _NEW_TOKENS_EQ)
                # The default CUDA KV sizing (from free GPU memory) on this run.
                ours, sizing = _pagefleet_greedy(model_dir, dtype, prompts, _NEW_TOKENS_EQ)
                equal, prefix = _agreement(hf, ours)
                verdict = (
                    report.verdict(equal == len(prompts), f"transformers equality {name} {dtype}")
                    if exact
                    else "reported"  # bf16: two implementations round differently
                )
                rows.append([name, dtype, f"{equal}/{len(prompts)}", prefix, sizing, verdict])
        return (
            f"Greedy, {_NEW_TOKENS_EQ} new tokens for each of 8 prompts; transformers "
            "`generate` on the GPU in the same dtype. fp32 must be equal token for token; "
            "bf16 agreement is reported only. The KV cache is the CUDA default (free GPU "
            "memory x gpu_memory_utilization).\n\n"
            + _table(
                [
                    "model",
                    "dtype",
                    "prompts equal",
                    "mean tokens agreed",
                    "KV cache",
                    "result",
                ],
                rows,
            )
        )

    return run


def _tensor_parallel(model_dir: str) -> Callable[[Report], str]:
    def run(report: Report) -> str:
        count = torch.cuda.device_count() if DEVICE == "cuda" else 1
        if count < 2:
            return f"**skipped**: TP=2 needs 2 GPUs; {count} visible."
        prompts = _prompts(model_dir, 8)
        kw = dict(gpu_memory_utilization=0.5)
        one, _ = _pagefleet_greedy(model_dir, "float32", prompts, _NEW_TOKENS_EQ, **kw)
        two, sizing = _pagefleet_greedy(
            model_dir, "float32", prompts, _NEW_TOKENS_EQ, tensor_parallel_size=2, **kw
        )
        equal, prefix = _agreement(one, two)
        verdict = report.verdict(equal == len(prompts), "TP=2 equals TP=1")
        return _table(
            [
                "model",
                "dtype",
                "TP",
                "prompts equal to TP=1",
                "mean tokens agreed",
                "KV cache",
                "result",
            ],
            [
                [
                    Path(model_dir).name,
                    "float32",
                    2,
                    f"{equal}/{len(prompts)}",
                    prefix,
                    sizing,
                    verdict,
                ]
            ],
        )

    return run


# -- 4. decode bandwidth --------------------------------------------------------


def peak_bandwidth(props: object, name: str) -> tuple[float | None, str]:
    """Peak memory bandwidth in bytes/s and where it came from."""
    clock_khz = getattr(props, "memory_clock_rate", 0) or 0
    bus_bits = getattr(props, "memory_bus_width", 0) or 0
    computed = 2 * clock_khz * 1e3 * bus_bits / 8  # double data rate, clock in kHz
    if 1e11 < computed < 2e13:  # a plausible GPU (else a unit we did not expect)
        return computed, "device properties (2 x memory clock x bus width)"
    for key, value in _PEAK_BANDWIDTH.items():  # the most specific names come first
        if key in name:
            return value, f"data sheet for {key}"
    return None, "unknown device"


def _copy_bandwidth() -> float:
    """Achieved device-to-device copy bandwidth (bytes read + written per second)."""
    x = torch.empty(1 << 30, dtype=torch.uint8, device=DEVICE)  # 1 GiB
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        y.copy_(x)
    end.record()
    torch.cuda.synchronize()
    return 2 * x.numel() * 20 / (start.elapsed_time(end) / 1000)


def _time_cuda(fn: Callable[[], object], iters: int = 50) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1000 / iters


def _decode_bandwidth(report: Report) -> str:
    from pagefleet.kernels import triton_attention

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    peak, source = peak_bandwidth(props, props.name)
    copy = _copy_bandwidth()
    rows = []
    heads, kv_heads, d, bs = 32, 8, 128, 16
    for batch, ctx in ((64, 2048), (256, 1024), (8, 8192)):
        blocks = batch * ctx // bs
        k = torch.randn(blocks, bs, kv_heads, d, device=DEVICE, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        tables = torch.randperm(blocks, device=DEVICE).to(torch.int32).view(batch, ctx // bs)
        lens = torch.full((batch,), ctx, device=DEVICE, dtype=torch.int32)
        q = torch.randn(batch, heads, d, device=DEVICE, dtype=torch.bfloat16)
        splits = triton_attention.decode_num_splits(batch, kv_heads, ctx, 32)

        def run(q=q, k=k, v=v, tables=tables, lens=lens) -> torch.Tensor:
            return triton_attention.paged_decode_attention(q, k, v, tables, lens, d**-0.5)

        seconds = _time_cuda(run)
        moved = 2 * batch * ctx * kv_heads * d * k.element_size()  # K and V, each read once
        rate = moved / seconds
        rows.append(
            [
                batch,
                ctx,
                f"{heads}/{kv_heads}",
                d,
                splits,
                f"{seconds * 1e6:.0f}",
                f"{rate / 1e12:.2f}",
                f"{100 * rate / peak:.0f}%" if peak else "-",
                f"{100 * rate / copy:.0f}%",
            ]
        )
        del k, v
        _free_gpu()
    peak_text = f"{peak / 1e12:.2f} TB/s ({source})" if peak else f"unknown ({source})"
    return (
        f"bf16 cache, block size 16, random block tables. Peak: {peak_text}; "
        f"device-to-device copy achieves {copy / 1e12:.2f} TB/s (read + write).\n\n"
        + _table(
            [
                "batch",
                "context",
                "heads/kv",
                "head dim",
                "splits",
                "us",
                "TB/s",
                "of peak",
                "of copy",
            ],
            rows,
        )
    )


# -- 5. offline throughput ------------------------------------------------------


def _offline(models: list[str], requests: int, new: int) -> Callable[[Report], str]:
    def run(report: Report) -> str:
        rows = []
        for model_dir in models:
            name = Path(model_dir).name
            prompts = _prompts(model_dir, requests)
            rows.append([name, "pagefleet LLM.generate", *_pagefleet_tput(model_dir, prompts, new)])
            try:
                rows.append(
                    [name, "transformers continuous batching", *_hf_tput(model_dir, prompts, new)]
                )
            except Exception as exc:  # the baseline's own trouble is reported, not fatal
                rows.append(
                    [name, "transformers continuous batching", "-", "-", f"error: {exc!r}"[:200]]
                )
            finally:
                _free_gpu()
        return (
            f"bf16, {requests} requests x {new} new tokens (EOS ignored), prompts of 5-11 "
            "tokens, greedy; both warmed up first.\n\n"
            + _table(["model", "system", "tokens", "seconds", "tok/s"], rows)
        )

    return run


def _pagefleet_tput(model_dir: str, prompts: list[list[int]], new: int) -> list[object]:
    from pagefleet.engine import LLM, SamplingParams

    llm = LLM(
        model=model_dir,
        dtype="bfloat16",
        device=DEVICE,
        max_num_seqs=len(prompts),
        max_model_len=512,
        gpu_memory_utilization=0.5,  # room for transformers afterwards in this process
    )
    try:
        params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
        batch = [{"prompt_token_ids": p} for p in prompts]
        llm.generate(batch, params, use_tqdm=False)  # warm-up: every kernel variant compiled
        _sync()
        start = time.perf_counter()
        outs = llm.generate(batch, params, use_tqdm=False)
        _sync()
        secs = time.perf_counter() - start
        llm.check_block_accounting()
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        return [tokens, f"{secs:.2f}", f"{tokens / secs:.0f}"]
    finally:
        llm.close()
        del llm
        _free_gpu()


def _hf_tput(model_dir: str, prompts: list[list[int]], new: int) -> list[object]:
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    model = model.to(DEVICE).eval()
    config = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    try:
        with torch.inference_mode():
            model.generate_batch(inputs=prompts[:16], generation_config=config, warmup=True)
            _sync()
            start = time.perf_counter()
            res = model.generate_batch(inputs=prompts, generation_config=config, warmup=False)
            _sync()
        secs = time.perf_counter() - start
        tokens = sum(len(r.generated_tokens) for r in res.values())
        return [tokens, f"{secs:.2f}", f"{tokens / secs:.0f}"]
    finally:
        del model
        _free_gpu()


# -- main -------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["models/smollm-135m", "models/llama-1b"])
    parser.add_argument("--tp-model", default="models/llama-1b", help="heads divisible by 2")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--out", default="benchmarks/results/gpu.md")
    parser.add_argument(
        "--skip", default="", help="comma-separated: kernels,equality,tp,bandwidth,offline"
    )
    parser.add_argument(
        "--dry-run-cpu",
        action="store_true",
        help="rehearse on the CPU (Triton interpreter): checks the script, measures nothing",
    )
    args = parser.parse_args()
    global DEVICE
    if args.dry_run_cpu:
        import os

        os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported
        DEVICE = "cpu"
        args.skip += ",bandwidth"
    elif not torch.cuda.is_available():
        print("no CUDA device: the GPU check needs one")
        return 2
    import transformers
    import triton

    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    started = time.perf_counter()
    report = Report()
    count = torch.cuda.device_count() if DEVICE == "cuda" else 0
    names = ", ".join(torch.cuda.get_device_name(i) for i in range(count)) or "none (dry run)"
    report.add(
        f"# GPU check\n\nCommand: `python -m pagefleet.cluster.bench.gpu_check "
        f"{shlex.join(sys.argv[1:])}` "
        f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})\n\n"
        f"GPUs ({count}): {names}; torch {torch.__version__} "
        f"(CUDA {torch.version.cuda}), triton {triton.__version__}, "
        f"transformers {transformers.__version__}"
    )
    sections: list[tuple[str, str, Callable[[Report], str]]] = [
        ("kernels", "1. Triton kernels vs the torch reference", _kernels),
        ("equality", "2. Greedy equality with transformers", _equality(args.models)),
        ("tp", "3. Tensor parallelism: TP=2 vs TP=1", _tensor_parallel(args.tp_model)),
        ("bandwidth", "4. Paged decode attention: memory bandwidth", _decode_bandwidth),
        (
            "offline",
            "5. Offline throughput",
            _offline(args.models, args.requests, args.new_tokens),
        ),
    ]
    for key, title, fn in sections:
        if key in skip:
            report.add(f"## {title}\n\nskipped (--skip {key})")
            continue
        report.section(title, fn)
    elapsed = time.perf_counter() - started
    summary = (
        "all checks passed" if not report.failures else "FAILED: " + "; ".join(report.failures)
    )
    report.add(f"## Summary\n\n{summary}. Total {elapsed / 60:.1f} min.")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n\n".join(report.parts) + "\n")
    print(f"wrote {args.out}")
    return 1 if report.failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
