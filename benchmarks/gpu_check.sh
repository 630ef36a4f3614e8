#!/usr/bin/env bash
# The GPU check (issue 10), for a machine with a CUDA GPU (an H200 here): kernels against
# the reference, greedy equality with transformers, TP=2 vs TP=1 where 2 GPUs exist, the
# decode kernel's share of memory bandwidth, offline throughput beside transformers.
# About 5 minutes on one H200 once installed (benchmarks/results/gpu.md, which it writes).
# Extra arguments go to the check (e.g. --skip offline, --models models/smollm-135m).
# PAGEFLEET_GPU_PYTHON=python3: use that interpreter's CUDA torch as it is (no .venv, no pip).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_check: no NVIDIA GPU visible (nvidia-smi -L failed)" >&2
  exit 2
fi
nvidia-smi --query-gpu=index,name,memory.total,memory.used,driver_version --format=csv
if [ -n "${PAGEFLEET_GPU_PYTHON:-}" ]; then
  # An interpreter whose torch already has CUDA, used as it is: a machine with no package
  # index (the project on PYTHONPATH, its own pins not applied; the report names the versions).
  py="$PAGEFLEET_GPU_PYTHON"
else
  test -x .venv/bin/python || python3 -m venv .venv
  # The project's torch pin from PyPI: on Linux x86_64 that wheel is the CUDA build.
  # (A .venv made by `make install` on a CPU machine has the CPU build: replace it.)
  if ! .venv/bin/python -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null; then
    .venv/bin/pip uninstall -y -q torch
    .venv/bin/pip install -q "torch==2.13.0" --index-url https://pypi.org/simple
  fi
  .venv/bin/pip install -q -e ".[dev]"
  py=.venv/bin/python
fi
"$py" -c "import torch, triton; assert torch.cuda.is_available(), 'torch sees no GPU'; \
print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'triton', triton.__version__)"
for preset in smollm-135m llama-1b; do
  test -f "models/$preset/model.safetensors" ||
    "$py" -m pagefleet.cli make-model "models/$preset" --preset "$preset"
done
echo "setup took $(( $(date +%s) - start )) s"
# The checks are tests (tests/gpu, `pytest -m gpu`), which the writer runs in-process
# beside the measurements. Compiled kernels: TRITON_INTERPRET=0, whatever a test shell
# (or tests/conftest.py, which defaults it to 1 for the CPU kernel tests) would set.
TRITON_INTERPRET=0 "$py" -m pagefleet_lab.bench.gpu_check "$@"
