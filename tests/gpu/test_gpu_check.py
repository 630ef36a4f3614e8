"""The GPU check's correctness half: what only a CUDA machine can tell (`pytest -m gpu`).

1. Kernels against the torch reference on the GPU: the KV store, and decode plus
   chunked prefill in one mixed step, for fp32 / fp16 / bf16, block sizes 1 to 128,
   MHA and GQA shapes, every decode split count; and one cache past 2^31 elements per
   layer (int64 offsets, for real).
2. Greedy equality with transformers on the GPU (fp32: tokens must be equal) for the
   SmolLM-135M and Llama-3.2-1B shaped checkpoints, with the KV cache sized from free
   GPU memory (the CUDA default); bf16 agreement is recorded, not asserted.
3. Tensor parallelism: TP=2 greedy tokens equal TP=1's (skipped below 2 GPUs).

Engines here run eagerly (tests/conftest.py sets PAGEFLEET_ENFORCE_EAGER=1) except
`test_equality_compiled_with_cuda_graphs`: the compiled forward with CUDA graphs for
decode batches (enforce_eager=False), whose fp32 tokens must equal transformers'.

Run them compiled: `TRITON_INTERPRET=0 pytest -m gpu tests/gpu` (tests/conftest.py
turns the interpreter on for the CPU kernel tests unless told otherwise).
`benchmarks/gpu_check.sh` runs them beside the measurements and writes
benchmarks/results/gpu.md from the rows they record (`record_property`). Skipped
without a CUDA device. The environment says:

- PAGEFLEET_GPU_CHECK_DEVICE=cpu: rehearse on the CPU (Triton's interpreter, the
  engine's torch path), as `python -m pagefleet_lab.bench.gpu_check --dry-run-cpu`
  does: it checks the plumbing, measures nothing.
- PAGEFLEET_GPU_MODELS: comma list of checkpoints for 2. (default
  models/smollm-135m,models/llama-1b); PAGEFLEET_GPU_TP_MODEL for 3. (default
  models/llama-1b: heads divisible by 2).
"""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.gpu

DEVICE = os.environ.get("PAGEFLEET_GPU_CHECK_DEVICE", "cuda")
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from pagefleet.kernels import (  # noqa: E402  (after the skip: no CUDA, no kernels)
    build_attention_metadata,
    store_kv_cache,
    triton_attention,
    triton_paged_attention,
)
from pagefleet.kernels.paged_attention import paged_attention as reference  # noqa: E402

MODELS = os.environ.get("PAGEFLEET_GPU_MODELS", "models/smollm-135m,models/llama-1b").split(",")
TP_MODEL = os.environ.get("PAGEFLEET_GPU_TP_MODEL", "models/llama-1b")
# Tolerances (atol = rtol) against the fp32 torch reference, by cache dtype.
TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
NEW_TOKENS = 32
PROMPTS = 8


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def free_gpu() -> None:
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


@pytest.fixture(autouse=True)
def _compiled_and_freed() -> Any:
    """The kernels compiled, never interpreted, on the GPU; its memory freed after each."""
    if DEVICE == "cuda" and os.environ.get("TRITON_INTERPRET") == "1":
        pytest.fail(
            "TRITON_INTERPRET=1 (tests/conftest.py's default for the CPU kernel tests): "
            "the GPU check needs compiled kernels; run `TRITON_INTERPRET=0 pytest -m gpu`"
        )
    yield
    free_gpu()


# -- 1. kernels --------------------------------------------------------------------


def _mixed_shapes(bs: int) -> list[tuple[int, int]]:
    """(query tokens, context) per sequence: decodes (1 token, block edges, long), then
    chunks with and without cached context (every chunk has >= 2 tokens: single-token
    sequences are decodes and come first)."""
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


_DECODES = [(1, c) for c in (1, 17, 250, 1000, 3000, 4097)]
# (what, dtype, block size, heads, kv heads, head dim, forced split count). Each compiles
# its own kernels (about 1 s each): a matrix sized to the GPU check's 8-minute budget.
KERNEL_CASES = [
    *(
        ("mixed step", dtype, 16, h, kv, d, None)
        for dtype in (torch.float32, torch.float16, torch.bfloat16)
        for h, kv, d in ((32, 8, 64), (9, 3, 64), (16, 16, 128))
    ),
    # below 16 (key tiles span blocks) and larger blocks
    *(("mixed step", torch.bfloat16, bs, 32, 8, 64, None) for bs in (1, 8, 32, 128)),
    *(("decode splits", torch.bfloat16, 16, 32, 8, 128, s) for s in triton_attention.SPLIT_BUCKETS),
]


def _case_id(case: tuple) -> str:
    what, dtype, bs, h, kv, d, splits = case
    return f"{what.split()[0]}-{_name(dtype)}-bs{bs}-{h}x{kv}-d{d}-splits{splits or 'auto'}"


@pytest.mark.parametrize("case", KERNEL_CASES, ids=_case_id)
def test_kernels_step_matches_the_reference(case: tuple, record_property: Any) -> None:
    """One step (decodes and chunks, or decodes with a forced split count) on the device
    against the fp32 torch reference on the CPU."""
    what, dtype, bs, heads, kv_heads, d, num_splits = case
    record_property("note", f"{_name(dtype)} {TOL[dtype]:g}")
    record_property(
        "row", [what, _name(dtype), bs, f"{heads}/{kv_heads}", d, num_splits or "auto", "-"]
    )
    g = torch.Generator().manual_seed(0)
    shapes = _DECODES if num_splits else _mixed_shapes(bs)
    q_lens, ctx = [q for q, _ in shapes], [c for _, c in shapes]
    num_blocks = sum(-(-c // bs) for c in ctx) + 16
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[free.pop() for _ in range(-(-c // bs))] for c in ctx]
    meta = build_attention_metadata(q_lens, ctx, tables, bs)  # with the padded layouts
    k = torch.randn(num_blocks, bs, kv_heads, d, generator=g).to(dtype)
    v = torch.randn(num_blocks, bs, kv_heads, d, generator=g).to(dtype)
    q = torch.randn(sum(q_lens), heads, d, generator=g).to(dtype)
    scale = d**-0.5
    ref = reference(q.float(), k.float(), v.float(), meta, scale)
    kc, vc, qc = k.to(DEVICE), v.to(DEVICE), q.to(DEVICE)
    dev_meta = build_attention_metadata(q_lens, ctx, tables, bs, padded=False).to(DEVICE)
    if num_splits is None:
        out = triton_paged_attention(qc, kc, vc, dev_meta, scale)
    else:
        out = triton_attention.paged_decode_attention(
            qc, kc, vc, dev_meta.block_tables, dev_meta.context_lens, scale, num_splits=num_splits
        )
    out = out.float().cpu()
    err = (out - ref).abs().max().item()
    record_property(
        "row",
        [what, _name(dtype), bs, f"{heads}/{kv_heads}", d, num_splits or "auto", f"{err:.1e}"],
    )
    assert out.isfinite().all()
    assert torch.allclose(out, ref, atol=TOL[dtype], rtol=TOL[dtype]), f"max abs err {err:.1e}"


# (dtype, block size, sliding window, logit soft-cap, sinks): Gemma 2's, Mistral's and
# gpt-oss's options.
WINDOW_CASES = [
    (dtype, bs, window, cap, sinks)
    for dtype in (torch.float32, torch.bfloat16)
    for bs, window, cap, sinks in (
        (16, 7, None, False),
        (16, 64, 50.0, False),
        (1, 300, None, False),
        (32, 4096, 30.0, False),
        (16, None, 5.0, False),
        (16, 128, None, True),
        (16, None, None, True),
    )
]


@pytest.mark.parametrize(
    "case", WINDOW_CASES, ids=lambda c: f"{_name(c[0])}-bs{c[1]}-w{c[2]}-cap{c[3]}-sinks{c[4]}"
)
def test_kernels_window_and_soft_cap_match_the_reference(case: tuple, record_property: Any) -> None:
    """A mixed step with a sliding window, soft-capping and/or sinks on the device against
    the fp32 torch reference; the blocks wholly before each window hold NaNs (never read)."""
    dtype, bs, window, cap, with_sinks = case
    heads, kv_heads, d = 8, 2, 128
    g = torch.Generator().manual_seed(1)
    shapes = _mixed_shapes(bs)
    q_lens, ctx = [q for q, _ in shapes], [c for _, c in shapes]
    num_blocks = sum(-(-c // bs) for c in ctx) + 16
    free = torch.randperm(num_blocks - 1, generator=g).tolist()
    tables = [[free.pop() for _ in range(-(-c // bs))] for c in ctx]
    k = torch.randn(num_blocks, bs, kv_heads, d, generator=g).to(dtype)
    v = torch.randn(num_blocks, bs, kv_heads, d, generator=g).to(dtype)
    q = torch.randn(sum(q_lens), heads, d, generator=g).to(dtype)
    scale = d**-0.5
    meta = build_attention_metadata(q_lens, ctx, tables, bs)
    sinks = torch.linspace(-2.0, 4.0, heads) if with_sinks else None
    ref = reference(q.float(), k.float(), v.float(), meta, scale, window, cap, sinks)
    if window is not None:
        k[-1] = v[-1] = float("nan")
        for (q_len, c), table in zip(shapes, tables, strict=True):
            for b in range(max(c - q_len - window + 1, 0) // bs):
                table[b] = num_blocks - 1
    dev_meta = build_attention_metadata(q_lens, ctx, tables, bs, padded=False).to(DEVICE)
    out = triton_paged_attention(
        q.to(DEVICE),
        k.to(DEVICE),
        v.to(DEVICE),
        dev_meta,
        scale,
        window,
        cap,
        None if sinks is None else sinks.to(DEVICE),
    )
    out = out.float().cpu()
    err = (out - ref).abs().max().item()
    record_property(
        "row",
        [
            f"window {window} cap {cap} sinks {with_sinks}",
            _name(dtype),
            bs,
            f"{heads}/{kv_heads}",
            d,
            "auto",
            f"{err:.1e}",
        ],
    )
    assert out.isfinite().all()
    assert torch.allclose(out, ref, atol=TOL[dtype], rtol=TOL[dtype]), f"max abs err {err:.1e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=_name)
def test_kernels_store_matches_index_copy(dtype: torch.dtype, record_property: Any) -> None:
    """The store kernel, bit for bit against index_copy_, from strided K/V (as the fused
    QKV projection gives them)."""
    k = torch.randn(64, 16, 8, 64, device=DEVICE).to(dtype)
    v = torch.randn_like(k)
    k_ref, v_ref = k.clone(), v.clone()
    qkv = torch.randn(40, 48, 64, device=DEVICE).to(dtype)
    key, value = qkv[:, 32:40], qkv[:, 40:48]
    slots = torch.randperm(64 * 16, device=DEVICE)[:40]
    triton_attention.store_kv_cache(key, value, k, v, slots)
    k_ref.view(-1, 8, 64).index_copy_(0, slots, key)
    v_ref.view(-1, 8, 64).index_copy_(0, slots, value)
    same = torch.equal(k, k_ref) and torch.equal(v, v_ref)
    record_property(
        "row", ["store", _name(dtype), 16, "-/8", 64, "-", "exact" if same else "differs"]
    )
    assert same


def test_kernels_cache_past_two_to_the_31_elements(record_property: Any) -> None:
    """A bf16 cache of more than 2^31 elements per layer (8.6 GiB for K and V), the
    sequences' blocks at its very top: offsets past 2^31 in the store and the step."""
    bs, kv_heads, heads, d = 16, 8, 32, 128
    row = ["> 2^31 elements", "bfloat16", bs, f"{heads}/{kv_heads}", d, "auto"]
    record_property("row", [*row, "-"])
    num_blocks = (1 << 31) // (bs * kv_heads * d) + 4096  # 135,168 blocks
    if DEVICE != "cuda":  # a CPU rehearsal takes the same steps on a small cache
        num_blocks = 128
    # Zeroed: the reference masks unused key slots with -inf, and 0 x NaN garbage would poison it.
    k_cache = torch.zeros(num_blocks, bs, kv_heads, d, device=DEVICE, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    shapes = [(1, 40), (1, 300), (20, 20), (17, 90)]
    q_lens, ctx = [q for q, _ in shapes], [c for _, c in shapes]
    top = list(range(num_blocks - 1, num_blocks - 64, -1))
    tables = [[top.pop(0) for _ in range(-(-c // bs))] for c in ctx]
    g = torch.Generator().manual_seed(5)
    keys = torch.randn(sum(ctx), kv_heads, d, generator=g).to(torch.bfloat16)
    values = torch.randn(sum(ctx), kv_heads, d, generator=g).to(torch.bfloat16)
    q = torch.randn(sum(q_lens), heads, d, generator=g).to(torch.bfloat16)
    # Every position of every sequence written by the store kernel (int64 slots).
    whole = build_attention_metadata(ctx, ctx, tables, bs, padded=False)
    store_kv_cache(
        keys.to(DEVICE), values.to(DEVICE), k_cache, v_cache, whole.slot_mapping.to(DEVICE)
    )
    meta = build_attention_metadata(q_lens, ctx, tables, bs, padded=False).to(DEVICE)
    out = triton_paged_attention(q.to(DEVICE), k_cache, v_cache, meta, d**-0.5).float().cpu()
    # The reference on a small cache holding the same blocks, renumbered 0..n-1.
    used = sorted({b for t in tables for b in t})
    index = {b: i for i, b in enumerate(used)}
    small_k, small_v = k_cache[used].float().cpu(), v_cache[used].float().cpu()
    del k_cache, v_cache
    small_tables = [[index[b] for b in t] for t in tables]
    small_meta = build_attention_metadata(q_lens, ctx, small_tables, bs)
    ref = reference(q.float(), small_k, small_v, small_meta, d**-0.5)
    err = (out - ref).abs().max().item()
    record_property("row", [*row, f"{err:.1e}"])
    # The store landed where index_copy_ puts it (reads agree with writes).
    positions = [
        index[t[p // bs]] * bs + p % bs for t, c in zip(tables, ctx, strict=True) for p in range(c)
    ]
    assert torch.equal(small_k.view(-1, kv_heads, d)[torch.tensor(positions)], keys.float())
    tol = TOL[torch.bfloat16]
    assert torch.allclose(out, ref, atol=tol, rtol=tol), f"max abs err {err:.1e}"


# -- 2. and 3. greedy equality -------------------------------------------------------


def _checkpoint(model_dir: str) -> str:
    if not (Path(model_dir) / "config.json").is_file():
        preset = Path(model_dir).name
        pytest.skip(
            f"no checkpoint at {model_dir} (`pagefleet make-model {model_dir} --preset {preset}`)"
        )
    return model_dir


def _prompts(model_dir: str, count: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from pagefleet.bench.offline import make_prompts

    return make_prompts(AutoTokenizer.from_pretrained(model_dir), count)


def _hf_greedy(model_dir: str, dtype: torch.dtype, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(DEVICE).eval()
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device=DEVICE)
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=0,
            )  # stops after EOS, as the engine does without ignore_eos
            outs.append(out[0, len(p) :].tolist())
    del model
    free_gpu()
    return outs


def _pagefleet_greedy(
    model_dir: str, dtype: str, prompts: list[list[int]], **kwargs: Any
) -> tuple[list[list[int]], str]:
    """(tokens per prompt, the KV cache's size) from LLM.generate on the device."""
    from pagefleet.engine import LLM, SamplingParams

    llm = LLM(model=model_dir, dtype=dtype, device=DEVICE, max_model_len=1024, **kwargs)
    try:
        cap = llm.engine.capacity
        sizing = (
            f"{cap.num_kv_blocks} blocks, "
            f"{cap.num_kv_blocks * cap.kv_bytes_per_block / 2**30:.1f} GiB per rank"
        )
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        llm.check_block_accounting()
        return [list(o.outputs[0].token_ids) for o in outs], sizing
    finally:
        llm.close()
        del llm
        free_gpu()


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[int, str]:
    """(prompts equal, mean tokens agreed before the first difference)."""
    equal = sum(x == y for x, y in zip(a, b, strict=True))
    prefixes = []
    for x, y in zip(a, b, strict=True):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        prefixes.append(n)
    return equal, f"{sum(prefixes) / len(prefixes):.1f}"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("model_dir", MODELS)
def test_equality_greedy_equals_transformers(
    model_dir: str, dtype: str, record_property: Any
) -> None:
    """fp32 must equal transformers token for token; bf16 agreement is recorded only (two
    implementations round differently). The KV cache is the CUDA default (free GPU memory
    x gpu_memory_utilization)."""
    record_property("note", f"{NEW_TOKENS} new tokens for each of {PROMPTS} prompts")
    prompts = _prompts(_checkpoint(model_dir), PROMPTS)
    hf = _hf_greedy(model_dir, getattr(torch, dtype), prompts)
    ours, sizing = _pagefleet_greedy(model_dir, dtype, prompts)
    equal, prefix = agreement(hf, ours)
    record_property("row", [Path(model_dir).name, dtype, f"{equal}/{len(prompts)}", prefix, sizing])
    if dtype != "float32":
        record_property("result", "reported")
        return
    assert equal == len(prompts), f"{equal}/{len(prompts)} prompts equal"


@pytest.mark.parametrize("model_dir", MODELS[:1])
def test_equality_compiled_with_cuda_graphs(model_dir: str, record_property: Any) -> None:
    """The compiled forward and its decode CUDA graphs (padded buckets, the scratch block)
    give transformers' fp32 tokens; prompts of several lengths make decode batches that
    fall between buckets."""
    record_property("note", f"{NEW_TOKENS} new tokens for each of {PROMPTS} prompts")
    prompts = _prompts(_checkpoint(model_dir), PROMPTS)
    hf = _hf_greedy(model_dir, torch.float32, prompts)
    ours, sizing = _pagefleet_greedy(
        model_dir, "float32", prompts, enforce_eager=False, max_num_seqs=PROMPTS + 3
    )
    equal, prefix = agreement(hf, ours)
    record_property(
        "row",
        [
            Path(model_dir).name,
            "float32, compiled + CUDA graphs",
            f"{equal}/{len(prompts)}",
            prefix,
            sizing,
        ],
    )
    assert equal == len(prompts), f"{equal}/{len(prompts)} prompts equal"


def test_tp_two_ranks_equal_one(record_property: Any) -> None:
    count = torch.cuda.device_count() if DEVICE == "cuda" else 1
    if count < 2:
        pytest.skip(f"TP=2 needs 2 GPUs; {count} visible")
    prompts = _prompts(_checkpoint(TP_MODEL), PROMPTS)
    kw: dict[str, Any] = {"gpu_memory_utilization": 0.5}
    one, _ = _pagefleet_greedy(TP_MODEL, "float32", prompts, **kw)
    two, sizing = _pagefleet_greedy(TP_MODEL, "float32", prompts, tensor_parallel_size=2, **kw)
    equal, prefix = agreement(one, two)
    record_property(
        "row", [Path(TP_MODEL).name, "float32", 2, f"{equal}/{len(prompts)}", prefix, sizing]
    )
    assert equal == len(prompts), f"{equal}/{len(prompts)} prompts equal to TP=1"
