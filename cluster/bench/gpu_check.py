"""The GPU check (`benchmarks/gpu_check.sh`): what only a CUDA machine can measure.

1. The Triton kernels against the torch reference, on the GPU, fp16 and bf16.
2. Paged decode attention alone: batch 64, context 2,048, 8 KV heads (32 query
   heads), head dim 128, bf16; achieved bandwidth as a share of the H200's
   ~4.8 TB/s.
3. Offline throughput of the engine in bf16 on the SmolLM-135M and Llama 3.2
   1B shapes.

Prints one markdown report; writes it to benchmarks/results/gpu_check.md.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

H200_BYTES_PER_S = 4.8e12


def _kernels_vs_reference() -> list[list[object]]:
    from pagefleet.kernels import build_attention_metadata, triton_paged_attention
    from pagefleet.kernels.paged_attention import paged_attention as reference

    rows = []
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float16, torch.bfloat16):
        for block_size in (16, 32):
            for heads, kv_heads, d in ((32, 8, 128), (9, 3, 64), (16, 16, 64)):
                shapes = [
                    (1, 1),
                    (1, block_size),
                    (1, 1000),
                    (7, 7),
                    (64, 300),
                    (block_size, 2 * block_size),
                ]
                q_lens, ctx = [q for q, _ in shapes], [c for _, c in shapes]
                free = torch.randperm(256, generator=g).tolist()
                tables = [[free.pop() for _ in range(-(-c // block_size))] for c in ctx]
                meta = build_attention_metadata(q_lens, ctx, tables, block_size)
                k = torch.randn(256, block_size, kv_heads, d, generator=g)
                v = torch.randn(256, block_size, kv_heads, d, generator=g)
                q = torch.randn(sum(q_lens), heads, d, generator=g)
                ref = reference(
                    q.to(dtype).float(), k.to(dtype).float(), v.to(dtype).float(), meta, d**-0.5
                )
                out = triton_paged_attention(
                    q.to("cuda", dtype),
                    k.to("cuda", dtype),
                    v.to("cuda", dtype),
                    meta.to("cuda"),
                    d**-0.5,
                )
                err = (out.float().cpu() - ref).abs().max().item()
                rows.append(
                    [
                        str(dtype).removeprefix("torch."),
                        block_size,
                        f"{heads}/{kv_heads}",
                        d,
                        f"{err:.2e}",
                        "ok" if err < 2e-2 else "FAIL",
                    ]
                )
    return rows


def _decode_bandwidth() -> list[object]:
    from pagefleet.kernels import triton_attention

    batch, ctx, kv_heads, heads, d, bs = 64, 2048, 8, 32, 128, 16
    blocks = batch * ctx // bs
    dtype = torch.bfloat16
    k = torch.randn(blocks, bs, kv_heads, d, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    tables = (
        torch.randperm(blocks, device="cuda", dtype=torch.int64)
        .to(torch.int32)
        .view(batch, ctx // bs)
    )
    lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    q = torch.randn(batch, heads, d, device="cuda", dtype=dtype)

    def run() -> torch.Tensor:
        return triton_attention.paged_decode_attention(q, k, v, tables, lens, d**-0.5)

    for _ in range(5):
        run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    iters = 50
    start.record()
    for _ in range(iters):
        run()
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1000 / iters
    moved = 2 * batch * ctx * kv_heads * d * k.element_size()  # K and V, read once
    rate = moved / seconds
    return [
        batch,
        ctx,
        f"{heads}/{kv_heads}",
        d,
        f"{seconds * 1e6:.0f}",
        f"{rate / 1e12:.2f}",
        f"{100 * rate / H200_BYTES_PER_S:.0f}%",
    ]


def _offline(model_dir: str, requests: int, new_tokens: int) -> list[object]:
    from pagefleet.engine import LLM, SamplingParams

    llm = LLM(
        model=model_dir,
        dtype="bfloat16",
        device="cuda",
        max_num_seqs=256,
        max_model_len=1024,
        kv_cache_memory_bytes=16 << 30,
    )
    g = torch.Generator().manual_seed(0)
    prompts = [
        {"prompt_token_ids": torch.randint(3, 30000, (16,), generator=g).tolist()}
        for _ in range(requests)
    ]
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompts[:8], SamplingParams(max_tokens=4), use_tqdm=False)
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    secs = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    llm.check_block_accounting()
    return [
        Path(model_dir).name,
        f"{requests}x{new_tokens}",
        tokens,
        f"{secs:.1f}",
        f"{tokens / secs:.0f}",
    ]


def main() -> int:
    from .report import markdown_table

    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="+", default=["models/smollm-135m", "models/llama-1b"])
    parser.add_argument("--out", default="benchmarks/results/gpu_check.md")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: the GPU check needs one")
        return 2
    parts = [f"# GPU check\n\nDevice: {torch.cuda.get_device_name()}\n"]
    parts.append(
        "## Triton kernels vs the torch reference\n\n"
        + markdown_table(
            ["dtype", "block", "heads/kv", "head dim", "max abs err", "result"],
            _kernels_vs_reference(),
        )
    )
    parts.append(
        "## Paged decode attention\n\n"
        + markdown_table(
            ["batch", "context", "heads/kv", "head dim", "us", "TB/s", "of 4.8 TB/s"],
            [_decode_bandwidth()],
        )
    )
    rows = [_offline(m, n, 128) for m in args.models for n in (64, 256)]
    parts.append(
        "## Offline throughput, bf16\n\n"
        + markdown_table(["model", "requests x new tokens", "tokens", "seconds", "tok/s"], rows)
    )
    text = "\n\n".join(parts) + "\n"
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
