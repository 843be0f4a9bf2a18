"""Two distributions from one checkout: the processor's (``pyproject.toml``) holds ``extproc``
alone, the lab's (``lab/pyproject.toml``) the simulator, the load tools and the stack.

Both wheels are built from a copy of the whole checkout (the other packages sit next to
``extproc/`` while the product is built, as in a developer's clone), offline: the build
backend comes from a wheelhouse (``test_docker_context.backend``, skipped where no index
has it). They are installed, without their dependencies, into a fresh venv whose
dependencies are this venv's (a ``.pth`` line: this venv's editable installs stay off)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

from tests.deploy.test_docker_context import backend

ROOT = Path(__file__).resolve().parents[2]
LEFT_OUT = (".git", ".venv", "results", "build", "*.egg-info", "__pycache__", "*.pyc")
# Every console script of a distribution, loaded as the installed script would load it.
RESOLVE = """\
import importlib.metadata as md, sys
dist = md.distribution(sys.argv[1])
for ep in dist.entry_points.select(group="console_scripts"):
    target = ep.load()
    module = sys.modules[ep.module]
    assert callable(target) and module.__file__.startswith(sys.prefix), (ep, module.__file__)
    print(ep.name)
"""


def wheel_files(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as whl:
        return whl.namelist()


def package_files(*packages: str) -> set[str]:
    """What the checkout holds under ``packages``, as a wheel names it (no byte code)."""
    return {
        p.relative_to(ROOT).as_posix()
        for package in packages
        for p in (ROOT / package).rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    }


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("packaging")
    checkout = tmp / "checkout"
    shutil.copytree(ROOT, checkout, ignore=shutil.ignore_patterns(*LEFT_OUT))
    wheelhouse = tmp / "wheelhouse"
    wheelhouse.mkdir()
    backend(tomllib.loads((ROOT / "pyproject.toml").read_text()), wheelhouse)
    out = tmp / "wheels"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-index", "--find-links",
         str(wheelhouse), "--wheel-dir", str(out), ".", "./lab"],
        cwd=checkout, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return {w.name.split("-")[0]: w for w in out.glob("*.whl")}


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True, timeout=300)
    site = Path(sysconfig.get_paths(vars={"base": str(path), "platbase": str(path)})["purelib"])
    # The dependencies, from this venv's site-packages; its .pth files (the editable
    # installs of this checkout) are not read from a directory a .pth line adds.
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return path


def run(venv: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(venv / "bin" / argv[0]), *argv[1:]],
        cwd=venv, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def pip_install(venv: Path, wheel: Path) -> None:
    done = run(venv, "python", "-m", "pip", "install", "--no-deps", "--no-index", str(wheel))
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.slow
def test_the_product_wheel_holds_extproc_and_its_data_alone(wheels: dict[str, Path]) -> None:
    files = wheel_files(wheels["token_quota_extproc"])
    info = [f for f in files if f.startswith("token_quota_extproc-0.1.0.dist-info/")]
    assert sorted(set(files) - set(info)) == sorted(package_files("extproc"))
    assert any(f.startswith("extproc/tokens/data/") for f in files)  # package data
    assert any(f.startswith("extproc/quota/redis/lua/") for f in files)


@pytest.mark.slow
def test_the_lab_wheel_holds_the_simulator_the_tools_and_the_stack(
    wheels: dict[str, Path],
) -> None:
    files = wheel_files(wheels["token_quota_lab"])
    info = [f for f in files if f.startswith("token_quota_lab-0.1.0.dist-info/")]
    assert sorted(set(files) - set(info)) == sorted(package_files("llmsim", "loadlab", "stack"))


@pytest.mark.slow
def test_each_distribution_installs_its_own_scripts_and_they_resolve(
    wheels: dict[str, Path], venv: Path
) -> None:
    pip_install(venv, wheels["token_quota_extproc"])
    scripts = run(venv, "python", "-c", RESOLVE, "token-quota-extproc")
    assert scripts.returncode == 0, scripts.stderr
    assert scripts.stdout.split() == ["extproc"]
    assert not (venv / "bin" / "llmsim").exists()
    # Without the lab, the tools say what to install, in one line.
    alone = run(venv, "extproc", "bench", "--help")
    assert alone.returncode == 2
    assert alone.stderr.strip() == (
        "extproc bench: needs the lab distribution (loadlab missing): "
        "pip install ./lab (token-quota-lab, in the repository)"
    )

    pip_install(venv, wheels["token_quota_lab"])
    scripts = run(venv, "python", "-c", RESOLVE, "token-quota-lab")
    assert scripts.returncode == 0, scripts.stderr
    assert scripts.stdout.split() == ["llmsim"]
    llmsim = run(venv, "llmsim", "--help")
    assert llmsim.returncode == 0, llmsim.stderr
    assert "--inter-token-latency" in llmsim.stdout
    # With it, the product's CLI hands bench and chaos to the installed loadlab.
    for tool in ("bench", "chaos"):
        done = run(venv, "extproc", tool, "--help")
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith(f"usage: extproc {tool}")
    where = run(venv, "python", "-c", "import loadlab, llmsim; print(loadlab.__file__)")
    assert where.stdout.startswith(str(venv)), where
