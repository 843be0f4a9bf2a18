"""``extproc bench`` is wired lazily: the processor never loads the lab's tools or their
dependencies."""

from __future__ import annotations

import subprocess
import sys

from tests.tools.conftest import ROOT


def python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )


def test_serving_imports_neither_the_tools_nor_matplotlib() -> None:
    # (structlog itself imports rich when it is installed, for its dev console renderer.)
    done = python(
        "import sys, extproc.app.cli, extproc.app.server\n"
        "print([m for m in ('loadlab', 'matplotlib') if m in sys.modules])"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_processor_runs_without_rich_and_matplotlib() -> None:
    done = python(
        "import sys\n"
        "sys.modules['rich'] = sys.modules['matplotlib'] = None  # not installed\n"
        "import extproc.app.server\n"
        "from extproc.app.cli import main\n"
        "raise SystemExit(main(['check-config', 'stack/quota.yaml']))"
    )
    assert done.returncode == 0, done.stderr
    assert '"config_hash"' in done.stdout


def test_bench_without_the_lab_says_so_in_one_line() -> None:
    done = python(
        "import sys\n"
        "sys.modules['matplotlib'] = None  # as if the lab weren't installed\n"
        "from extproc.app.cli import main\n"
        "raise SystemExit(main(['bench', 'benchmarks/scenarios/quick.yaml']))"
    )
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "extproc bench: needs the lab distribution (matplotlib missing): "
        "pip install ./lab (token-quota-lab, in the repository)"
    )


def test_bench_is_listed_in_the_cli_help() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "extproc", "--help"], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0
    assert "bench" in done.stdout and "streaming-latency benchmark runs" in done.stdout
