"""The in-process backend: the embedded default for a single processor."""
