"""MXFP4 expert weights (gpt-oss checkpoints) dequantize exactly at load."""

from __future__ import annotations

import torch

from pagefleet.engine.mxfp4 import (
    FP4_VALUES,
    dequantize_checkpoint_tensor,
    dequantize_mxfp4,
    quantize_mxfp4,
)


def test_each_code_and_scale_dequantizes_exactly() -> None:
    # Two 32-element blocks: block 0 holds codes 0..15 twice at scale 2 ** 0, block 1 the
    # codes reversed at scale 2 ** -3.
    codes = torch.tensor([list(range(16)) * 2 + list(range(15, -1, -1)) * 2])
    scales = torch.tensor([[127, 124]], dtype=torch.uint8)
    blocks = quantize_mxfp4(codes, scales)
    assert blocks.shape == (1, 2, 16) and blocks.dtype == torch.uint8
    # Low nibble first: byte 0 packs codes 0 (low) and 1 (high).
    assert blocks[0, 0, 0].item() == 0x10 and blocks[0, 1, 0].item() == 0xEF
    values = torch.tensor(FP4_VALUES)
    expected = torch.cat((values[codes[0, :32]], values[codes[0, 32:]] / 8)).unsqueeze(0)
    got = dequantize_mxfp4(blocks, scales)
    assert got.dtype == torch.float32
    assert torch.equal(got, expected)
    assert torch.equal(torch.signbit(got), torch.signbit(expected))  # code 8 is -0


def test_known_weights_round_trip_in_the_checkpoint_layout() -> None:
    """gpt-oss stores gate_up_proj [experts, hidden, 2I] quantized as its transpose."""
    g = torch.Generator().manual_seed(0)
    experts, rows, cols = 2, 3, 64  # quantized along cols (hidden), two blocks per row
    codes = torch.randint(0, 16, (experts, rows, cols), generator=g)
    scales = torch.randint(120, 135, (experts, rows, cols // 32), generator=g).to(torch.uint8)
    block_scales = torch.exp2(scales.float() - 127).repeat_interleave(32, dim=-1)
    weight = torch.tensor(FP4_VALUES)[codes] * block_scales
    blocks = quantize_mxfp4(codes, scales)
    assert blocks.shape == (experts, rows, cols // 32, 16)
    got = dequantize_checkpoint_tensor(blocks, scales)
    assert got.shape == (experts, cols, rows)
    assert torch.equal(got, weight.transpose(1, 2))


def test_an_mxfp4_checkpoint_loads_as_its_dequantized_twin(tmp_path) -> None:
    """A gpt-oss checkpoint with MXFP4 experts loads into the very weights of the same
    checkpoint stored unquantized."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from pagefleet.cluster.make_model import make_model
    from pagefleet.engine.loader import load_model

    plain, packed = tmp_path / "plain", tmp_path / "mxfp4"
    make_model(
        plain, "tiny", "gpt_oss", seed=1, sliding_window=12, head_dim=16, moe_intermediate_size=64
    )
    shutil.copytree(plain, packed)
    tensors = load_file(str(plain / "model.safetensors"))
    quantized = dict(tensors)
    g = torch.Generator().manual_seed(1)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, cols, rows = tensors[name].shape  # stored [E, in, out]: quantized along in
        codes = torch.randint(0, 16, (experts, rows, cols), generator=g)
        scales = torch.randint(122, 130, (experts, rows, cols // 32), generator=g).to(torch.uint8)
        tensors[name] = dequantize_checkpoint_tensor(quantize_mxfp4(codes, scales), scales)
        del quantized[name]
        quantized[f"{name}_blocks"] = quantize_mxfp4(codes, scales)
        quantized[f"{name}_scales"] = scales
    save_file(tensors, str(plain / "model.safetensors"))
    save_file(quantized, str(packed / "model.safetensors"))
    config = json.loads((packed / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (packed / "config.json").write_text(json.dumps(config))

    load = lambda path: load_model(str(path), torch.float32, torch.device("cpu"), 256)  # noqa: E731
    want, got = load(plain).state_dict(), load(packed).state_dict()
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name
