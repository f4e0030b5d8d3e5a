# make demo  - install the runtime only into .venv and generate text with the built-in demo model (offline)
# make test  - install the pinned test environments and run the suite on Python 3.11 and, where present,
#              on Python >= 3.12 with the newest jax
SHELL := /bin/bash
PYTHON ?= python3
# The first interpreter >= 3.12 that actually runs (a pyenv shim may exist for a version that is not active).
PY312 ?= $(shell for p in $$(ls -d $$HOME/.pyenv/versions/3.12*/bin/python3 2>/dev/null) $$(command -v python3.12); do \
	"$$p" -c 'import sys; assert sys.version_info >= (3, 12)' 2>/dev/null && echo "$$p" && break; done)
export JAX_PLATFORMS ?= cpu

.PHONY: demo test test311 test312 install install-runtime check-packaging

install-runtime:
	test -x .venv/bin/python || $(PYTHON) -m venv .venv
	.venv/bin/pip install -q -r requirements/py311.txt -e .

install:
	test -x .venv/bin/python || $(PYTHON) -m venv .venv
	.venv/bin/pip install -q -r requirements/test-py311.txt -e .

demo: install-runtime
	.venv/bin/paged generate --max-tokens 48 "Return the number of" "This module provides"

# The accelerator extras resolve against the registry (a dry run: metadata, no wheels).
check-packaging: install-runtime
	.venv/bin/python requirements/check_packaging.py runtime
	.venv/bin/python requirements/check_packaging.py extras

test311: install
	.venv/bin/python -m pytest -q -ra

test312:
	@if [ -z "$(PY312)" ]; then echo "no Python >= 3.12 on this machine: skipping the newest-jax run"; exit 0; fi; \
	set -e; test -x .venv312/bin/python || $(PY312) -m venv .venv312; \
	.venv312/bin/pip install -q -r requirements/test-py312.txt -e .; \
	.venv312/bin/python -m pytest -q -ra

test: test311 test312
