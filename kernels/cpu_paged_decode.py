"""The CPU decode-attention kernel (`cpu_paged_decode.c`): built once per machine, called by pointer.

The C source ships with the package and is compiled with the system's gcc on
first use (`-O3 -march=native -fopenmp`: the CPU's own vector units; see `COMPILE_FLAGS`), into a
cache folder keyed by the source, the flags and the CPU's feature flags, so a
second process (another replica, a restart) loads it in milliseconds. Where no
compiler is found or the build fails, `decode_kernel()` returns None once, says
why in the log, and the torch path serves (`paged_attention.py`).

Why C and not torch: every torch formulation of paged decode gathers the
context out of the cache before attending over it, which triples the memory
traffic of what is, at long contexts, a memory-bound step (BENCHMARKS.md, the
step profile). Why ctypes and not a torch C++ extension: the kernel needs no
torch headers, so it builds in about a second instead of a minute; ctypes
releases the GIL for the call.
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

SOURCE = Path(__file__).with_name("cpu_paged_decode.c")
# Compiled with -ffast-math (vectorised reductions and expf), but linked without it: linked
# with it, gcc adds crtfastmath.o, whose constructor turns on flush-to-zero for the whole
# process when the library loads (torch's and Python's floats too).
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11")
LINK_FLAGS = ("-shared", "-fopenmp")
# Where built kernels are kept; PAGEFLEET_KERNEL_CACHE moves it.
CACHE_ENV = "PAGEFLEET_KERNEL_CACHE"
# The dtypes the kernel has entry points for (others take the torch path).
_SYMBOLS = {torch.float32: "paged_decode_f32", torch.bfloat16: "paged_decode_bf16"}
_build_lock = threading.Lock()


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
    """The built library's path: one per source, flags, compiler and CPU."""
    key = hashlib.sha256()
    flags = " ".join((*COMPILE_FLAGS, "|", *LINK_FLAGS))
    for part in (SOURCE.read_bytes(), flags.encode(), compiler.encode()):
        key.update(part)
    key.update(_cpu_flags().encode())
    return cache_dir() / f"paged_decode-{key.hexdigest()[:16]}.so"


def _build(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target, then rename: replicas starting together never load half a file.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built, obj = Path(tmp) / target.name, Path(tmp) / "kernel.o"
        for command in (
            [compiler, *COMPILE_FLAGS, "-c", str(SOURCE), "-o", str(obj)],
            [compiler, *LINK_FLAGS, str(obj), "-o", str(built), "-lm"],
        ):
            subprocess.run(command, check=True, capture_output=True, text=True, timeout=120)
        os.replace(built, target)


@cache
def _library() -> ctypes.CDLL | None:
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        log.warning("no C compiler found: CPU decode attention takes the torch path")
        return None
    target = library_path(compiler)
    try:
        with _build_lock:
            if not target.exists():
                _build(compiler, target)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or e
        log.warning("the CPU decode kernel did not build (%s): the torch path serves", detail)
        return None
    for name in _SYMBOLS.values():
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = [
            ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,  # q, its row strides
            ctypes.c_void_p, ctypes.c_void_p,  # k_cache, v_cache
            ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,  # tables, stride, contexts
            ctypes.c_void_p,  # out
            ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
            ctypes.c_float, ctypes.c_int,
        ]  # fmt: skip
    return lib


def available(dtype: torch.dtype) -> bool:
    """Whether decodes of this dtype will read the cache in place (building the kernel now)."""
    return dtype in _SYMBOLS and _library() is not None


def supports(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the kernel can serve this layer's decodes (and is built)."""
    return (
        query.device.type == "cpu"
        and query.dtype in _SYMBOLS
        and k_cache.dtype == query.dtype
        and k_cache.is_contiguous()
        and query.stride(-1) == 1
        and _library() is not None
    )


def paged_decode(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]: one token per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [>= num_seqs, max_blocks] int32
    context_lens: torch.Tensor,  # [>= num_seqs] int32
    scale: float,
    out: torch.Tensor,  # [num_seqs, num_heads, head_dim], contiguous: written
) -> None:
    """Attend each sequence's one query over its cached context, in place in the cache."""
    lib = _library()
    assert lib is not None, "call supports() first"
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert block_tables.dtype == torch.int32 and context_lens.dtype == torch.int32
    assert block_tables.stride(-1) == 1 and context_lens.is_contiguous() and out.is_contiguous()
    assert v_cache.is_contiguous() and v_cache.shape == k_cache.shape
    failed = getattr(lib, _SYMBOLS[query.dtype])(
        query.data_ptr(), query.stride(0), query.stride(1),
        k_cache.data_ptr(), v_cache.data_ptr(),
        block_tables.data_ptr(), block_tables.stride(0), context_lens.data_ptr(),
        out.data_ptr(),
        num_seqs, num_heads, num_kv_heads, head_dim, block_size,
        scale, torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise MemoryError("the CPU decode kernel could not allocate its score buffer")
