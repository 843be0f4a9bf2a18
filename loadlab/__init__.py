"""Load tools for the gateway: ``extproc bench`` (streaming latency) and the parts it starts.

The launchers here (``procs``, ``gateway``, ``redis_server``, ``simulator``) are the ones the
tests use too (``tests/support`` re-exports them); the processor itself never imports this
package.
"""
