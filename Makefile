# Two commands on a fresh machine:  `make run` (the demo job)  and  `make test` (the test suite).
# Each creates .venv and installs what it needs the first time.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# nvcc on PATH makes mpi4jax's build look for CUDA headers in the wrong place; point it at the toolkit.
export CUDA_PATH ?= /usr/local/cuda

.PHONY: run test lint bench clean

$(VENV)/.stamp-base: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e .
	touch $@

$(VENV)/.stamp-dev: $(VENV)/.stamp-base
	$(PIP) install -q -e '.[dev,hf]'
	touch $@

run: $(VENV)/.stamp-base
	$(PY) -m jonebit.demo

test: $(VENV)/.stamp-dev
	$(PY) -m pytest -q

lint: $(VENV)/.stamp-dev
	$(VENV)/bin/ruff check .

bench: $(VENV)/.stamp-base
	$(PY) benchmarks/comm_bytes.py
	$(PY) benchmarks/step_cost.py

clean:
	rm -rf $(VENV)
