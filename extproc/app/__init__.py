"""Orchestration: the CLI, the server and its workers, the runtime, configuration reload."""
