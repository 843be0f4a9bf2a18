"""The local stack: Envoy, simulators, Redis and the processor, started together."""
