"""An llmsim process for a test (moved to ``loadlab.simulator``)."""

from loadlab.simulator import PROFILES_DIR, REPO_ROOT, Simulator, profile_path, running_simulator

__all__ = ["PROFILES_DIR", "REPO_ROOT", "Simulator", "profile_path", "running_simulator"]
