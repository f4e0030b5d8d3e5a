# make demo  - install the runtime only into .venv and generate text with the built-in demo model (offline)
# make test  - install the pinned test environments and run the suite on Python 3.11, the third-party clients
#              in their own environment (tests/clients), and, where present, the jax-dependent part
#              (JAX_VERSION_TESTS) on Python >= 3.12 with the newest jax
SHELL := /bin/bash
PYTHON ?= python3
# The first interpreter >= 3.12 that actually runs (a pyenv shim may exist for a version that is not active).
PY312 ?= $(shell for p in $$(ls -d $$HOME/.pyenv/versions/3.12*/bin/python3 2>/dev/null) $$(command -v python3.12); do \
	"$$p" -c 'import sys; assert sys.version_info >= (3, 12)' 2>/dev/null && echo "$$p" && break; done)
export JAX_PLATFORMS ?= cpu

.PHONY: demo test test311 test312 test-clients install install-runtime install-clients install312 check-packaging

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

# The slowest tests stay in view: CI prints them, against its 45-minute budget.
PYTEST_ARGS ?= -q -ra --durations=30
# The suite spends its time compiling on one core, so two worker processes (pytest-xdist) nearly halve it on a
# 2-core machine. Whole files go to one worker, so a module's fixtures are built once.
PYTEST_WORKERS ?= 2
PARALLEL_ARGS := -n $(PYTEST_WORKERS) --dist loadfile
# The newest jax runs what depends on the jax version: the kernels and their lowering, the models' layers and
# matmul backends, sharding (the core tensor-parallel cases), several processes, the jitted step and sampler,
# the compilation cache and the backends end to end. The rest (HTTP, scheduling, parsing, deployment, docs, the
# per-family tensor-parallel runs) is the same Python on both.
TP := tests/paged/test_tensor_parallel.py
JAX_VERSION_TESTS := tests/pallas_kernels tests/models/test_linear.py tests/models/test_layers.py \
	tests/models/test_moe.py tests/models/test_attention_registry.py tests/paged/test_runner.py \
	tests/paged/test_sampler.py tests/paged/test_multihost.py tests/paged/test_pallas_backend.py \
	tests/paged/test_kv_cache_dtype.py tests/paged/test_compilation_cache.py tests/paged/test_testing.py \
	tests/models/test_bert.py \
	$(TP)::test_tensor_parallel_gives_the_tokens_of_one_device $(TP)::test_fewer_kv_heads_than_devices_replicates_them \
	$(TP)::test_bfloat16_pool_writes_per_shard_match_xla $(TP)::test_an_fp8_pool_splits_over_its_kv_heads \
	tests/benchmarks/test_gpu_check.py tests/benchmarks/test_kernels_benchmark.py \
	tests/benchmarks/test_tpu_first_run.py tests/models/test_orbax_checkpoint.py

# The TPU kernels under jax's TPU interpreter (minutes of emulation) run on the newest jax only (test312), as
# TPU users run the newest jax; their lowering to Mosaic is checked on both.
test311: install
	.venv/bin/python -m pytest $(PARALLEL_ARGS) $(PYTEST_ARGS) --ignore=tests/clients -m "not tpu_interpreter"

# Third-party clients (instructor, langchain-openai, litellm, openai's parse helpers) against `paged serve`, in
# an environment of their own: they pin their dependencies (openai, jiter) apart from the test environment's.
install-clients:
	test -x .venv-clients/bin/python || $(PYTHON) -m venv .venv-clients
	.venv-clients/bin/pip install -q -r requirements/clients.txt -e .

test-clients: install-clients
	.venv-clients/bin/python -m pytest $(PYTEST_ARGS) tests/clients

install312:
	@if [ -z "$(PY312)" ]; then echo "no Python >= 3.12 on this machine: skipping the newest-jax environment"; exit 0; fi; \
	set -e; test -x .venv312/bin/python || $(PY312) -m venv .venv312; \
	.venv312/bin/pip install -q -r requirements/test-py312.txt -e .

test312: install312
	@if [ -z "$(PY312)" ]; then echo "no Python >= 3.12 on this machine: skipping the newest-jax run"; exit 0; fi; \
	.venv312/bin/python -m pytest $(PARALLEL_ARGS) $(PYTEST_ARGS) $(JAX_VERSION_TESTS)

# The other two environments install while the 3.11 suite runs (pip mostly waits on downloads, the suite on
# the CPU); their log is shown if they fail. Then the clients and the newest jax run.
test: install
	@$(MAKE) --no-print-directory install-clients install312 > .install-others.log 2>&1 & others=$$!; \
	$(MAKE) --no-print-directory test311; status=$$?; \
	if ! wait $$others; then cat .install-others.log; echo "installing the clients' or 3.12 environment failed"; exit 1; fi; \
	test $$status = 0 || exit $$status; \
	$(MAKE) --no-print-directory test-clients test312
