"""The GPU check (`benchmarks/gpu_check.sh`): everything only a CUDA machine can tell us, in one run.

1.-3. The correctness checks are tests, `tests/gpu/test_gpu_check.py` (`pytest -m gpu`):
   kernels against the torch reference, greedy equality with transformers, TP=2
   against TP=1. This runs them (in this process) and reports each one's row.
4. The paged decode kernel alone: achieved bandwidth as a share of the GPU's
   peak memory bandwidth and of a measured device-to-device copy.
5. Offline throughput, bf16: 256 requests x 128 new tokens, pagefleet
   `LLM.generate` beside transformers' continuous batching (`generate_batch`)
   on the same GPU.

Every section runs even when an earlier one fails (its error goes into the
report); the exit status is 1 if any check failed. Writes a markdown report
(benchmarks/results/gpu.md by default) and prints it. On one H200: sections
1-4 in 1.6-1.9 min, section 5 about 1 min per model, writing both models 30-50 s.
"""

from __future__ import annotations

import argparse
import gc
import os
import shlex
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from pagefleet.bench.report import markdown_table, write_report
from pagefleet_lab.bench.checks import CheckResult, run_checks

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
# "cuda" for the check; `--dry-run-cpu` sets "cpu" to rehearse the script's own
# plumbing on a machine without a GPU (Triton in its interpreter, the engine on
# its torch path, no timings that mean anything).
DEVICE = "cuda"

# The tests' sections: (key for --skip, title, test-name prefix, intro, table header). The
# intro's {notes}: what the section's tests recorded as "note" (their settings).
CHECKS = [
    (
        "kernels",
        "1. Triton kernels vs the torch reference",
        "test_kernels_",
        "Tolerances (atol = rtol) against the fp32 torch reference: {notes}.",
        ["kernel", "dtype", "block", "heads/kv", "head dim", "splits", "max abs err"],
    ),
    (
        "equality",
        "2. Greedy equality with transformers",
        "test_equality_",
        "Greedy, {notes}; transformers `generate` on the GPU "
        "in the same dtype. fp32 must be equal token for token; bf16 agreement is "
        "reported only. The KV cache is the CUDA default (free GPU memory x "
        "gpu_memory_utilization).",
        ["model", "dtype", "prompts equal", "mean tokens agreed", "KV cache"],
    ),
    (
        "tp",
        "3. Tensor parallelism: TP=2 vs TP=1",
        "test_tp_",
        "",
        ["model", "dtype", "TP", "prompts equal to TP=1", "mean tokens agreed", "KV cache"],
    ),
]


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _free_gpu() -> None:
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


class Report:
    """Markdown sections, with every failed check named."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.failures: list[str] = []

    def add(self, text: str) -> None:
        self.parts.append(text)
        print(text + "\n", flush=True)

    def section(self, title: str, fn: Callable[[], str]) -> None:
        """Run one measured section; its failure is reported, not raised."""
        start = time.perf_counter()
        try:
            body = fn()
        except Exception:
            self.failures.append(title)
            body = "**ERROR**\n\n```\n" + traceback.format_exc()[-3000:] + "```"
        finally:
            _free_gpu()
        self.add(f"## {title}\n\n{body}\n\n({time.perf_counter() - start:.0f} s)")


def check_section(
    report: Report, title: str, intro: str, header: list[str], results: list[CheckResult]
) -> None:
    """One section of test outcomes: a row per test that recorded one, its verdict last."""
    rows = [[*r.properties["row"], r.verdict] for r in results if "row" in r.properties]
    report.failures += [f"{title}: {r.name}" for r in results if r.outcome == "failed"]
    problems = [
        f"- `{r.name}`: {r.verdict}" + (f" ({r.message})" if r.message else "")
        for r in results
        if r.outcome != "passed"
    ]
    settings = dict.fromkeys(str(r.properties["note"]) for r in results if "note" in r.properties)
    parts = [intro.format(notes=", ".join(settings) or "-")] if intro else []
    if rows:
        parts.append(markdown_table([*header, "result"], rows))
    if problems:
        parts.append("\n".join(problems))
    report.add(f"## {title}\n\n" + ("\n\n".join(parts) or "no test ran"))


def run_gpu_tests(args: argparse.Namespace, skip: set[str]) -> list[CheckResult]:
    """`pytest -m gpu tests/gpu` in this process, the sections in `skip` left out."""
    env = {
        "PAGEFLEET_GPU_CHECK_DEVICE": DEVICE,
        "PAGEFLEET_GPU_MODELS": ",".join(args.models),
        "PAGEFLEET_GPU_TP_MODEL": args.tp_model,
        # Compiled kernels on a GPU (tests/conftest.py would turn the interpreter on).
        "TRITON_INTERPRET": "1" if DEVICE == "cpu" else "0",
    }
    prefixes = [prefix for key, _, prefix, _, _ in CHECKS if key in skip]
    extra = ["-k", " and ".join(f"not {p}" for p in prefixes)] if prefixes else []
    extra += ["-v", "--durations=15"]  # each test's name as it ends, and where the time went
    threads = torch.get_num_threads()
    _, results = run_checks("tests/gpu", "gpu", env, extra)
    torch.set_num_threads(threads)  # tests/conftest.py sets 2 for the CPU tests
    return results


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


def _decode_bandwidth() -> str:
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
        splits = triton_attention.decode_num_splits(
            batch, kv_heads, ctx, triton_attention.DECODE_BLOCK_N
        )

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
        + markdown_table(
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


def _offline(models: list[str], requests: int, new: int) -> Callable[[], str]:
    def run() -> str:
        rows = []
        for model_dir in models:
            name = Path(model_dir).name
            prompts = _prompts(model_dir, requests)
            for eager, system in (
                (False, "pagefleet LLM.generate (compiled + CUDA graphs)"),
                (True, "pagefleet LLM.generate (enforce_eager)"),
            ):
                rows.append([name, system, *_pagefleet_tput(model_dir, prompts, new, eager)])
            try:
                rows.append(
                    [name, "transformers continuous batching", *_hf_tput(model_dir, prompts, new)]
                )
            except Exception as exc:  # the baseline's own trouble is reported, not fatal
                rows.append(
                    [
                        name,
                        "transformers continuous batching",
                        "-",
                        "-",
                        "-",
                        f"error: {exc!r}"[:200],
                    ]
                )
            finally:
                _free_gpu()
        return (
            f"bf16, {requests} requests x {new} new tokens (EOS ignored), prompts of 5-11 "
            "tokens, greedy; both warmed up first. Start-up: construction to ready (loading, "
            "KV sizing, and for the compiled engine compilation and CUDA graph capture; "
            "transformers: loading).\n\n"
            + markdown_table(["model", "system", "start-up s", "tokens", "seconds", "tok/s"], rows)
        )

    return run


def _pagefleet_tput(
    model_dir: str, prompts: list[list[int]], new: int, enforce_eager: bool
) -> list[object]:
    from pagefleet.engine import LLM, SamplingParams

    built = time.perf_counter()
    llm = LLM(
        model=model_dir,
        dtype="bfloat16",
        device=DEVICE,
        max_num_seqs=len(prompts),
        max_model_len=512,
        gpu_memory_utilization=0.5,  # room for transformers afterwards in this process
        enforce_eager=enforce_eager,  # explicit: the tests run here default to eager
    )
    startup = time.perf_counter() - built  # loading, KV sizing, compilation, graph capture
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
        return [f"{startup:.1f}", tokens, f"{secs:.2f}", f"{tokens / secs:.0f}"]
    finally:
        llm.close()
        del llm
        _free_gpu()


def _hf_tput(model_dir: str, prompts: list[list[int]], new: int) -> list[object]:
    from transformers import AutoModelForCausalLM, GenerationConfig

    built = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    model = model.to(DEVICE).eval()
    startup = time.perf_counter() - built
    config = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    try:
        # no_grad, not inference_mode: transformers 5.17's continuous batching resets its
        # static buffers in place from its own thread, which inference tensors refuse.
        with torch.no_grad():
            model.generate_batch(inputs=prompts[:16], generation_config=config, warmup=True)
            _sync()
            start = time.perf_counter()
            res = model.generate_batch(inputs=prompts, generation_config=config, warmup=False)
            _sync()
        secs = time.perf_counter() - start
        tokens = sum(len(r.generated_tokens) for r in res.values())
        return [f"{startup:.1f}", tokens, f"{secs:.2f}", f"{tokens / secs:.0f}"]
    finally:
        del model
        _free_gpu()


def _prompts(model_dir: str, count: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from pagefleet.bench.offline import make_prompts

    return make_prompts(AutoTokenizer.from_pretrained(model_dir), count)


# -- main -------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
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
    return parser


def main() -> int:
    args = _parser().parse_args()
    global DEVICE
    if args.dry_run_cpu:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported
        DEVICE = "cpu"
        args.skip += ",bandwidth"
    elif not torch.cuda.is_available():
        print("no CUDA device: the GPU check needs one")
        return 2
    else:
        os.environ["TRITON_INTERPRET"] = "0"  # compiled kernels
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    started = time.perf_counter()
    report = Report()
    results = run_gpu_tests(args, skip)
    import transformers
    import triton

    count = torch.cuda.device_count() if DEVICE == "cuda" else 0
    names = ", ".join(torch.cuda.get_device_name(i) for i in range(count)) or "none (dry run)"
    report.add(
        f"GPUs ({count}): {names}; torch {torch.__version__} (CUDA {torch.version.cuda}), "
        f"triton {triton.__version__}, transformers {transformers.__version__}"
    )
    for key, title, prefix, intro, header in CHECKS:
        if key in skip:
            report.add(f"## {title}\n\nskipped (--skip {key})")
            continue
        mine = [r for r in results if r.name.startswith(prefix)]
        # A module skipped or broken whole (no CUDA, an import error) counts in every section.
        whole = [r for r in results if "::" not in r.nodeid]
        check_section(report, title, intro, header, mine or whole)
    measured: list[tuple[str, str, Callable[[], str]]] = [
        ("bandwidth", "4. Paged decode attention: memory bandwidth", _decode_bandwidth),
        ("offline", "5. Offline throughput", _offline(args.models, args.requests, args.new_tokens)),
    ]
    for key, title, fn in measured:
        if key in skip:
            report.add(f"## {title}\n\nskipped (--skip {key})")
            continue
        report.section(title, fn)
    elapsed = time.perf_counter() - started
    summary = (
        "all checks passed" if not report.failures else "FAILED: " + "; ".join(report.failures)
    )
    report.add(f"## Summary\n\n{summary}. Total {elapsed / 60:.1f} min.")
    command = f"python -m pagefleet_lab.bench.gpu_check {shlex.join(sys.argv[1:])}"
    path = write_report(args.out, "GPU check", "\n\n".join(report.parts), command)
    print(f"wrote {path}")
    return 1 if report.failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
