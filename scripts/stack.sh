#!/usr/bin/env bash
# Set up (if needed) and start the local stack in the foreground: redis-server (or the
# in-memory backend), two simulators, the processor and Envoy. Ctrl-C stops everything.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m stack "$@"
