#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite: lint, then pytest against real Envoy,
# redis-server, the simulator and the processor. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/lint-imports  # the layer contracts in pyproject.toml: no import back up
.venv/bin/mypy  # extproc/ in strict mode ([tool.mypy] in pyproject.toml)
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
