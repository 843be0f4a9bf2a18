# The processor as a sidecar image. Envoy runs in its own container next to it; the
# bootstrap in envoy_config/ points its quota_extproc cluster at this container's port.
FROM python:3.11-slim

WORKDIR /app
COPY pyproject.toml README.md ./
COPY extproc ./extproc
COPY llmsim ./llmsim
COPY stack ./stack
RUN pip install --no-cache-dir . \
    && useradd --system --uid 10001 extproc
USER extproc

EXPOSE 50051 9464
ENTRYPOINT ["extproc"]
CMD ["serve", "--config", "/etc/extproc/quota.yaml", "--listen", "0.0.0.0:50051", \
     "--metrics-listen", "0.0.0.0:9464"]
