# Two commands on a fresh machine: `make demo` (set up + a GRPO run that visibly learns, configs/demo.yaml), `make test` (the suite).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# No GPU here: install the CPU torch wheel first, so nothing pulls a multi-GB CUDA build.
TORCH_CPU := torch==2.13.0

.PHONY: setup demo test clean

$(BIN)/grpoflow: pyproject.toml constraints-cpu.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1; then echo "GPU found: install your CUDA torch first (see README)"; \
	 else $(BIN)/pip install -q $(TORCH_CPU); fi
	$(BIN)/pip install -q -c constraints-cpu.txt -e '.[test]'
	touch $(BIN)/grpoflow

setup: $(BIN)/grpoflow

demo: setup
	$(BIN)/grpoflow run configs/demo.yaml

test: setup
	$(BIN)/python -m pytest -q tests

clean:
	rm -rf grpoflow-data .pytest_cache
