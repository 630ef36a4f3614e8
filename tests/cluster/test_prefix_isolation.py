"""A prefix-cache hit never crosses models: two real engines of two models, given the same
prompt token ids, cache disjoint block hashes, and the router counts a request's prefix
hits only on replicas of its own model (their salt), never on the other's."""

from __future__ import annotations

import time

from pagefleet.cluster.routing.policy import RouteRequest, prefix_hits
from pagefleet.cluster.routing.reports import ReplicaLoad, routing_stats_from_engine
from pagefleet.engine import LLM, SamplingParams
from pagefleet.engine.prefix_hash import prefix_hash_salt

BLOCK = 8
IDS = list(range(3, 28))  # 25 tokens: 3 full blocks


def _cached_after(path: str) -> tuple[LLM, ReplicaLoad]:
    llm = LLM(model=path, num_kv_blocks=32, block_size=BLOCK, max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=2)
    llm.generate({"prompt_token_ids": IDS}, params, use_tqdm=False)
    stats = llm.stats()
    load = ReplicaLoad.from_routing_stats(path, routing_stats_from_engine(stats, time.time()))
    return llm, load


def test_identical_prompts_of_two_models_share_no_hash_and_no_hit(
    llama_dir: str, qwen2_dir: str
) -> None:
    llama, llama_load = _cached_after(llama_dir)
    qwen, qwen_load = _cached_after(qwen2_dir)
    ls, qs = llama.stats(), qwen.stats()
    assert ls.prefix_hash_salt == prefix_hash_salt(llama_dir, BLOCK)
    assert qs.prefix_hash_salt == prefix_hash_salt(qwen2_dir, BLOCK)
    assert ls.prefix_hash_salt != qs.prefix_hash_salt
    assert len(ls.cached_block_hashes) == len(qs.cached_block_hashes) == 3
    assert ls.cached_block_hashes.isdisjoint(qs.cached_block_hashes)
    # The router's view: a llama request hits the llama replica's blocks, none of qwen's.
    # (The engine reuses at most (25 - 1) // 8 = 3 blocks: one token is always computed.)
    for salt, own, other in (
        (ls.prefix_hash_salt, llama_load, qwen_load),
        (qs.prefix_hash_salt, qwen_load, llama_load),
    ):
        request = RouteRequest.from_prompt("r", IDS, 4, BLOCK, salt)
        assert prefix_hits(request, own) == 3
        assert prefix_hits(request, other) == 0
    # Even a replica of another model reporting our salt by mistake (a stale or forged
    # report) finds no hit: its digest holds only its own model's hashes.
    request = RouteRequest.from_prompt("r", IDS, 4, BLOCK, ls.prefix_hash_salt)
    forged = ReplicaLoad(
        "q",
        qwen_load.free_blocks,
        qwen_load.total_blocks,
        BLOCK,
        prefix_digest=qwen_load.prefix_digest,
        hash_salt=ls.prefix_hash_salt,
    )
    assert prefix_hits(request, forged) == 0
    # Within one model the same prompt does hit (the control).
    before = ls.prefix_cache_hits
    llama.generate(
        {"prompt_token_ids": IDS}, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False
    )
    assert llama.stats().prefix_cache_hits - before == 3 * BLOCK
    for llm in (llama, qwen):
        llm.check_block_accounting()
        llm.close()
