# Set-up and main commands. `make demo` and `make test` work on a fresh clone:
# they create .venv if missing and install the project with the pinned CI constraints.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.aligner-installed
PYTEST_ARGS ?=

.PHONY: install test test-fast demo bench clean

$(STAMP): pyproject.toml constraints/ci.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade --quiet pip
	$(PY) -m pip install --quiet -c constraints/ci.txt -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

test: install
	OMP_NUM_THREADS=2 $(PY) -m pytest -q -ra --durations=15 $(PYTEST_ARGS) tests

test-fast: install
	OMP_NUM_THREADS=2 $(PY) -m pytest -q -ra -m "not slow and not distributed" $(PYTEST_ARGS) tests

demo: install
	OMP_NUM_THREADS=2 $(PY) examples/demo/run_demo.py --workdir results/demo

bench: install
	OMP_NUM_THREADS=2 $(PY) benchmarks/bridge_overhead.py

clean:
	rm -rf results
