"""gRPC transport: the ext_proc service, its server, and the wire messages it speaks."""
