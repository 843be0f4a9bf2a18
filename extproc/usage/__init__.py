"""The usage ledger's tools: ``extproc usage export`` and ``extproc usage summary``."""
