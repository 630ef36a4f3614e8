"""The paged decode kernel's tile settings on a GPU: keys per tile, warps, pipeline stages.

For each setting and each shape of the GPU check's bandwidth section (bf16 cache, block
size 16, 32 query / 8 KV heads of 128, random block tables), it checks the output
against attention computed by torch on the gathered K/V of a few sequences (fresh
random inputs, output poisoned first), then times the kernel with CUDA events and
reports the achieved bandwidth (K and V each read once) as a share of a measured
device-to-device copy. Writes a markdown table (`--out`) and prints it.

    TRITON_INTERPRET=0 python benchmarks/decode_kernel_tune.py --out decode_tune.md
"""

from __future__ import annotations

import argparse
import functools
import itertools
import time

import torch

from pagefleet.bench.report import markdown_table
from pagefleet.kernels import triton_attention
from pagefleet_lab.bench.gpu_check import _copy_bandwidth, _time_cuda

SHAPES = ((64, 2048), (256, 1024), (8, 8192), (32, 512))  # (batch, context)
HEADS, KV_HEADS, D, BS = 32, 8, 128, 16


def gathered_reference(q, k, v, tables, ctx: int, seqs: list[int], scale: float):
    """Attention for `seqs` from their K/V rows gathered through the block table, fp32."""
    outs = []
    group = HEADS // KV_HEADS
    for s in seqs:
        blocks = tables[s, : -(-ctx // BS)].long()
        keys = k[blocks].reshape(-1, KV_HEADS, D)[:ctx].float()  # [ctx, kv, d]
        values = v[blocks].reshape(-1, KV_HEADS, D)[:ctx].float()
        keys = keys.repeat_interleave(group, dim=1)  # [ctx, heads, d]
        values = values.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,chd->hc", q[s].float(), keys) * scale
        outs.append(torch.einsum("hc,chd->hd", scores.softmax(-1), values))
    return torch.stack(outs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="benchmarks/results/decode_kernel_tune.md")
    args = parser.parse_args()
    torch.manual_seed(0)
    copy = _copy_bandwidth()
    settings = list(itertools.product((32, 64, 128), (4, 8), (2, 3)))
    rows, best = [], {}
    for batch, ctx in SHAPES:
        blocks = batch * ctx // BS
        k = torch.randn(blocks, BS, KV_HEADS, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        tables = torch.randperm(blocks, device="cuda").to(torch.int32).view(batch, ctx // BS)
        lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
        q = torch.randn(batch, HEADS, D, device="cuda", dtype=torch.bfloat16)
        scale = D**-0.5
        seqs = [0, batch // 2, batch - 1]
        ref = gathered_reference(q, k, v, tables, ctx, seqs, scale)
        moved = 2 * batch * ctx * KV_HEADS * D * k.element_size()
        for block_n, warps, stages in settings:
            kw = dict(block_n=block_n, num_warps=warps, num_stages=stages)
            out = torch.full_like(q, float("nan"))
            try:
                triton_attention.paged_decode_attention(q, k, v, tables, lens, scale, out=out, **kw)
                err = (out[seqs].float() - ref).abs().max().item()
                ok = bool(out.isfinite().all()) and err < 3e-2
                run = functools.partial(
                    triton_attention.paged_decode_attention, q, k, v, tables, lens, scale, **kw
                )
                seconds = _time_cuda(run)
            except Exception as exc:  # a setting that does not compile is a row, not an end
                rows.append([batch, ctx, block_n, warps, stages, "-", "-", "-", repr(exc)[:80]])
                continue
            rate = moved / seconds
            rows.append(
                [
                    batch,
                    ctx,
                    block_n,
                    warps,
                    stages,
                    f"{err:.1e}",
                    f"{seconds * 1e6:.0f}",
                    f"{rate / 1e12:.2f}",
                    f"{100 * rate / copy:.0f}%" + ("" if ok else " WRONG"),
                ]
            )
            if ok and rate > best.get((batch, ctx), (0.0, None))[0]:
                best[(batch, ctx)] = (rate, (block_n, warps, stages))
        del k, v
        torch.cuda.empty_cache()
    table = markdown_table(
        ["batch", "context", "BLOCK_N", "warps", "stages", "max err", "us", "TB/s", "of copy"],
        rows,
    )
    best_text = "\n".join(
        f"- batch {b}, context {c}: {r / 1e12:.2f} TB/s with (BLOCK_N, warps, stages) = {s}"
        for (b, c), (r, s) in best.items()
    )
    default = (triton_attention.DECODE_BLOCK_N, 4, 2)
    text = (
        f"# Paged decode kernel: tile settings on {torch.cuda.get_device_name()}\n\n"
        f"Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; torch {torch.__version__}. "
        f"bf16 cache, block size 16, {HEADS}/{KV_HEADS} heads of {D}; device-to-device copy "
        f"{copy / 1e12:.2f} TB/s (read + write). The default is {default}.\n\n"
        f"{table}\n\nBest per shape:\n\n{best_text}\n"
    )
    with open(args.out, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
