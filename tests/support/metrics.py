"""Read a processor's /metrics text (moved to ``loadlab.metrics``)."""

from loadlab.metrics import parse_metrics

__all__ = ["parse_metrics"]
