# `make test` and `make bench` set everything up from nothing: a venv, torch, the package.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
TORCH  := torch==2.13.0

.PHONY: test test-fast lint bench bench-quick docs bench-docs gpu-check clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e ".[test,cli,fp8]" "$(TORCH)"  # torch pinned: no extra may move it
	touch $@

test: $(VENV)/.installed
	$(PY) -m ruff check src tests benchmarks examples
	$(VENV)/bin/lint-imports
	OMP_NUM_THREADS=1 $(PY) -m pytest -n 2 --dist loadfile --no-loadscope-reorder --durations=25  # one test file per worker, both cores, the longest files first (tests/conftest.py); the 25 slowest listed

test-fast: $(VENV)/.installed
	OMP_NUM_THREADS=1 $(PY) -m pytest -n 2 --dist loadfile --no-loadscope-reorder -m "not slow and not distributed"

lint: $(VENV)/.installed
	$(PY) -m ruff check src tests benchmarks examples
	$(VENV)/bin/lint-imports  # the layers contract of pyproject.toml [tool.importlinter]

bench: $(VENV)/.installed
	$(VENV)/bin/ampkit bench

bench-quick: $(VENV)/.installed
	$(VENV)/bin/ampkit bench --quick

# The documentation site: warnings are errors, references to ampkit's API must resolve.
docs: $(VENV)/.installed
	OMP_NUM_THREADS=1 $(PY) -m sphinx -W --keep-going -n -b html docs docs/_build/html

# Record every benchmark's short docs run (one thread, docs/benchmarks/data/) and write
# the benchmark pages from it; `$(PY) benchmarks/docs_pages.py --render` only writes the pages.
bench-docs: $(VENV)/.installed
	OMP_NUM_THREADS=1 $(PY) benchmarks/docs_pages.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info docs/_build docs/reference/generated

# On a machine with a CUDA GPU, offline, with the machine's own python and torch (no venv):
# every level's smoke test, the cuda-marked tests, speed and memory, fp8; one JSON +
# markdown summary in gpu-check-out/ (the stages' time limits sum to 6 min 15 s). Refuses without a GPU.
gpu-check:
	PYTHONPATH=src $(PYTHON) benchmarks/gpu_check.py --out gpu-check-out
