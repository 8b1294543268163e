# The two commands: `make bench` (set up, run the bench sweep conf/sweep/bench.yaml, write the
# report) and `make test` (set up, lint, run every test tier). Both create .venv on a fresh
# machine. `make test-fast` is the edit-test loop: the unit tier and one small world test.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch CI installs; GPU users: make TORCH_SPEC=torch bench
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
# Byte-compile the venv's packages with a worker per core (files no Python 3 compiles, which
# some packages ship as test data, are skipped as pip skips them).
COMPILE_SITE := import compileall, sysconfig; compileall.compile_dir(sysconfig.get_paths()['purelib'], quiet=2, workers=0)

.PHONY: bench bench-gate test test-fast lint setup clean gpu-wheels gpu-check

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	# Debian's libibverbs1: the engines extra's Mooncake imports it (no RDMA device needed).
	if ! dpkg -s libibverbs1 >/dev/null 2>&1; then \
		if [ "$$(id -u)" = 0 ]; then apt-get update -qq \
			&& DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 >/dev/null; \
		else echo "libibverbs1 is missing and this is not root: strategy=mooncake will refuse"; fi; \
	fi
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q --no-compile "$(TORCH_SPEC)"
	# The transferqueue extra too (strategy=transferqueue, world=ray), so its tests run for
	# real: a pure-Python wheel plus ray[default]'s packages; and the engines extra (Mooncake).
	$(BIN)/python -m pip install -q --no-compile -e ".[dev,transferqueue,engines]" "$(TORCH_SPEC)"
	# verl's own DataProto and worker payload for the interop tests; its ray/transformers
	# imports are never used on that path (tests/verl_support.py), so no deps.
	$(BIN)/python -m pip install -q --no-compile --no-deps "verl==0.9.1"
	# The bytecode pip would have compiled on one core, compiled on every core: where
	# PYTHONDONTWRITEBYTECODE is set, imports only read .pyc files, never write them.
	$(BIN)/python -c "$(COMPILE_SITE)"
	touch $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check strategies harness tests examples
	$(BIN)/ruff format --check strategies harness tests examples
	$(BIN)/lint-imports

# tests/run_tiers.py: the benchmark gate (short mode) alone, leaving its pytest-benchmark JSON
# in results/ci/, then the infra tier (with the world tier's Ray tests) beside the unit and world
# tiers: the suite mostly waits, and two sessions fill two cores.
# `pytest tests` runs the same tests in one session.
test: lint
	BCASTBENCH_BENCH=short $(BIN)/python tests/run_tiers.py

# Unit tier (no process group) plus the one world test marked smoke.
test-fast: lint
	$(BIN)/python -m pytest -q tests/unit tests/world -m "unit or smoke"

# Full-length benchmarks, saved for `python -m pytest_benchmark compare`.
bench-gate: $(STAMP)
	BCASTBENCH_BENCH=full $(BIN)/python -m pytest tests/benchmarks --benchmark-enable \
		--benchmark-autosave

bench: $(STAMP)
	$(BIN)/bcastbench bench

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache

# Wheels a lent GPU machine (CPython 3.12, its own torch, no network) lacks; fetched here.
GPU_WHEELS := hydra-core==1.3.8 omegaconf==2.3.1 megatron-core==0.16.1 tensordict==0.15.3 \
	cloudpickle==3.1.3 packaging
gpu-wheels:
	mkdir -p wheels
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 --platform any -d wheels $(GPU_WHEELS)
	$(PY) -m pip wheel -q --no-deps -w wheels antlr4-python3-runtime==4.9.3 pyvers==0.2.3

# On a GPU machine: python3 (with its own torch) runs the CUDA checks; no .venv needed.
gpu-check:
	python3 -m harness bench target=gpu
