"""AsyncLLMEngine: concurrent streams, cancellation frees blocks, bad requests don't stop the loop."""

from __future__ import annotations

import asyncio
import random

import pytest

from pagefleet.engine import AsyncLLMEngine, EngineConfig, SamplingParams


@pytest.fixture()
def engine(llama_dir: str) -> AsyncLLMEngine:
    return AsyncLLMEngine.from_config(
        EngineConfig(model=llama_dir, num_kv_blocks=48, block_size=8, max_num_seqs=16)
    )


def test_fifty_concurrent_streams_with_random_cancellation(engine: AsyncLLMEngine) -> None:
    rng = random.Random(0)
    texts = ["def f(x):", "import sys", "while True:", "class Base(object):", "return None"]

    async def consume(i: int, cancel_after: int | None) -> tuple[str, list[int], str] | None:
        params = SamplingParams(
            temperature=0.8, seed=i, max_tokens=rng.randint(4, 24), ignore_eos=True
        )
        ids: list[int] = []
        text = ""
        async for out in engine.generate(texts[i % len(texts)], params, f"req-{i}"):
            comp = out.outputs[0]
            ids += comp.new_token_ids
            text += comp.new_text
            if cancel_after is not None and len(ids) >= cancel_after:
                return None  # leaving the loop early aborts the request
            if out.finished:
                assert ids == comp.token_ids and text == comp.text
                return comp.finish_reason, ids, text
        raise AssertionError("stream ended without a finished output")

    async def main() -> None:
        tasks = []
        for i in range(50):
            cancel = rng.choice([None, None, 1, 3])
            tasks.append(asyncio.create_task(consume(i, cancel)))
        # Some are cancelled from outside while they wait or stream.
        await asyncio.sleep(0.05)
        for t in rng.sample(tasks, 10):
            t.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        finished = [r for r in results if isinstance(r, tuple)]
        assert finished and all(r[0] == "length" for r in finished)
        assert any(isinstance(r, asyncio.CancelledError) for r in results)
        await engine.wait_idle()
        stats = engine.stats()
        assert stats.num_free_blocks == stats.num_total_blocks
        assert stats.num_running == stats.num_waiting == 0
        engine.engine.check_block_accounting()
        await engine.shutdown()

    asyncio.run(main())


def test_bad_request_fails_alone(engine: AsyncLLMEngine) -> None:
    async def good() -> list[int]:
        last = None
        async for out in engine.generate(
            "import os", SamplingParams(temperature=0, max_tokens=6), "good"
        ):
            last = out
        return last.outputs[0].token_ids

    async def bad() -> None:
        async for _ in engine.generate({"prompt_token_ids": [10**6]}, SamplingParams(), "bad"):
            pass

    async def main() -> None:
        results = await asyncio.gather(good(), bad(), return_exceptions=True)
        assert len(results[0]) == 6
        assert isinstance(results[1], ValueError) and "integers in" in str(results[1])
        # The loop is still alive.
        again = [o async for o in engine.generate("x = 1", SamplingParams(max_tokens=2), "after")]
        assert again[-1].finished
        await engine.wait_idle()
        engine.engine.check_block_accounting()
        await engine.shutdown()

    asyncio.run(main())


def test_streamed_deltas_hold_back_a_possible_stop_string(engine: AsyncLLMEngine) -> None:
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    async def collect(p: SamplingParams, rid: str) -> tuple[list[str], str, str | None]:
        pieces, final = [], None
        async for out in engine.generate("class Node:", p, rid):
            pieces.append(out.outputs[0].new_text)
            final = out
        return pieces, final.outputs[0].text, final.outputs[0].finish_reason

    async def main() -> None:
        _, full, _ = await collect(params, "plain")
        stop = full[6:9]
        pieces, text, reason = await collect(
            SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]), "stopped"
        )
        assert reason == "stop" and text == full[: full.index(stop)]
        # Nothing streamed ever went past the cut: the deltas join to exactly the final text.
        assert "".join(pieces) == text
        await engine.shutdown()

    asyncio.run(main())
