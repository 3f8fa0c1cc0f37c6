# Two commands on a fresh machine: `make demo` (set up + a GRPO run that visibly learns, configs/demo.yaml), `make test` (the suite).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch is installed first, at the version constraints-cpu.txt pins. From the default index (PyPI) that is the
# CUDA build (about 3 GB with its libraries); for the small CPU build name an index that serves it, e.g.
#   make demo TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
TORCH := $(shell grep '^torch==' constraints-cpu.txt)

.PHONY: setup demo test bench-smoke clean

$(BIN)/grpoflow: pyproject.toml constraints-cpu.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1; then echo "GPU found: install your CUDA torch first (see README)"; \
	 else $(BIN)/pip install -q '$(TORCH)' $(if $(TORCH_INDEX),--index-url '$(TORCH_INDEX)'); fi
	$(BIN)/pip install -q -c constraints-cpu.txt -e '.[test]'
	touch $(BIN)/grpoflow

setup: $(BIN)/grpoflow

demo: setup
	$(BIN)/grpoflow run configs/demo.yaml

test: setup
	$(BIN)/python -m pytest -q -m "not bench" tests

# the bench scripts' CPU modes (bench/README.md): run before taking their GPU versions to a GPU machine
bench-smoke: setup
	$(BIN)/python -m pytest -q -m bench tests

clean:
	rm -rf grpoflow-data .pytest_cache
