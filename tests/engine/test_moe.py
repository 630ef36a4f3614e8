"""The mixture-of-experts layer: transformers' numbers, grouped GEMMs, both checkpoint
layouts, and tensor parallelism over the experts' intermediate dimension."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from pagefleet.cluster.make_model import make_model
from pagefleet.engine import LLM, SamplingParams
from pagefleet.engine.layers import moe
from pagefleet.engine.layers.moe import DOWN, GATE, UP, FusedMoE
from tests.conftest import hf_greedy, prompt_ids

HIDDEN, INTER, EXPERTS, TOP_K = 32, 24, 6, 2


def _hf_block(arch: str, norm_topk_prob: bool):
    from transformers import AutoConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    fields = dict(hidden_size=HIDDEN, num_experts_per_tok=TOP_K)
    if arch == "mixtral":
        config = AutoConfig.for_model(
            "mixtral", num_local_experts=EXPERTS, intermediate_size=INTER, **fields
        )
        block = MixtralSparseMoeBlock(config)
    else:
        config = AutoConfig.for_model(
            "qwen3_moe",
            num_experts=EXPERTS,
            moe_intermediate_size=INTER,
            norm_topk_prob=norm_topk_prob,
            **fields,
        )
        block = Qwen3MoeSparseMoeBlock(config)
    torch.manual_seed(0)
    for p in block.parameters():
        p.data.normal_(0, 0.2)
    return block.eval()


def _ours_from(block, norm_topk_prob: bool, float32_weights: bool = False) -> FusedMoE:
    layer = FusedMoE(HIDDEN, INTER, EXPERTS, TOP_K, norm_topk_prob, float32_weights)
    layer.gate.weight.data.copy_(block.gate.weight)
    gate_up, down = block.experts.gate_up_proj.data, block.experts.down_proj.data
    for e in range(EXPERTS):
        gate, up = gate_up[e].chunk(2, dim=0)
        layer.w13.weight_loader(layer.w13, gate, (GATE, e))
        layer.w13.weight_loader(layer.w13, up, (UP, e))
        layer.w2.weight_loader(layer.w2, down[e], (DOWN, e))
    return layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "arch,norm", [("qwen3_moe", False), ("qwen3_moe", True), ("mixtral", True)]
)
def test_layer_equals_transformers_block(arch: str, norm: bool, dtype: torch.dtype) -> None:
    block = _hf_block(arch, norm).to(dtype)
    layer = _ours_from(block, norm, float32_weights=arch == "mixtral").to(dtype)
    x = torch.randn(37, HIDDEN, dtype=dtype)
    with torch.inference_mode():
        expected = block(x.unsqueeze(0))
        expected = (expected[0] if isinstance(expected, tuple) else expected)[0]
        got = layer(x)
    exact = {torch.float32: 1e-6, torch.bfloat16: 0.0}[dtype]
    torch.testing.assert_close(got, expected, rtol=exact, atol=exact)


def test_one_gemm_pair_per_active_expert(monkeypatch: pytest.MonkeyPatch) -> None:
    """The work is grouped by expert: 2 GEMMs per expert with tokens, whatever the token count."""
    calls: list[int] = []

    def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        calls.append(x.shape[0])
        return F.linear(x, w, b)

    monkeypatch.setattr(moe, "F", SimpleNamespace(linear=linear, silu=F.silu, softmax=F.softmax))
    layer = _ours_from(_hf_block("qwen3_moe", True), True)
    for tokens in (1, 5, 300):
        calls.clear()
        with torch.inference_mode():
            weights, ids = layer.gate.route(torch.randn(tokens, HIDDEN))
            calls.clear()
            moe.moe_experts(torch.randn(tokens, HIDDEN), ids, weights, layer.w13, layer.w2)
        active = ids.unique().numel()
        assert len(calls) == 2 * active
        assert sum(calls) == 2 * tokens * TOP_K  # every (token, expert) row once per GEMM


@pytest.fixture(scope="module")
def moe_dir(model_root: Path) -> str:
    path = model_root / "tiny-qwen3-moe-tp"
    if not (path / "model.safetensors").exists():
        make_model(path, "tiny", "qwen3_moe", seed=11, head_dim=32)
    return str(path)


def _greedy(path: str, prompts: list[list[int]], **engine_args: object) -> list[list[int]]:
    with LLM(model=path, dtype="float32", num_kv_blocks=128, block_size=8, **engine_args) as llm:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0, max_tokens=12),
            use_tqdm=False,
        )
        llm.check_block_accounting()
    return [o.outputs[0].token_ids for o in outs]


def test_fused_expert_layout_loads(moe_dir: str, tmp_path: Path) -> None:
    """A checkpoint with `experts.gate_up_proj` / `experts.down_proj` tensors (every expert in
    one) gives the same tokens as the per-expert layout transformers' save_pretrained writes."""
    fused = tmp_path / "fused"
    shutil.copytree(moe_dir, fused)
    tensors = load_file(str(fused / "model.safetensors"))
    config = json.loads((fused / "config.json").read_text())
    experts = config.get("num_experts") or config["num_local_experts"]
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}.mlp.experts"
        take = [
            [tensors.pop(f"{prefix}.{e}.{proj}.weight") for e in range(experts)]
            for proj in ("gate_proj", "up_proj", "down_proj")
        ]
        gate, up, down = (torch.stack(t) for t in take)
        tensors[f"{prefix}.gate_up_proj"] = torch.cat((gate, up), dim=1).contiguous()
        tensors[f"{prefix}.down_proj"] = down.contiguous()
    save_file(tensors, str(fused / "model.safetensors"), metadata={"format": "pt"})
    prompts = prompt_ids(moe_dir)[:6]
    expected = [hf_greedy(moe_dir, p, 12) for p in prompts]
    assert _greedy(moe_dir, prompts) == expected
    assert _greedy(str(fused), prompts) == expected


def test_two_ranks_match_one(moe_dir: str) -> None:
    """Each rank holds half of every expert's intermediate dimension; the sum is all-reduced."""
    prompts = prompt_ids(moe_dir)
    assert _greedy(moe_dir, prompts, tensor_parallel_size=2) == _greedy(moe_dir, prompts)


def test_weight_estimate_counts_every_expert(moe_dir: str) -> None:
    from pagefleet.engine.loader import load_model
    from pagefleet.engine.model_runner import weight_bytes_per_rank
    from pagefleet.engine.models import resolve_model

    model = load_model(moe_dir, torch.float32, torch.device("cpu"), 64)
    params = sum(p.numel() for p in model.parameters())
    args = resolve_model(json.loads((Path(moe_dir) / "config.json").read_text())).args
    assert weight_bytes_per_rank(args, 1, 4) == params * 4


@pytest.mark.compile
def test_compiled_forward_keeps_experts_as_one_op(moe_dir: str) -> None:
    """Under torch.compile (fullgraph) the experts run through the pagefleet::moe_experts op:
    transformers' tokens, whatever each step's routing."""
    prompts = prompt_ids(moe_dir)[:8]
    expected = [hf_greedy(moe_dir, p, 12) for p in prompts]
    assert _greedy(moe_dir, prompts, enforce_eager=False, max_num_batched_tokens=32) == expected
