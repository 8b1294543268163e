# The two commands: `make bench` (set up, run the default sweep, write the report) and
# `make test` (set up, lint, run every test). Both create .venv on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build this machine's pip serves; GPU users: make TORCH_SPEC=torch bench
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: bench test lint setup clean gpu-wheels gpu-check

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[dev]" "$(TORCH_SPEC)"
	touch $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check strategies harness tests
	$(BIN)/ruff format --check strategies harness tests

test: lint
	$(BIN)/python -m pytest -q tests

bench: $(STAMP)
	$(BIN)/python -m harness.bench

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
