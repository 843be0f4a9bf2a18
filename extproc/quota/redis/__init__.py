"""The Redis backend: the RESP wire, Cluster and Sentinel topologies, the Lua scripts."""
