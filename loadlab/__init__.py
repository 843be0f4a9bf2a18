"""The load tools for the gateway, and the library the benchmarks and the tests stand on.

Part of the lab distribution (token-quota-lab, ``lab/pyproject.toml``), not the processor's:
the processor itself never imports this package.

* Tools: ``bench`` (``extproc bench``: ``scenario``, ``parts``, ``engine``, ``stats``,
  ``report``, ``plots``, ``compare``, ``quota_watch``), ``chaos`` (``extproc chaos``:
  ``chaos_scenario``, ``faults``, ``integrity``, ``chaos_plots``); both run in ``harness``
  and print with ``tables``.
* Launchers, stopped by PID: ``procs`` (free ports, ``ManagedProcess``, ``StopStack``),
  ``redis_server``, ``redis_cluster``, ``simulator``, ``gateway`` (processors, Envoy),
  ``rig`` (the benchmarks' processors, configs and Envoy variants), ``noop_processor``.
* Clients and load: ``client`` (timed raw-socket SSE), ``sse_client`` (the exact bytes),
  ``wire`` and ``grpc_load`` (playing Envoy on the processor's gRPC stream), ``prompts``.
* Readings: ``machine`` (pinning, /proc CPU and memory), ``metrics`` (a /metrics page),
  ``figures`` (the one percentile, ratios, plain-text tables).
"""
