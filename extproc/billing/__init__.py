"""Streaming billing: charge output tokens while a response streams, and cut it off cleanly.

``meter`` runs one response message by message (decode, reassemble, count, forward what the
lease covers, cut where it doesn't); ``leasing`` reserves its output ahead of delivery and
``settlement`` bills and commits it, once. ``sse`` reassembles Server-Sent Events from
arbitrarily split body messages while keeping every original byte, so what the client
receives is exactly what the upstream sent (minus events billing chooses to drop, plus the
cut-off events ``closing`` appends). ``output`` decides what counts as output, ``answer``
reads answers whole and holds the billing rule, ``decoding`` and ``sniff`` tell what a body is.
"""
