"""Processor liveness: heartbeats, the index of open records, peers settling the dead."""
