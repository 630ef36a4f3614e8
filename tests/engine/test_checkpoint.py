"""Real checkpoints as `vllm serve` reads them: dtype auto, generation_config.json's sampling
defaults, sharded safetensors, .bin-only folders, and Hugging Face Hub ids from a local cache."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagefleet.engine import LLM, EngineConfig, SamplingParams
from pagefleet.engine.checkpoint import (
    auto_dtype,
    checkpoint_dtype,
    cpu_has_native_bf16,
    generation_defaults,
    weight_files,
)

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Stack:"]
GREEDY = SamplingParams(temperature=0, max_tokens=6)


def copy_checkpoint(src: str, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def token_ids(llm: LLM, params: SamplingParams | None = None) -> list[list[int]]:
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    llm.check_block_accounting()
    return [list(o.outputs[0].token_ids) for o in outs]


def resave(folder: Path, dtype: torch.dtype) -> Path:
    """The checkpoint's weights and config.json in `dtype`, as transformers saves them."""
    weights = load_file(folder / "model.safetensors")
    save_file({k: v.to(dtype) for k, v in weights.items()}, folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    config["dtype"] = str(dtype).removeprefix("torch.")
    (folder / "config.json").write_text(json.dumps(config))
    return folder


# -- dtype auto -------------------------------------------------------------------------


def test_auto_dtype_on_the_cpu_with_and_without_native_bfloat16() -> None:
    no_bf16 = "this CPU has no native bfloat16 (neither avx512_bf16 nor amx_bf16)"
    assert auto_dtype("bfloat16", "cpu", native_bf16=False) == (
        "float32",
        f"dtype auto: the checkpoint's bfloat16 runs as float32, because {no_bf16}",
    )
    assert auto_dtype("bfloat16", "cpu", native_bf16=True) == (
        "bfloat16",
        "dtype auto: the checkpoint's bfloat16 runs as bfloat16, because this CPU has native "
        "bfloat16 (avx512_bf16 or amx_bf16)",
    )
    assert auto_dtype("float16", "cpu", native_bf16=True) == (
        "bfloat16",
        "dtype auto: the checkpoint's float16 runs as bfloat16, because float16 is not a CPU "
        "compute dtype (as in vLLM's CPU backend)",
    )
    assert auto_dtype("float16", "cpu", native_bf16=False)[0] == "float32"
    assert auto_dtype("float32", "cpu", native_bf16=False) == ("float32", None)
    assert auto_dtype("bfloat16", "cuda", native_bf16=False) == ("bfloat16", None)
    assert auto_dtype("float16", "cuda:0", native_bf16=False) == ("float16", None)


def test_checkpoint_dtype_reads_dtype_or_torch_dtype() -> None:
    assert checkpoint_dtype({"dtype": "bfloat16"}) == "bfloat16"
    assert checkpoint_dtype({"torch_dtype": "float16"}) == "float16"
    assert checkpoint_dtype({"text_config": {"torch_dtype": "bfloat16"}}) == "bfloat16"
    assert checkpoint_dtype({}) == "float32"
    with pytest.raises(ValueError, match="'int8' is not one the engine runs"):
        checkpoint_dtype({"dtype": "int8"})


def test_dtype_defaults_to_auto_and_runs_the_checkpoints_dtype(
    llama_dir: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    bf16 = resave(copy_checkpoint(llama_dir, tmp_path / "bf16"), torch.bfloat16)
    expected = auto_dtype("bfloat16", "cpu", cpu_has_native_bf16())
    config = EngineConfig(model=str(bf16))
    assert (config.dtype, config.runtime_dtype) == ("auto", expected)
    assert config.torch_dtype == getattr(torch, expected[0])
    # An explicit dtype runs as asked: configs that say float32 keep their meaning.
    assert EngineConfig(model=str(bf16), dtype="float32").runtime_dtype == ("float32", None)
    assert EngineConfig(model=llama_dir).runtime_dtype == ("float32", None)

    kw = {"num_kv_blocks": 32, "max_num_seqs": 4}
    with LLM(model=str(bf16), dtype=expected[0], **kw) as llm:
        explicit = token_ids(llm, GREEDY)
    with caplog.at_level(logging.INFO, logger="pagefleet"), LLM(model=str(bf16), **kw) as llm:
        assert token_ids(llm, GREEDY) == explicit
    # One line, either way: a warning where bfloat16 becomes float32, else information.
    notes = [(r.levelno, r.getMessage()) for r in caplog.records if "dtype auto" in r.getMessage()]
    level = logging.INFO if expected[0] == "bfloat16" else logging.WARNING
    assert notes == [(level, expected[1])]


def test_a_float16_checkpoint_on_the_cpu_says_which_dtype_runs_and_why(
    llama_dir: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fp16 = resave(copy_checkpoint(llama_dir, tmp_path / "fp16"), torch.float16)
    runs, why = auto_dtype("float16", "cpu", cpu_has_native_bf16())
    with (
        caplog.at_level(logging.WARNING, logger="pagefleet"),
        LLM(model=str(fp16), num_kv_blocks=32, max_num_seqs=4) as llm,
    ):
        assert llm.engine.config.torch_dtype == getattr(torch, runs)
        token_ids(llm, GREEDY)
    assert [r.getMessage() for r in caplog.records if "dtype auto" in r.getMessage()] == [why]


# -- weight files -------------------------------------------------------------------------


def test_sharded_safetensors_load_as_one_file_does(llama_dir: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    sharded = copy_checkpoint(llama_dir, tmp_path / "sharded")
    (sharded / "model.safetensors").unlink()
    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    model.save_pretrained(sharded, max_shard_size="200KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3
    assert weight_files(sharded) == [sharded / s for s in shards]
    kw = {"dtype": "float32", "num_kv_blocks": 32, "max_num_seqs": 4}
    with LLM(model=llama_dir, **kw) as llm:
        whole = token_ids(llm, GREEDY)
    with LLM(model=str(sharded), **kw) as llm:
        assert token_ids(llm, GREEDY) == whole

    (sharded / shards[1]).unlink()
    with pytest.raises(ValueError, match=f"names shards that are not there: {shards[1]}"):
        EngineConfig(model=str(sharded))


def test_a_bin_only_checkpoint_is_refused_naming_the_file(llama_dir: str, tmp_path: Path) -> None:
    pickled = copy_checkpoint(llama_dir, tmp_path / "pickled")
    torch.save(load_file(pickled / "model.safetensors"), pickled / "pytorch_model.bin")
    (pickled / "model.safetensors").unlink()
    with pytest.raises(ValueError) as err:
        EngineConfig(model=str(pickled))
    assert str(err.value) == (
        f"{pickled / 'pytorch_model.bin'}: PyTorch pickle weights (.bin) are not loaded, only "
        "safetensors; convert the checkpoint once (transformers' "
        "`from_pretrained(DIR).save_pretrained(OUT)` writes safetensors)"
    )
    (pickled / "pytorch_model.bin").unlink()
    with pytest.raises(ValueError, match=r"no \.safetensors weights in"):
        EngineConfig(model=str(pickled))


# -- generation_config.json ---------------------------------------------------------------

SHIPPED = {
    "eos_token_id": [0, 2],
    "temperature": 0.7,
    "top_p": 0.8,
    "top_k": 1,
    "min_p": 0.05,
    "repetition_penalty": 1.05,
    "max_new_tokens": 5,
    "do_sample": True,
}


def with_generation_config(llama_dir: str, dst: Path, fields: dict) -> Path:
    folder = copy_checkpoint(llama_dir, dst)
    shipped = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps(shipped | fields))
    return folder


def test_generation_defaults_read_what_differs_from_transformers_defaults(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps(SHIPPED))
    expected = {
        "temperature": 0.7,
        "top_p": 0.8,
        "top_k": 1,
        "min_p": 0.05,
        "repetition_penalty": 1.05,
        "max_tokens": 5,
    }
    assert generation_defaults(str(tmp_path)) == expected
    assert generation_defaults("/elsewhere", str(tmp_path)) == expected
    assert generation_defaults("/elsewhere", str(tmp_path / "generation_config.json")) == expected
    assert generation_defaults(str(tmp_path), "vllm") == {}
    assert generation_defaults(str(tmp_path / "none")) == {}
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 1.0, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.0})
    )
    assert generation_defaults(str(tmp_path)) == {}


def test_generation_config_must_be_a_mode_or_a_path(llama_dir: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="generation_config must be 'auto', 'vllm' or a folder"):
        EngineConfig(model=llama_dir, generation_config=str(tmp_path / "nowhere"))


def test_offline_generate_takes_the_checkpoints_defaults_unless_params_are_given(
    llama_dir: str, tmp_path: Path
) -> None:
    folder = with_generation_config(llama_dir, tmp_path / "instruct", SHIPPED)
    kw = {"dtype": "float32", "num_kv_blocks": 32, "max_num_seqs": 4}
    with LLM(model=str(folder), **kw) as llm:
        assert llm.get_default_sampling_params() == SamplingParams(
            temperature=0.7, top_p=0.8, top_k=1, min_p=0.05, repetition_penalty=1.05, max_tokens=5
        )
        defaulted = token_ids(llm)  # top_k 1: the greedy tokens, max_new_tokens of them
        given = token_ids(llm, SamplingParams(temperature=0, max_tokens=3))
        penalised = token_ids(
            llm, SamplingParams(temperature=0, max_tokens=5, repetition_penalty=1.05)
        )
    assert [len(t) for t in defaulted] == [5, 5, 5]
    assert defaulted == penalised
    assert all(len(t) == 3 for t in given)
    with LLM(model=str(folder), generation_config="vllm", **kw) as llm:
        assert llm.get_default_sampling_params() == SamplingParams()


# -- Hugging Face Hub ids -------------------------------------------------------------------

REVISION = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(hf_home: Path, repo_id: str, checkpoint: str) -> Path:
    """A Hub cache folder as huggingface_hub lays it out: models--org--name, its snapshot at
    REVISION (the checkpoint's files), and refs/main naming it."""
    repo = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    shutil.copytree(checkpoint, repo / "snapshots" / REVISION)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    return repo / "snapshots" / REVISION


def test_a_hub_id_is_served_from_the_local_cache_offline(
    llama_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    snapshot = hub_cache(tmp_path / "hf", "pagefleet-test/tiny-offline", llama_dir)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    config = EngineConfig(model="pagefleet-test/tiny-offline")
    assert config.checkpoint == str(snapshot)
    pinned = EngineConfig(model="pagefleet-test/tiny-offline", revision=REVISION)
    assert pinned.checkpoint == str(snapshot)
    kw = {"dtype": "float32", "num_kv_blocks": 32, "max_num_seqs": 4}
    with LLM(model=llama_dir, **kw) as llm:
        local = token_ids(llm, GREEDY)
    with LLM(model="pagefleet-test/tiny-offline", **kw) as llm:
        assert token_ids(llm, GREEDY) == local

    with pytest.raises(ValueError) as err:
        EngineConfig(model="pagefleet-test/not-cached")
    assert str(err.value).startswith(
        "model 'pagefleet-test/not-cached' (revision main) is not a local folder and was not "
        "found in the local Hub cache (HF_HUB_OFFLINE=1): LocalEntryNotFoundError"
    )
    with pytest.raises(ValueError, match="revision v9"):
        EngineConfig(model="pagefleet-test/tiny-offline", revision="v9")
