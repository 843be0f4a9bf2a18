"""Free ports and child processes stopped by PID (moved to ``loadlab.procs``)."""

from loadlab.procs import ManagedProcess, free_port, free_port_run

__all__ = ["ManagedProcess", "free_port", "free_port_run"]
