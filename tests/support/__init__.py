"""Helpers that start and stop the real parts tests talk to."""
