# Everything a fresh machine needs: `make run` (the main job) and `make test`.
# Both create .venv and install the project if missing, and generate the
# default model if missing.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
TINY := models/tiny
SMOLLM := models/smollm-135m

.PHONY: run test lint bench install models clean

install: $(STAMP)

# The lab (lab/: the fleet simulator and research benchmarks, `pagefleet-lab`) is
# development only: installed here beside the product, never part of its wheel.
$(STAMP): pyproject.toml lab/pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	$(BIN)/python -m pip install --quiet --no-deps -e ./lab
	touch $(STAMP)

$(TINY)/model.safetensors: | $(STAMP)
	$(BIN)/pagefleet make-model $(TINY) --preset tiny

$(SMOLLM)/model.safetensors: | $(STAMP)
	$(BIN)/pagefleet make-model $(SMOLLM) --preset smollm-135m

models: $(TINY)/model.safetensors

# The main job: serve the built-in tiny model (written on first use) on an embedded Ray,
# OpenAI-compatible at http://127.0.0.1:8000/v1 until Ctrl-C.
run: $(STAMP)
	$(BIN)/pagefleet serve configs/local.yaml

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python tools/lint_imports.py

# tools/lint_imports.py: import-linter's contracts (pyproject.toml, [tool.importlinter]):
# cluster > engine > kernels, an engine surface that loads no torch, and a product that
# never imports the lab.
test: $(STAMP) $(TINY)/model.safetensors
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python tools/lint_imports.py
	$(BIN)/python -m pytest -q --durations=15

bench: $(STAMP) $(SMOLLM)/model.safetensors
	$(BIN)/pagefleet-lab kv-waste
	$(BIN)/pagefleet bench offline --model $(SMOLLM)
	$(BIN)/pagefleet-lab prefix --model $(SMOLLM)
	$(BIN)/pagefleet-lab sharing --model $(SMOLLM)

clean:
	rm -rf $(VENV) models .pytest_cache .ruff_cache *.egg-info
