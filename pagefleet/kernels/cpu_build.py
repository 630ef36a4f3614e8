"""The CPU kernels' C library: built once per machine, loaded by ctypes.

The C sources ship with the package (the attention kernels `cpu_paged_decode.c`,
`cpu_paged_prefill.c`, `cpu_scalar.h`; the decode GEMM `cpu_panel_gemm.c` and its tile
`cpu_panel_tile.h`; the grouped experts `cpu_moe.c`) and
are compiled with the system's gcc on first use (`-O3 -march=native -fopenmp`:
the CPU's own vector units; see `COMPILE_FLAGS`) into one library, in a cache
folder keyed by the sources, the flags and the CPU's feature flags, so a second
process (another replica, a restart) loads it in milliseconds. Where no
compiler is found or the build fails, `library()` returns None once, says why
in the log, and the torch path (`paged_attention.py`) and oneDNN's GEMMs
(`layers/cpu_gemm.py`) serve.

Why ctypes and not a torch C++ extension: the kernels need no torch headers, so
they build in a second or two instead of a minute; ctypes releases the GIL for
the call.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from functools import cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCES = tuple(
    Path(__file__).with_name(n)
    for n in ("cpu_paged_decode.c", "cpu_paged_prefill.c", "cpu_panel_gemm.c", "cpu_moe.c")
)
HEADERS = tuple(Path(__file__).with_name(n) for n in ("cpu_scalar.h", "cpu_panel_tile.h"))
# Compiled with -ffast-math (vectorised reductions and expf), but linked without it: linked
# with it, gcc adds crtfastmath.o, whose constructor turns on flush-to-zero for the whole
# process when the library loads (torch's and Python's floats too).
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11")
LINK_FLAGS = ("-shared", "-fopenmp")
# Where built kernels are kept; PAGEFLEET_KERNEL_CACHE moves it.
CACHE_ENV = "PAGEFLEET_KERNEL_CACHE"
_build_lock = threading.Lock()

_P, _I64, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
# The entry points' C signatures (each returns non-zero when a buffer could not be allocated).
_DECODE_ARGS = [
    _P, _I64, _I64,  # q, its row strides
    _P, _P,  # k_cache, v_cache
    _P, _I64, _P,  # tables, their row stride, contexts
    _P,  # out
    _I, _I, _I, _I, _I,  # num_seqs, num_heads, num_kv_heads, head_dim, block_size
    _F, _I, _F,  # scale, sliding window (0: none), logit soft-cap (0: none)
    _P, _I,  # sinks (NULL: none), num_threads
]  # fmt: skip
_PREFILL_ARGS = [
    _P, _I64, _I64,  # q, its row strides
    _P, _P,  # k_cache, v_cache
    _P, _P, _P,  # the chunks' starts, lengths, cached tokens
    _P, _I64,  # their tables, the tables' row stride
    _P,  # out
    _I, _I, _I, _I, _I,  # num_chunks, num_heads, num_kv_heads, head_dim, block_size
    _F, _I, _F,  # scale, sliding window (0: none), logit soft-cap (0: none)
    _P, _I,  # sinks (NULL: none), num_threads
]  # fmt: skip
_PANEL_GEMM_ARGS = [
    _P, _I64,  # x, its row stride
    _P, _P,  # packed weight, bias (or NULL)
    _P, _I64,  # y, its row stride
    _I, _I, _I, _I,  # m, n, k, num_threads
]  # fmt: skip
_MOE_ARGS = [
    _P, _I64,  # x, its row stride
    _P, _P,  # topk_ids (int64), topk_weights (fp32), [tokens, top_k]
    _P, _I64, _P, _I64,  # gate/up panels, their per-expert stride; down panels, likewise
    _P, _I64, _P, _I64,  # gate/up biases (or NULL), their per-expert stride; down's, likewise
    _P,  # out
    _I, _I, _I, _I, _I,  # tokens, top_k, experts, hidden, inter
    _I, _F, _F,  # the gated unit (cpu_moe.UNITS), its limit and alpha
    _I,  # num_threads
]  # fmt: skip
# name: (return type, argument types); an int return is non-zero on failure.
SIGNATURES: dict[str, tuple[type | None, list[type]]] = {
    "paged_decode_f32": (_I, _DECODE_ARGS),
    "paged_decode_bf16": (_I, _DECODE_ARGS),
    "paged_prefill_f32": (_I, _PREFILL_ARGS),
    "paged_prefill_bf16": (_I, _PREFILL_ARGS),
    "attention_bf16_pairs": (_I, []),
    "panel_gemm_supported": (_I, []),
    "panel_gemm_panel_width": (_I, []),
    "panel_gemm_packed_floats": (_I64, [_I, _I]),
    "panel_gemm_pack_f32": (None, [_P, _P, _I, _I]),
    "panel_gemm_f32": (_I, _PANEL_GEMM_ARGS),
    "panel_gemm_bf16_supported": (_I, []),
    "panel_gemm_packed_bf16": (_I64, [_I, _I]),
    "panel_gemm_pack_bf16": (None, [_P, _P, _I, _I]),
    "panel_gemm_bf16": (_I, _PANEL_GEMM_ARGS),
    "moe_gated_experts_f32": (_I, _MOE_ARGS),
    "moe_gated_experts_bf16": (_I, _MOE_ARGS),
}


def cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "pagefleet" / "kernels"
    return Path(root)


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def library_path(compiler: str) -> Path:
    """The built library's path: one per sources, headers, flags, compiler and CPU."""
    key = hashlib.sha256()
    flags = " ".join((*COMPILE_FLAGS, "|", *LINK_FLAGS))
    sources = (s.read_bytes() for s in (*SOURCES, *HEADERS))
    for part in (*sources, flags.encode(), compiler.encode()):
        key.update(part)
    key.update(_cpu_flags().encode())
    return cache_dir() / f"cpu_kernels-{key.hexdigest()[:16]}.so"


def _build(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target, then rename: replicas starting together never load half a file.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        objects = [str(Path(tmp) / f"{source.stem}.o") for source in SOURCES]
        built = Path(tmp) / target.name
        commands = [
            [compiler, *COMPILE_FLAGS, "-c", str(source), "-o", obj]
            for source, obj in zip(SOURCES, objects, strict=True)
        ]
        commands.append([compiler, *LINK_FLAGS, *objects, "-o", str(built), "-lm"])
        for command in commands:
            subprocess.run(command, check=True, capture_output=True, text=True, timeout=120)
        os.replace(built, target)


# The dtypes the kernels have entry points for (others take the torch path).
DTYPES = (torch.float32, torch.bfloat16)


def reads_in_place(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """What both kernels need of a layer's tensors (and that the library is built)."""
    return (
        query.device.type == "cpu"
        and query.dtype in DTYPES
        and k_cache.dtype == query.dtype
        and k_cache.is_contiguous()
        and query.stride(-1) == 1
        and library() is not None
    )


def attention_bf16_pairs() -> bool:
    """Whether the attention kernels multiply bf16 as bf16 pairs (AVX512-BF16) on this
    build; elsewhere they widen bf16 to fp32."""
    lib = library()
    return lib is not None and bool(lib.attention_bf16_pairs())


@cache
def library() -> ctypes.CDLL | None:
    """The loaded library, built first if this machine has none; None where it cannot be."""
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        log.warning("no C compiler found: CPU attention takes the torch path, GEMMs oneDNN's")
        return None
    target = library_path(compiler)
    try:
        with _build_lock:
            if not target.exists():
                _build(compiler, target)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or e
        log.warning("the CPU kernels did not build (%s): torch and oneDNN serve", detail)
        return None
    for name, (restype, argtypes) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes
    return lib
