#!/usr/bin/env bash
# The GPU check of the kernels issue, for a machine with a CUDA GPU (H200 here): under 8 minutes.
# Installs the project, writes the two checkpoints, then runs cluster/bench/gpu_check.py.
set -euo pipefail
cd "$(dirname "$0")/.."
test -x .venv/bin/python || python3 -m venv .venv
.venv/bin/pip install -q -e ".[dev]"
test -f models/smollm-135m/model.safetensors || .venv/bin/pagefleet make-model models/smollm-135m --preset smollm-135m
test -f models/llama-1b/model.safetensors || .venv/bin/pagefleet make-model models/llama-1b --preset llama-1b
nvidia-smi --query-gpu=name,memory.total --format=csv
.venv/bin/python -m pagefleet.cluster.bench.gpu_check "$@"
