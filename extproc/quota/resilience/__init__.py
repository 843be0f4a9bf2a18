"""Redis faults: per-shard breakers, a fail-open allowance, a queue for what waits."""
