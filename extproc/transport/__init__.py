"""gRPC transport: the ext_proc servicer (one stream per exchange, the idle watchdog) and TLS."""
