"""The bytes a tensor-parallel step travels as: `StepInputs` (or the stop) without pickle.

Rank 0 encodes each step's inputs (`encode_step`); ranks 1..N-1 decode them
(`decode_step`) after `distributed.next_step` has checked the message's
HMAC, so only bytes rank 0 wrote reach the decoder. The decoder is strict
anyway (a bug on either side fails loudly rather than running a wrong step):
it builds exactly a `StepInputs` and its `AttentionMetadata` from a fixed
schema, checking every field's type, dtype, rank and size.

Layout: a 4-byte big-endian length, a JSON head, then the raw bytes of each
tensor present, in `TENSORS` order (native byte order: every rank of a group
runs on the same kind of machine). The head holds the plain fields and each
tensor's shape; dtypes are fixed by the schema, never read from the message.

    {"stop": false, "ints": {name: int}, "blocks_to_copy": [[src, dst], ...],
     "shapes": {name: [dim, ...] or null}}

The stop message is {"stop": true}.
"""

from __future__ import annotations

import json
import math
import struct
from typing import TYPE_CHECKING, Any

import torch

from pagefleet.kernels import AttentionMetadata

if TYPE_CHECKING:
    from .model_runner import StepInputs

# Every tensor of a step, its dtype and number of dimensions. The first four are
# StepInputs' own fields, the rest AttentionMetadata's; those marked optional are
# the padded layouts, present all together (the CPU path) or not at all (CUDA).
TENSORS: dict[str, tuple[torch.dtype, int, bool]] = {
    "input_ids": (torch.int64, 1, False),
    "positions": (torch.int64, 1, False),
    "logit_rows": (torch.int64, 1, False),
    "slot_mapping": (torch.int64, 1, False),
    "block_tables": (torch.int32, 2, False),
    "context_lens": (torch.int32, 1, False),
    "query_start_loc": (torch.int32, 1, False),
    "decode_block_tables": (torch.int64, 2, True),
    "decode_mask": (torch.bool, 4, True),
    "prefill_block_tables": (torch.int64, 2, True),
    "prefill_query_index": (torch.int64, 2, True),
    "prefill_query_valid": (torch.bool, 2, True),
    "prefill_query_pos": (torch.int64, 2, True),
    "prefill_mask": (torch.bool, 4, True),
}
STEP_TENSORS = ("input_ids", "positions", "logit_rows")
INTS = ("num_decode_tokens", "max_query_len", "max_decode_context_len")
_LENGTH = struct.Struct(">I")
_HEAD_KEYS = {"stop", "ints", "blocks_to_copy", "shapes"}


class StepDecodeError(ValueError):
    """The bytes are not a step of this schema."""


def encode_step(inputs: StepInputs | None) -> bytes:
    """`inputs` as bytes (None: the stop message)."""
    if inputs is None:
        return _with_head({"stop": True}, [])
    meta = inputs.meta
    shapes: dict[str, list[int] | None] = {}
    data: list[bytes] = []
    for name, (dtype, ndim, _) in TENSORS.items():
        t = getattr(inputs if name in STEP_TENSORS else meta, name)
        if t is None:
            shapes[name] = None
            continue
        if t.dtype != dtype or t.dim() != ndim:
            raise TypeError(f"step field {name}: {t.dtype}[{t.dim()}d], the schema has {dtype}")
        shapes[name] = list(t.shape)
        data.append(t.detach().cpu().contiguous().numpy().tobytes())
    head = {
        "stop": False,
        "ints": {name: int(getattr(meta, name)) for name in INTS},
        "blocks_to_copy": [[int(s), int(d)] for s, d in inputs.blocks_to_copy],
        "shapes": shapes,
    }
    return _with_head(head, data)


def _with_head(head: dict[str, Any], data: list[bytes]) -> bytes:
    text = json.dumps(head, separators=(",", ":")).encode()
    return b"".join([_LENGTH.pack(len(text)), text, *data])


def decode_step(payload: bytes) -> StepInputs | None:
    """The `StepInputs` (None: stop) `payload` encodes; `StepDecodeError` if it is not one."""
    from .model_runner import StepInputs  # model_runner imports distributed, which this serves

    if len(payload) < _LENGTH.size:
        raise StepDecodeError("step message shorter than its length prefix")
    (n,) = _LENGTH.unpack_from(payload)
    at = _LENGTH.size + n
    if at > len(payload):
        raise StepDecodeError("step message shorter than its head")
    try:
        head = json.loads(payload[_LENGTH.size : at].decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise StepDecodeError(f"step head is not JSON: {e}") from e
    if head == {"stop": True}:
        if at != len(payload):
            raise StepDecodeError("stop message with trailing bytes")
        return None
    if not isinstance(head, dict) or set(head) != _HEAD_KEYS or head["stop"] is not False:
        raise StepDecodeError("step head has the wrong fields")
    ints = head["ints"]
    if not isinstance(ints, dict) or set(ints) != set(INTS):
        raise StepDecodeError("step head: wrong plain fields")
    for name in INTS:
        _check_count(ints[name], name)
    copies = head["blocks_to_copy"]
    if not isinstance(copies, list) or not all(isinstance(c, list) and len(c) == 2 for c in copies):
        raise StepDecodeError("step head: blocks_to_copy is not a list of pairs")
    for pair in copies:
        for block in pair:
            _check_count(block, "blocks_to_copy")
    shapes = head["shapes"]
    if not isinstance(shapes, dict) or set(shapes) != set(TENSORS):
        raise StepDecodeError("step head: wrong tensor fields")

    tensors: dict[str, torch.Tensor | None] = {}
    for name, (dtype, ndim, optional) in TENSORS.items():
        shape = shapes[name]
        if shape is None:
            if not optional:
                raise StepDecodeError(f"step field {name} is missing")
            tensors[name] = None
            continue
        if not isinstance(shape, list) or len(shape) != ndim:
            raise StepDecodeError(f"step field {name}: shape {shape!r} is not {ndim}-d")
        for dim in shape:
            _check_count(dim, f"{name} shape")
        size = math.prod(shape) * dtype.itemsize
        if at + size > len(payload):
            raise StepDecodeError(f"step message ends inside {name}")
        tensors[name] = _tensor(payload[at : at + size], dtype, shape, name)
        at += size
    if at != len(payload):
        raise StepDecodeError("step message has trailing bytes")
    padded = [tensors[name] is not None for name, (_, _, opt) in TENSORS.items() if opt]
    if any(padded) and not all(padded):
        raise StepDecodeError("step has some padded layouts but not all")
    _check_shapes(tensors)

    meta = AttentionMetadata(
        **{name: tensors[name] for name in TENSORS if name not in STEP_TENSORS},
        **{name: ints[name] for name in INTS},
    )
    return StepInputs(
        input_ids=tensors["input_ids"],
        positions=tensors["positions"],
        meta=meta,
        blocks_to_copy=[(s, d) for s, d in copies],
        logit_rows=tensors["logit_rows"],
    )


def _check_count(value: object, what: str) -> None:
    # bool is an int to Python, never a count here.
    if type(value) is not int or value < 0:
        raise StepDecodeError(f"step field {what}: {value!r} is not a non-negative int")


def _tensor(data: bytes, dtype: torch.dtype, shape: list[int], name: str) -> torch.Tensor:
    if not data:
        return torch.empty(shape, dtype=dtype)
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    if dtype == torch.bool and int(raw.max()) > 1:
        raise StepDecodeError(f"step field {name}: bytes other than 0 and 1 in a bool tensor")
    return raw.view(dtype).reshape(shape)


def _check_shapes(t: dict[str, torch.Tensor | None]) -> None:
    """The sizes the model's forward pass relies on agree with one another."""
    tokens = t["input_ids"].shape[0]
    seqs = t["context_lens"].shape[0]
    if t["positions"].shape[0] != tokens or t["slot_mapping"].shape[0] != tokens:
        raise StepDecodeError("step fields disagree on the number of tokens")
    if t["block_tables"].shape[0] != seqs or t["query_start_loc"].shape[0] != seqs + 1:
        raise StepDecodeError("step fields disagree on the number of sequences")
