"""`pagefleet serve MODEL [flags]` as `vllm serve MODEL` is run, no config file: a checkpoint
folder, and a Hugging Face Hub id served from a local Hub cache with HF_HUB_OFFLINE=1 (no
network), whose generation_config.json's defaults apply to requests that leave them out.
Oracle: the official `openai` client's completions equal `LLM.generate`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import openai
import pytest

from pagefleet.bench.launcher import free_port  # outside the ephemeral range Ray binds in
from pagefleet.engine import LLM, SamplingParams
from tests.e2e.served import start_serve_command, stop_served
from tests.engine.test_checkpoint import hub_cache

pytestmark = pytest.mark.e2e

PROMPT = "def fibonacci(n):"
REPO = "pagefleet-test/tiny-instruct"
FLAGS = ["--max-model-len", "256", "--max-num-seqs", "4", "--block-size", "8", "--enforce-eager"]


def test_serve_a_hub_id_from_the_cache_with_its_sampling_defaults(
    llama_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoint = tmp_path / "instruct"
    shutil.copytree(llama_dir, checkpoint)
    shipped = json.loads((checkpoint / "generation_config.json").read_text())
    defaults = {"top_k": 1, "repetition_penalty": 1.05, "max_new_tokens": 5}
    (checkpoint / "generation_config.json").write_text(json.dumps(shipped | defaults))
    hub_cache(tmp_path / "hf", REPO, str(checkpoint))
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    kw = {"max_model_len": 256, "max_num_seqs": 4, "block_size": 8, "num_kv_blocks": 64}
    with LLM(model=REPO, **kw) as llm:
        defaulted = llm.generate([PROMPT], use_tqdm=False)[0].outputs[0].text
        greedy = SamplingParams(temperature=0, max_tokens=3)
        given = llm.generate([PROMPT], greedy, use_tqdm=False)[0].outputs[0].text
        llm.check_block_accounting()

    port = free_port()
    served = start_serve_command([REPO, "--port", str(port), *FLAGS], port, env=env)
    try:
        client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="none", max_retries=0)
        assert [m.id for m in client.models.list().data] == [REPO]
        assert (
            "pagefleet: requests that leave them out sample with the checkpoint's defaults: "
            "top_k=1, repetition_penalty=1.05, max_tokens=5 (--generation-config vllm: none)\n"
        ) in served.log
        out = client.completions.create(model=REPO, prompt=PROMPT)
        assert (out.choices[0].text, out.usage.completion_tokens) == (defaulted, 5)
        out = client.completions.create(model=REPO, prompt=PROMPT, temperature=0, max_tokens=3)
        assert out.choices[0].text == given
    finally:
        stop_served(served)


def test_serve_a_checkpoint_folder_with_vllms_flags(llama_dir: str) -> None:
    with LLM(model=llama_dir, max_model_len=256, num_kv_blocks=64, block_size=8) as llm:
        params = SamplingParams(temperature=0, max_tokens=8)
        expected = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].text
        llm.check_block_accounting()

    port = free_port()
    argv = [llama_dir, "--port", str(port), "--served-model-name", "tiny", "--api-key", "k"]
    served = start_serve_command([*argv, *FLAGS, "--no-enable-prefix-caching"], port)
    try:
        client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="k", max_retries=0)
        out = client.completions.create(model="tiny", prompt=PROMPT, temperature=0, max_tokens=8)
        assert out.choices[0].text == expected
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{served.url}/v1", api_key="x", max_retries=0).models.list()
    finally:
        stop_served(served)
