"""Token-aware quota enforcer: an Envoy ext_proc sidecar."""

__version__ = "0.1.0"
