# The processor image: `pip install .` of pyproject.toml on Python 3.11, the install README.md
# ("Deploying") documents, and nothing else: the processor (extproc/) alone, no simulator,
# no load tools, no test extras, no tests. Envoy runs in its own container; deploy/ holds
# the compose file and Kubernetes manifests that run it.
#   docker build -t token-quota-extproc:0.1.0 .
# tests/deploy/test_docker_context.py checks every COPY source survives .dockerignore and
# runs this install in a clean venv from exactly the files the build context holds.
# 3.11.7 is the interpreter the test suite runs on; bump it with the suite.
FROM python:3.11.7-slim-bookworm

WORKDIR /app
COPY pyproject.toml README.md ./
COPY extproc ./extproc
# xds-protos ships a stale copy of opentelemetry-proto's modules (grpc/grpc#42926): put the
# real ones back (the OTLP span exporter needs them; a no-op when they are there).
RUN pip install --no-cache-dir . \
    && pip install --no-cache-dir --force-reinstall --no-deps "$(pip freeze | grep '^opentelemetry-proto==')" \
    && groupadd --system --gid 10001 extproc \
    && useradd --system --uid 10001 --gid 10001 --no-create-home extproc
# Numeric, so Kubernetes' runAsNonRoot can check it.
USER 10001:10001

LABEL org.opencontainers.image.title="token-quota-extproc" \
      org.opencontainers.image.version="0.1.0"
EXPOSE 50051 9464
ENTRYPOINT ["extproc"]
CMD ["serve", "--config", "/etc/extproc/quota.yaml", "--listen", "0.0.0.0:50051", \
     "--metrics-listen", "0.0.0.0:9464"]
