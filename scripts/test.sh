#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite: lint, then pytest against real Envoy,
# redis-server, the simulator and the processor, in parallel by file (pytest-xdist).
#   bash scripts/test.sh            # the whole suite (what CI runs)
#   bash scripts/test.sh --fast     # the quick lane: unit, conformance and config tests
# Extra arguments go to pytest. EXTPROC_TEST_WORKERS sets the worker count (default 4:
# most tests wait on processes and sockets, so two cores carry four workers).
set -euo pipefail
cd "$(dirname "$0")/.."
FAST=0
if [ "${1:-}" = "--fast" ]; then
  FAST=1
  shift
fi
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/lint-imports  # the layer contracts in pyproject.toml: no import back up
.venv/bin/mypy  # extproc/ in strict mode ([tool.mypy] in pyproject.toml)
PYTEST=(.venv/bin/python -m pytest -q -p no:cacheprovider -n "${EXTPROC_TEST_WORKERS:-4}" --dist loadfile
  --no-loadscope-reorder)  # keep the costliest-first order of tests/conftest.py
if [ "$FAST" = 1 ]; then
  exec "${PYTEST[@]}" -m "not slow" tests/billing tests/admission tests/quota tests/config \
    tests/tokens tests/test_docs.py "$@"
fi
exec "${PYTEST[@]}" "$@"
