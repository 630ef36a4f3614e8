"""n samples and best_of: shared prompt blocks, copy-on-write, reproducibility, no leaks."""

from __future__ import annotations

from pagefleet.engine import LLM, EngineConfig, LLMEngine, SamplingParams


def _run(engine: LLMEngine) -> dict:
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def test_samples_share_prompt_blocks_until_they_write(llama_dir: str) -> None:
    engine = LLMEngine(
        EngineConfig(model=llama_dir, num_kv_blocks=64, block_size=8, enable_prefix_caching=False)
    )
    prompt = list(range(5, 25))  # 20 tokens: blocks of 8, 8, 4
    engine.add_request(
        "r",
        {"prompt_token_ids": prompt},
        SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=10, ignore_eos=True),
    )
    engine.step()  # computes prompt[:-1], then forks
    group = engine.token_engine.sequences("r")
    assert len(group) == 4
    shared = group[0].block_table
    assert all(s.block_table == shared for s in group)
    assert [engine.token_engine.block_manager.ref_count(b) for b in shared] == [4, 4, 4]
    assert engine.stats().num_used_blocks == 3
    engine.step()  # each sample writes its last prompt token into the shared partial block
    tables = [s.block_table for s in group]
    assert all(t[:2] == shared[:2] for t in tables)  # full blocks still shared
    assert len({t[2] for t in tables}) == 4  # the partial block: copied for 3 of the 4
    assert [engine.token_engine.block_manager.ref_count(b) for b in shared[:2]] == [4, 4]
    assert engine.stats().num_used_blocks == 3 + 3  # versus 4 x 3 = 12 without sharing
    out = _run(engine)["r"]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 10 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    engine.check_block_accounting()


def test_seeded_samples_reproduce(llama_dir: str) -> None:
    llm = LLM(model=llama_dir, num_kv_blocks=64)
    p = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=8)
    a = llm.generate("import os", p, use_tqdm=False)[0]
    b = llm.generate("import os", p, use_tqdm=False)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    llm.check_block_accounting()


def test_aborting_one_sample_leaks_nothing(llama_dir: str) -> None:
    engine = LLMEngine(EngineConfig(model=llama_dir, num_kv_blocks=64, block_size=4))
    engine.add_request(
        "r",
        "for line in f:",
        SamplingParams(n=4, temperature=1.0, max_tokens=12, ignore_eos=True, seed=0),
    )
    engine.step()
    engine.step()
    engine.token_engine.finish_sequence("r", 2, "abort")
    engine.token_engine.block_manager.check_accounting()
    out = _run(engine)["r"]
    assert [c.finish_reason for c in out.outputs] == ["length", "length", "abort", "length"]
    engine.check_block_accounting()
    # And aborting the whole request mid-way.
    engine.add_request("s", "for line in f:", SamplingParams(n=4, temperature=1.0, max_tokens=12))
    engine.step()
    engine.step()
    engine.abort_request("s")
    engine.check_block_accounting()
    assert engine.stats().num_free_blocks == 64


def test_best_of_returns_the_most_likely_samples(llama_dir: str) -> None:
    llm = LLM(model=llama_dir, num_kv_blocks=64)
    all3 = llm.generate(
        "class A:",
        SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6, logprobs=0),
        use_tqdm=False,
    )[0]
    best = llm.generate(
        "class A:",
        SamplingParams(n=1, best_of=3, temperature=1.0, seed=5, max_tokens=6),
        use_tqdm=False,
    )[0]
    top = max(all3.outputs, key=lambda c: c.cumulative_logprob)
    assert len(best.outputs) == 1
    assert best.outputs[0].token_ids == top.token_ids
    assert abs(best.outputs[0].cumulative_logprob - top.cumulative_logprob) < 1e-6
    llm.check_block_accounting()
