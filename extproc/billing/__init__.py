"""Streaming billing: charge output tokens while a response streams, and cut it off cleanly.

``sse`` reassembles Server-Sent Events from arbitrarily split body messages while keeping
every original byte, so what the client receives is exactly what the upstream sent (minus
events billing chooses to drop, plus the cut-off events it appends).
"""
