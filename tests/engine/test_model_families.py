"""Each model family, from a checkpoint transformers saved, gives transformers' greedy tokens.

Every family runs the same engine mixes: a batch with chunked prefill, a pool too small for
the batch (preemption), and prompts behind a cached shared prefix (prefix caching); the KV
blocks balance after each.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pagefleet.cluster.make_model import make_model
from pagefleet.cluster.model_presets import preset_arch
from pagefleet.engine import LLM, SamplingParams
from tests.conftest import hf_greedy, prompt_ids

MAX_NEW = 16

# family -> (arch, seed, ModelShape overrides, transformers config overrides)
FAMILIES: dict[str, tuple[str, int, dict, dict]] = {
    # An explicit head_dim unlike hidden_size / heads (64 / 4 = 16).
    "qwen3": ("qwen3", 3, {"head_dim": 32, "tie_word_embeddings": False}, {}),
    # Layer 0 dense (mlp_only_layers), layers 1 and 2 routed to 2 of 8 experts.
    "qwen3_moe": ("qwen3_moe", 4, {"num_layers": 3, "head_dim": 32}, {"mlp_only_layers": [0]}),
    "mixtral": ("mixtral", 5, {"tie_word_embeddings": False}, {}),
    # LongRoPE over a 64-token original context (every sequence here stays below it: transformers
    # switches factors for a whole forward past it, the cache per position).
    "phi3": (
        "phi3",
        6,
        {"max_position_embeddings": 1024},
        {
            "original_max_position_embeddings": 256,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0 + 0.1 * i for i in range(8)],
                "long_factor": [2.0 + 0.5 * i for i in range(8)],
                "original_max_position_embeddings": 256,
            },
            "pad_token_id": 0,
        },
    ),
    "olmo2": ("olmo2", 7, {"tie_word_embeddings": False}, {}),
    "granite": ("granite", 8, {}, {}),
    # Layer 1 without rope (NoPE).
    "smollm3": ("smollm3", 9, {}, {"no_rope_layers": [1, 0]}),
    # gpt-oss: sliding (12) and global layers alternating, attention sinks, biased experts
    # (top 2 of 8) whose SwiGLU clamps at 0.5 (most gate/up values of this tiny model pass
    # it), gpt-oss's YaRN.
    "gpt_oss": (
        "gpt_oss",
        11,
        {"sliding_window": 12, "head_dim": 16, "tie_word_embeddings": False},
        {"swiglu_limit": 0.5},
    ),
    # YaRN, as Qwen3's long-context configs set it.
    "qwen3_yarn": (
        "qwen3",
        10,
        {"head_dim": 32},
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 256,
            }
        },
    ),
}


def family_checkpoint(model_root: Path, name: str) -> Path:
    """FAMILIES[name]'s tiny checkpoint under `model_root`, written on first use."""
    arch, seed, shape, config = FAMILIES[name]
    path = model_root / f"tiny-{name}"
    if not (path / "model.safetensors").exists():
        make_model(path, "tiny", arch, seed=seed, config_overrides=config, **shape)
    return path


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(
    request: pytest.FixtureRequest, model_root: Path
) -> tuple[str, list[list[int]], list[list[int]]]:
    path = family_checkpoint(model_root, request.param)
    prompts = prompt_ids(str(path))
    shared = [t for p in prompts[8:12] for t in p][:40]
    prompts += [[*shared, 11, 12], [*shared, 13]]
    expected = [hf_greedy(str(path), ids, MAX_NEW) for ids in prompts]
    return str(path), prompts, expected


def _generate(
    path: str, prompts: list[list[int]], **engine_args: object
) -> tuple[LLM, list[list[int]]]:
    llm = LLM(model=path, dtype="float32", **engine_args)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0.0, max_tokens=MAX_NEW),
        use_tqdm=False,
    )
    return llm, [o.outputs[0].token_ids for o in outs]


def test_greedy_equals_transformers_with_chunked_prefill(family) -> None:
    path, prompts, expected = family
    llm, got = _generate(path, prompts, num_kv_blocks=128, block_size=8, max_num_batched_tokens=11)
    assert got == expected
    llm.check_block_accounting()
    stats = llm.stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_greedy_equals_transformers_under_preemption(family) -> None:
    path, prompts, expected = family
    llm, got = _generate(
        path, prompts, block_size=8, num_kv_blocks=16, max_model_len=128, max_num_seqs=16
    )
    assert llm.stats().num_preemptions > 0
    assert got == expected
    llm.check_block_accounting()


def test_greedy_equals_transformers_behind_a_cached_prefix(family) -> None:
    """One at a time: the last two prompts reuse the blocks of their shared 40-token prefix."""
    path, prompts, expected = family
    llm, got = _generate(path, prompts, block_size=8, num_kv_blocks=64, max_num_seqs=1)
    assert got == expected
    assert llm.stats().prefix_cache_hits > 0
    llm.check_block_accounting()


def test_make_model_writes_each_family_through_transformers(tmp_path: Path) -> None:
    import json

    from pagefleet.cli import main

    assert (
        main(["make-model", str(tmp_path / "moe"), "--preset", "tiny", "--arch", "qwen3_moe"]) == 0
    )
    config = json.loads((tmp_path / "moe" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"]
    assert (config["num_experts_per_tok"], config["moe_intermediate_size"]) == (2, 48)
    assert main(["make-model", str(tmp_path / "oss"), "--preset", "tiny", "--arch", "gpt_oss"]) == 0
    config = json.loads((tmp_path / "oss" / "config.json").read_text())
    assert config["architectures"] == ["GptOssForCausalLM"]
    assert config["layer_types"] == ["sliding_attention", "full_attention"]
    assert (config["num_local_experts"], config["intermediate_size"]) == (8, 48)
    with pytest.raises(ValueError, match="needs a preset with experts"):
        make_model(tmp_path / "dense", "tiny", "mixtral", num_experts=0)


def test_a_preset_implies_its_architecture(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from pagefleet.cli import main

    assert preset_arch("tiny") == "llama"
    assert preset_arch("qwen3-moe-small") == "qwen3_moe"
    assert preset_arch("mixtral-8x7b-2l") == "mixtral"
    assert preset_arch("gemma3-270m") == "gemma3"
    assert preset_arch("qwen3-moe-small", "gpt_oss") == "gpt_oss"
    assert preset_arch("gemma-tiny", "gemma2") == "gemma2"
    assert main(["make-model", str(tmp_path / "g"), "--preset", "gemma-tiny"]) == 0
    assert "wrote gemma-tiny (gemma3, seed 0)" in capsys.readouterr().out
    config = json.loads((tmp_path / "g" / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"]
    args = ["make-model", str(tmp_path / "q"), "--preset", "qwen3-moe-small", "--arch", "llama"]
    assert main(args) == 2
    assert capsys.readouterr().err == (
        "pagefleet: error: preset 'qwen3-moe-small' is written as one of qwen3_moe, mixtral, "
        "gpt_oss, not 'llama'\n"
    )
    assert not (tmp_path / "q").exists()
    with pytest.raises(ValueError, match="is written as one of gemma3, gemma2, not 'llama'"):
        make_model(tmp_path / "l", "gemma-tiny", "llama")


def test_gpt_oss_compiled_equals_transformers(model_root: Path) -> None:
    """The compiled forward (fullgraph) keeps gpt-oss's experts as one custom op."""
    path = family_checkpoint(model_root, "gpt_oss")
    prompts = prompt_ids(str(path))[:4]
    expected = [hf_greedy(str(path), ids, MAX_NEW) for ids in prompts]
    llm, got = _generate(str(path), prompts, enforce_eager=False, num_kv_blocks=64, block_size=8)
    assert got == expected
    llm.check_block_accounting()
