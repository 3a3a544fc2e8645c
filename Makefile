# Developer and CI entry points. `make test` is what .ci/run runs.
#
# pytest runs as the `pytest` command, not `python -m pytest`: the latter puts the
# repository root on sys.path, where `router/`, `services/` ... would shadow the
# installed layout that tests/unit/test_layout.py checks. Exit code 5 (no tests
# collected) fails the target like any other failure.

PYTHON ?= python3
PYTEST_ARGS ?=

.PHONY: test install

install:
	PYTHON=$(PYTHON) bash scripts/install-test-deps.sh

test: install
	pytest -p no:cacheprovider -m "not gpu" tests/ $(PYTEST_ARGS)
