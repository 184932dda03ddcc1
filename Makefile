# Two commands on a fresh machine: `make demo` (install + main job) and `make test` (install + tests).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export HF_HUB_OFFLINE := 1

.PHONY: install demo test

$(BIN)/featcal: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# The CPU wheel of torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
	$(BIN)/pip install --quiet "torch==2.13.0"
	$(BIN)/pip install --quiet -e ".[test]"
	touch $@

install: $(BIN)/featcal

demo: install
	$(BIN)/featcal example build examples/tiny
	$(BIN)/featcal run configs/example.yaml --run-dir runs/example

test: install
	$(BIN)/python -m pytest -q
