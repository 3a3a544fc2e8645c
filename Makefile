# Developer and CI entry points. `make test` is what .ci/run runs.
#
# `pytest` and `python -m pytest` both work from the repository root: the tests import
# only `splitserve.*` (importlib mode), and no top-level folder shadows a module they
# use (operator/ has no __init__.py; tests/unit/test_layout.py checks). Exit code 5
# (no tests collected) fails the target like any other failure.

PYTHON ?= python3
PYTEST_ARGS ?=

.PHONY: test install

install:
	PYTHON=$(PYTHON) bash scripts/install-test-deps.sh

test: install
	pytest -p no:cacheprovider -m "not gpu" tests/ $(PYTEST_ARGS)
