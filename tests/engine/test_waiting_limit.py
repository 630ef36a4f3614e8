"""The engine's admission bound (`max_waiting_requests`): exact, in requests never scheduled,
rejected alone through the async engine, and announced admission before any output."""

from __future__ import annotations

import asyncio

import pytest

from pagefleet.engine import AsyncLLMEngine, EngineConfig, LLMEngine, SamplingParams
from pagefleet.engine.async_engine import Admitted
from pagefleet.engine.errors import EngineOverloadedError

PARAMS = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0)


def config(llama_dir: str, **kw: object) -> EngineConfig:
    return EngineConfig(model=llama_dir, num_kv_blocks=48, block_size=8, max_num_seqs=1, **kw)


def test_waiting_limit_counts_requests_not_yet_scheduled(llama_dir: str) -> None:
    engine = LLMEngine(config(llama_dir, max_waiting_requests=2))
    engine.add_request("a", "import os", PARAMS)
    engine.add_request("b", "import os", PARAMS)
    with pytest.raises(EngineOverloadedError, match=r"^the engine queue is full \(2 requests"):
        engine.add_request("c", "import os", PARAMS)
    assert engine.get_num_unfinished_requests() == 2  # nothing of "c" was queued
    engine.step()  # "a" is scheduled (max_num_seqs 1): one waits, so one more fits
    engine.add_request("c", "import os", PARAMS)
    with pytest.raises(EngineOverloadedError):
        engine.add_request("d", "import os", PARAMS)
    engine.abort_request("b")  # an aborted request frees its place at once
    engine.add_request("d", "import os", PARAMS)
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_block_accounting()
    # Bad input is a ValueError even when the queue is full: the caller's fault comes first.
    full = LLMEngine(config(llama_dir, max_waiting_requests=0))
    with pytest.raises(ValueError, match="stop_token_ids must be < vocab size"):
        full.add_request("x", "import os", SamplingParams(stop_token_ids=[10**6]))
    with pytest.raises(EngineOverloadedError):
        full.add_request("x", "import os", PARAMS)


def test_negative_limit_is_refused(llama_dir: str) -> None:
    with pytest.raises(ValueError, match="max_waiting_requests must be >= 0, got -1"):
        config(llama_dir, max_waiting_requests=-1)


def test_async_engine_announces_admission_and_rejects_alone(llama_dir: str) -> None:
    engine = AsyncLLMEngine.from_config(config(llama_dir, max_waiting_requests=1))
    long = SamplingParams(max_tokens=300, ignore_eos=True, temperature=0)

    async def main() -> None:
        running = engine.generate("while True:", long, "run", announce_admission=True)
        assert await anext(running) == Admitted("run")
        first = await anext(running)  # its first token: it holds the one batch slot
        assert first.outputs[0].token_ids
        waiting = engine.generate("x", PARAMS, "wait", announce_admission=True)
        assert await anext(waiting) == Admitted("wait")
        refused = engine.generate("x", PARAMS, "refused", announce_admission=True)
        with pytest.raises(EngineOverloadedError):
            await anext(refused)
        await running.aclose()  # the slot frees, the waiting one runs to its end
        outs = [o async for o in waiting]
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 4
        # Without announce_admission, generate yields outputs only (as before).
        plain = [o async for o in engine.generate("x", PARAMS, "plain")]
        assert all(not isinstance(o, Admitted) for o in plain) and plain[-1].finished
        await engine.wait_idle()
        await engine.check_block_accounting()
        await engine.shutdown()

    asyncio.run(main())
