"""`pagefleet-lab core-message`: what the engine core's per-step message costs.

Each engine step the core tells its caller what moved (`CoreEvents`, its outputs the
requests' `RequestOutputDelta`s), across a pipe when the core runs in a process of its
own (every server replica). This times that message on the real output side, with no
model: for each load `RxPxG[xL]` (R running requests with prompts of P tokens that have
generated G tokens each, with L logprobs per token), R `RequestState`s of the tiny
model's tokenizer are brought to G tokens, untimed; then `--steps` steps give each
request one more token and are timed one by one: the output side's update (the
detokenizer, stop strings, the delta), the encoding the core sends, and the decoding
the replica's reader does. The message's bytes are reported too: they must not grow
with P or G (the engine sends news only).
"""

from __future__ import annotations

import argparse
import random
import time

from pagefleet.bench.checkpoint import ensure_model
from pagefleet.bench.machine import machine_description
from pagefleet.bench.report import markdown_table, pyplot, save_png, write_report
from pagefleet.bench.stats import percentile
from pagefleet.engine import SamplingParams
from pagefleet.engine.core_messages import CoreEvents, decode_events, encode_events
from pagefleet.engine.handoffs import EngineRequest, RequestUpdate, SampleUpdate
from pagefleet.engine.request_state import RequestState


def parse_load(text: str) -> tuple[int, int, int, int]:
    """'64x8192x500' or '32x4096x4096x20' -> (requests, prompt tokens, generated, logprobs)."""
    parts = [int(p) for p in text.lower().split("x")]
    if len(parts) not in (3, 4) or min(parts) < 0 or parts[0] < 1:
        raise argparse.ArgumentTypeError(f"a load is RxPxG or RxPxGxL, not {text!r}")
    return (parts[0], parts[1], parts[2], parts[3] if len(parts) == 4 else 0)


def measure(
    tokenizer: object, load: tuple[int, int, int, int], steps: int, seed: int = 0
) -> dict[str, float]:
    """Per-step medians (ms) of update / encode / decode and the message's bytes."""
    requests, prompt_len, generated, k = load
    rng = random.Random(seed)
    vocab = 1000  # ordinary tokens of the tiny tokenizer: they decode to text
    params = SamplingParams(max_tokens=generated + steps + 1, logprobs=k or None)
    states = [
        RequestState(
            EngineRequest(
                f"r{i}", None, [rng.randrange(3, vocab) for _ in range(prompt_len)], params, 0.0
            ),
            tokenizer,  # type: ignore[arg-type]
        )
        for i in range(requests)
    ]

    def one_step(when: float, draw: random.Random) -> list:
        outs = []
        for s in states:
            t = draw.randrange(3, vocab)
            lps = {t + j: -0.5 - j for j in range(k + 1)} if k else None
            u = RequestUpdate(s.request.request_id, [SampleUpdate(0, t, lps, -0.5, None, None)], [])
            outs.append(s.update(u, when, []))
        return outs

    for g in range(generated):
        one_step(float(g), rng)
    # The timed steps draw the same tokens whatever the load: their news is alike.
    news = random.Random(seed + 1)
    update_ms, encode_ms, decode_ms, sizes = [], [], [], []
    for i in range(steps):
        t0 = time.perf_counter()
        outs = one_step(float(generated + i), news)
        t1 = time.perf_counter()
        data = encode_events(CoreEvents(outputs=outs))
        t2 = time.perf_counter()
        decode_events(data)
        t3 = time.perf_counter()
        update_ms.append((t1 - t0) * 1e3)
        encode_ms.append((t2 - t1) * 1e3)
        decode_ms.append((t3 - t2) * 1e3)
        sizes.append(len(data))
    return {
        "update_ms": percentile(update_ms, 0.5),
        "encode_ms": percentile(encode_ms, 0.5),
        "decode_ms": percentile(decode_ms, 0.5),
        "bytes": float(max(sizes)),
    }


def run(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    path, _ = ensure_model(args.model, "tiny")
    tokenizer = AutoTokenizer.from_pretrained(path)
    rows, results = [], []
    for load in args.loads:
        r, p, g, k = load
        print(
            f"core message: {r} requests x {p}-token prompts x {g} generated, logprobs {k} ...",
            flush=True,
        )
        m = measure(tokenizer, load, args.steps)
        results.append((load, m))
        message = m["encode_ms"] + m["decode_ms"]
        rows.append(
            [
                r,
                p,
                g,
                k,
                f"{m['bytes']:,.0f}",
                f"{m['encode_ms']:.3f}",
                f"{m['decode_ms']:.3f}",
                f"{message:.3f}",
                f"{m['update_ms']:.2f}",
            ]
        )
    table = markdown_table(
        [
            "requests",
            "prompt tokens",
            "generated",
            "logprobs",
            "message bytes",
            "encode ms",
            "decode ms",
            "message ms (both)",
            "output side ms (update)",
        ],
        rows,
    )
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels = [f"{r}x{p}x{g}" + (f"x{k}" if k else "") for (r, p, g, k), _ in results]
    ax.bar(
        labels,
        [m["encode_ms"] + m["decode_ms"] for _, m in results],
        label="message (encode + decode)",
    )
    ax.set_ylabel("ms per step (median)")
    ax.set_title("The engine core's per-step message")
    ax.legend()
    save_png(fig, args.out, 120)
    body = (
        f"{machine_description()}\n\nMedians over {args.steps} steps. The message holds only "
        "each request's news (a token, its text, its logprobs): its bytes do not depend on "
        "prompt length or tokens generated.\n\n" + table
    )
    print(write_report(args.out, "The engine core's per-step message", body))
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("core-message", help="the engine core's per-step message: bytes and ms")
    p.add_argument("--model", default="models/tiny", help="its tokenizer (created if missing)")
    p.add_argument(
        "--loads",
        type=lambda s: [parse_load(x) for x in s.split(",")],
        default=[parse_load(x) for x in ("64x8192x500", "64x32768x1000", "32x4096x4096x20")],
        help="comma list of REQUESTSxPROMPTxGENERATED[xLOGPROBS]",
    )
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", default="benchmarks/results/core_message")
