"""Tensor parallelism over gloo on CPU: same greedy tokens as one process; clean worker lifecycle."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from pagefleet.cluster.make_model import make_model
from pagefleet.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from pagefleet.engine.model_runner import StepInputs
from pagefleet.engine.workers import LocalProcessExecutor
from tests.conftest import prompt_ids


def greedy(path: str, tp: int, prompts: list[list[int]]) -> list[list[int]]:
    with LLM(model=path, tensor_parallel_size=tp, num_kv_blocks=128, block_size=8) as llm:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0, max_tokens=16),
            use_tqdm=False,
        )
        llm.check_block_accounting()
        executor = llm.engine.token_engine.executor
        workers = [] if executor is None else list(executor.processes)
    assert all(not w.is_alive() for w in workers)  # closed with the engine
    assert not spawned_workers()
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("which", ["llama_dir", "qwen2_dir"])
def test_two_ranks_match_one(request: pytest.FixtureRequest, which: str) -> None:
    path = request.getfixturevalue(which)
    prompts = prompt_ids(path)
    assert greedy(path, 2, prompts) == greedy(path, 1, prompts)


def test_engine_runs_its_ranks_through_the_executor_factory(llama_dir: str) -> None:
    made: list[tuple[RecordingExecutor, list[int]]] = []

    class RecordingExecutor(LocalProcessExecutor):
        def __init__(self, config: EngineConfig) -> None:
            super().__init__(config)
            self.sent = 0
            # The rendezvous port is bound by this process (no other could take it) and
            # listening before any worker connects.
            listening = [
                c.laddr.port
                for c in psutil.Process().net_connections("tcp")
                if c.status == psutil.CONN_LISTEN
            ]
            made.append((self, listening))

        def send(self, inputs: StepInputs) -> None:
            self.sent += 1
            super().send(inputs)

    prompt = prompt_ids(llama_dir)[2]
    config = EngineConfig(model=llama_dir, num_kv_blocks=32, block_size=8)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    def run(engine: LLMEngine) -> tuple[list[int], int]:
        engine.add_request("r", {"prompt_token_ids": prompt}, params)
        steps, last = 0, None
        while engine.has_unfinished_requests():
            outs = engine.step()
            steps += 1
            last = outs[-1] if outs else last
        engine.check_block_accounting()
        engine.close()
        return last.outputs[0].token_ids, steps

    single, _ = run(LLMEngine(config, executor_factory=RecordingExecutor))
    assert made == []  # one rank: no executor is made
    tp_config = EngineConfig(**{**vars(config), "tensor_parallel_size": 2})
    tokens, steps = run(LLMEngine(tp_config, executor_factory=RecordingExecutor))
    assert tokens == single
    ((executor, listening),) = made
    assert executor.rendezvous.host == "127.0.0.1" and executor.rendezvous.port in listening
    assert executor.sent == steps == 6  # one prefill step, then one per token
    assert not spawned_workers()


def test_idle_ranks_outlive_the_collective_timeout(
    llama_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Idle workers wait on the store, not in a collective: idling past the timeout is fine."""
    monkeypatch.setenv("PAGEFLEET_TP_TIMEOUT_S", "1.5")  # inherited by the spawned workers
    prompt = prompt_ids(llama_dir)[4]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    with LLM(model=llama_dir, tensor_parallel_size=2, num_kv_blocks=32, block_size=8) as llm:
        first = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
        time.sleep(3.5)  # more than twice the collective time-out with nothing to do
        (worker,) = llm.engine.token_engine.executor.processes
        assert worker.is_alive()
        again = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    assert again[0].outputs[0].token_ids == first[0].outputs[0].token_ids
    assert len(first[0].outputs[0].token_ids) == 5
    assert not spawned_workers()


def test_a_worker_that_dies_during_start_up_fails_the_start_fast(llama_dir: str) -> None:
    """Rank 0 stops waiting in the rendezvous once a worker has exited, not after 10 minutes."""

    class DoomedExecutor(LocalProcessExecutor):
        def __init__(self, config: EngineConfig) -> None:
            super().__init__(config)
            for p in self.processes:
                p.kill()
                p.join(10)

    config = EngineConfig(model=llama_dir, num_kv_blocks=16, block_size=8, tensor_parallel_size=2)
    t0 = time.monotonic()
    with pytest.raises(
        RuntimeError,
        match=r"tensor-parallel ranks joined: tensor-parallel rank 1 exited \(exit code -9\)",
    ):
        LLMEngine(config, executor_factory=DoomedExecutor)
    assert time.monotonic() - t0 < 30
    assert not spawned_workers()


def test_kv_head_replicated_when_fewer_than_ranks(tmp_path: Path) -> None:
    path = str(make_model(tmp_path / "mqa", "tiny", "llama", seed=3, num_kv_heads=1))
    prompts = prompt_ids(path)[:6]
    assert greedy(path, 2, prompts) == greedy(path, 1, prompts)


def test_three_kv_heads_over_two_ranks_is_refused(tmp_path: Path) -> None:
    path = str(
        make_model(
            tmp_path / "kv3", "tiny", "llama", seed=4, hidden_size=96, num_heads=6, num_kv_heads=3
        )
    )
    with pytest.raises(ValueError, match="must divide one another"):
        LLM(model=path, tensor_parallel_size=2, num_kv_blocks=16)
    assert not spawned_workers()  # refused before any worker started


def test_workers_exit_when_the_driver_dies(llama_dir: str) -> None:
    script = textwrap.dedent(f"""
        import os, sys
        from pagefleet.engine import LLM
        llm = LLM(model={llama_dir!r}, tensor_parallel_size=2, num_kv_blocks=16)
        print(" ".join(str(p.pid) for p in llm.engine.token_engine.executor.processes), flush=True)
        sys.stdin.read()  # wait to be killed
    """)
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert pids and all(psutil.pid_exists(p) for p in pids)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 15
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(p) for p in pids)
    finally:
        proc.kill()


def spawned_workers() -> list[psutil.Process]:
    """Live children started by multiprocessing's spawn (not its resource tracker)."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if "spawn_main" in " ".join(child.cmdline()) and child.status() != psutil.STATUS_ZOMBIE:
                found.append(child)
        except psutil.NoSuchProcess:
            continue
    return found


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_gpt_oss_two_ranks_match_one(tmp_path: Path) -> None:
    """Each rank holds its heads' sinks and a slice of every expert (rank 0 adds the down bias)."""
    path = str(
        make_model(tmp_path / "oss", "tiny", "gpt_oss", seed=4, sliding_window=12, head_dim=16)
    )
    prompts = prompt_ids(path)[:6]
    assert greedy(path, 2, prompts) == greedy(path, 1, prompts)
