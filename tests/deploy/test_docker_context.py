"""``docker build .`` without a Docker engine: every COPY source of the Dockerfile survives
``.dockerignore`` (matched by Docker's rules, ``tests/deploy/docker_context.py``), the
context holds the processor and nothing else, and the image's install step succeeds in a
clean venv from exactly the files the context holds, offline.

Offline: the install's dependencies come from a wheelhouse repacked from the distributions
this venv already has (the same versions, byte for byte, their RECORD rewritten); the
build backend (pyproject's ``build-system.requires``, which no venv keeps) is fetched once
with this machine's pip configuration, without retries (here a local mirror; the test is
skipped, saying so, where only a network index has it). Then the Dockerfile's pip
commands run as written, build isolation included, with the machine's configuration
ignored and no index at all: only the wheelhouse."""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata as md
import os
import re
import shlex
import signal
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from loadlab.gateway import grpc_serving, wait_until
from loadlab.procs import free_port
from tests.deploy.docker_context import (
    BadPattern,
    Ignore,
    Pattern,
    context_files,
    copy_context,
    copy_sources,
    instructions,
    read_patterns,
)

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()
IGNORE = Ignore.parse((ROOT / ".dockerignore").read_text())


def excluded(lines: str, path: str) -> bool:
    return Ignore.parse(lines).excluded(path)


# --- the matching rules, case by case (docs.docker.com and moby/patternmatcher) -----------


@pytest.mark.parametrize(
    ("lines", "path", "out"),
    [
        # The docs' example file: */temp*, */*/temp*, temp?
        ("*/temp*", "somedir/temporary.txt", True),
        ("*/temp*", "somedir/temp", True),
        ("*/temp*", "temporary.txt", False),  # not in a subdirectory
        ("*/*/temp*", "somedir/subdir/temporary.txt", True),
        ("temp?", "tempa", True),
        ("temp?", "temp", False),
        ("temp?", "tempab", False),
        # ** matches any number of directories, zero included
        ("**/*.go", "main.go", True),
        ("**/*.go", "a/b/c/main.go", True),
        ("**/*.go", "a/main.go.txt", False),
        ("a/**/b", "a/b", True),
        ("a/**/b", "a/x/y/b", True),
        ("a/**", "a/x/y", True),
        ("a/**", "a", False),  # a prefix match of "a/": the directory itself stays
        ("**a", "ba", True),  # patternmatcher's suffix match: a plain string suffix
        # The last matching line decides
        ("*.md\n!README.md", "README.md", False),
        ("*.md\n!README.md", "CHANGES.md", True),
        ("*.md\n!README*.md\nREADME-secret.md", "README-secret.md", True),
        ("*.md\n!README*.md\nREADME-secret.md", "README-public.md", False),
        ("*.md\nREADME-secret.md\n!README*.md", "README-secret.md", False),
        # A pattern matches a path or any of its parents
        ("node_modules", "node_modules/x/y.js", True),
        ("*", "extproc/app/cli.py", True),  # * never crosses /, but matches the parent
        ("*\n!extproc/", "extproc/app/cli.py", False),  # the exception re-includes the tree
        ("*\n!extproc/\n**/__pycache__", "extproc/__pycache__/cli.pyc", True),
        # Leading and trailing slashes, dot segments, whitespace, comments
        ("/foo/bar", "foo/bar", True),
        ("foo/bar/", "foo/bar/baz", True),
        ("./foo/../bar", "bar", True),
        ("   foo   ", "foo", True),
        ("# foo", "# foo", False),  # a comment
        ("  # foo", "# foo", True),  # not at column 1: a pattern
        ("! foo", "foo", False),  # an exception, its pattern trimmed
        # Go's filepath.Match: classes, negation with ^ (! is a member), escapes
        ("file[0-9].txt", "file7.txt", True),
        ("file[^0-9].txt", "file7.txt", False),
        ("file[!a].txt", "file!.txt", True),
        ("a\\*b", "a*b", True),
        ("a\\*b", "axb", False),
        ("a.b", "axb", False),  # regex metacharacters are literal
        ("*.b", "x.b", True),
        ("a+b", "a+b", True),
        ("f?o/*", "foo/bar", True),
        ("f?o/*", "foo/bar/baz", True),  # the parent foo/bar matches
    ],
)
def test_dockerignore_patterns_match_as_docker_does(lines: str, path: str, out: bool) -> None:
    assert excluded(lines, path) is out


def test_dockerignore_lines_are_read_as_docker_reads_them() -> None:
    assert read_patterns("\ufeff# c\n\n  /a/b/  \n!  ./c//d/.. \n#x\n ~ \n") == ["a/b", "!c", "~"]
    for bad in ("!", "a[", "a[]", "a\\"):
        with pytest.raises(BadPattern):
            Ignore.parse(bad)
    assert Pattern.parse("**/__pycache__").kind == "suffix"
    assert Pattern.parse("extproc/**").kind == "prefix"
    assert Pattern.parse("extproc").kind == "exact"
    assert Pattern.parse("**/*.pyc").kind == "regex"


# --- this repository's Dockerfile and .dockerignore ---------------------------------------


def test_every_copy_source_survives_the_dockerignore() -> None:
    files = context_files(ROOT, IGNORE)
    copies = [i for i in instructions(DOCKERFILE) if i.keyword in ("COPY", "ADD")]
    assert copies
    for inst in copies:
        for source in copy_sources(inst):
            present = source in files or any(f.startswith(source + "/") for f in files)
            assert present, f"{inst.keyword} {inst.args}: {source} is not in the build context"


def test_the_context_holds_the_processor_and_nothing_else() -> None:
    """pyproject.toml, README.md (its readme) and extproc/ as it is on disk; no venv,
    results, tests, simulator or load tools. The image holds extproc only."""
    on_disk = sorted(
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "extproc").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    )
    assert context_files(ROOT, IGNORE) == sorted(["README.md", "pyproject.toml", *on_disk])
    copied = {s for i in instructions(DOCKERFILE) if i.keyword == "COPY" for s in copy_sources(i)}
    assert copied == {"pyproject.toml", "README.md", "extproc"}


# --- the image's install step, offline, in a clean venv -----------------------------------


def _closure(requirements: list[str]) -> list[md.Distribution]:
    """The installed distributions ``requirements`` need, with their dependencies (extras
    and markers evaluated)."""
    seen: dict[str, tuple[md.Distribution, set[str]]] = {}
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        dist = md.distribution(req.name)
        extras = seen[name][1] if name in seen else set()
        if name in seen and set(req.extras) <= extras:
            continue
        extras |= set(req.extras)
        seen[name] = (dist, extras)
        for text in dist.requires or []:
            dep = Requirement(text)
            envs = [{"extra": ""}, *({"extra": e} for e in extras)]
            if dep.marker is None or any(dep.marker.evaluate(e) for e in envs):
                todo.append(dep)
    return [d for d, _ in seen.values()]


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).decode().rstrip("=")


def repack(dist: md.Distribution, out: Path) -> Path:
    """An installed distribution as a wheel again: its files under site-packages (scripts
    are made again from its entry points), a fresh RECORD."""
    site = Path(str(dist.locate_file(""))).resolve()
    info = Path(str(dist._path)).name  # type: ignore[attr-defined]  # the .dist-info folder
    wheel_meta = dist.read_text("WHEEL") or ""
    tags = [
        line.split(":", 1)[1].strip() for line in wheel_meta.splitlines() if line.startswith("Tag:")
    ]
    tag = tags[0] if tags else "py3-none-any"
    name = re.sub(r"[-_.]+", "_", dist.metadata["Name"])
    path = out / f"{name}-{dist.version}-{tag}.whl"
    records = []
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as whl:
        for file in dist.files or []:
            full = Path(str(dist.locate_file(file))).resolve()
            try:
                rel = full.relative_to(site).as_posix()
            except ValueError:
                continue  # a script in bin/: pip writes it again
            if "__pycache__" in rel or (rel.startswith(f"{info}/") and Path(rel).name in (
                "RECORD", "INSTALLER", "REQUESTED", "direct_url.json",
            )):  # fmt: skip
                continue
            if not full.is_file():
                continue
            data = full.read_bytes()
            whl.writestr(rel, data)
            records.append(f"{rel},{_record_hash(data)},{len(data)}")
        records.append(f"{info}/RECORD,,")
        whl.writestr(f"{info}/RECORD", "\n".join(records) + "\n")
    return path


def backend(pyproject: dict, wheelhouse: Path) -> None:
    """The build backend's wheels (and ``wheel``, which setuptools before 70.1 asks for)
    into the wheelhouse, from this machine's pip configuration without retrying; skip when
    none is reachable so."""
    wanted = [*pyproject["build-system"]["requires"], "wheel"]
    done = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--retries", "0",
         "--timeout", "10", "--dest", str(wheelhouse), *wanted],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or ["?"])[-1]
        pytest.skip(f"no wheel of {', '.join(wanted)} without a network index: {why}")


def _pip_steps() -> list[str]:
    """The Dockerfile's RUN steps that are pip commands, as its shell would run them."""
    steps = []
    for inst in instructions(DOCKERFILE):
        if inst.keyword == "RUN":
            steps += [s.strip() for s in inst.args.split("&&") if s.strip().startswith("pip ")]
    return steps


@pytest.mark.slow
def test_the_images_install_step_succeeds_from_the_context_alone(tmp_path: Path) -> None:
    context = tmp_path / "app"  # the image's WORKDIR, filled as COPY fills it
    copy_context(ROOT, context_files(ROOT, IGNORE), context)
    project = tomllib.loads((context / "pyproject.toml").read_text())["project"]
    wheelhouse = tmp_path / "wheels"
    wheelhouse.mkdir()
    for dist in _closure(project["dependencies"]):
        repack(dist, wheelhouse)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    env = {
        "PATH": f"{venv / 'bin'}:{os.environ['PATH']}",
        "HOME": str(tmp_path),
        "PIP_CONFIG_FILE": os.devnull,  # not this machine's indexes or constraints
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": str(wheelhouse),
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        # --no-compile (pip reads this negated flag's variable inverted: "0" turns it off):
        # the image's first commands below write the bytecode of what they import instead.
        "PIP_NO_COMPILE": "0",
    }
    backend(tomllib.loads((context / "pyproject.toml").read_text()), wheelhouse)
    steps = _pip_steps()
    assert steps and steps[0].startswith("pip install") and steps[0].endswith(" .")
    for step in steps:
        done = subprocess.run(
            ["bash", "-c", step], cwd=context, env=env, capture_output=True, text=True,
            timeout=600,
        )  # fmt: skip
        assert done.returncode == 0, f"{step}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    python = str(venv / "bin" / "python")
    image_env = {**env, "UPSTREAM_API_KEY": "sk-upstream"}  # the deployment's Secret

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            argv, cwd=tmp_path, env=image_env, capture_output=True, text=True, timeout=120
        )

    # The image holds the processor: its command, its package data, the OTLP repair.
    quota = ROOT / "deploy" / "extproc" / "quota.yaml"  # what compose and k8s mount
    checked = run(str(venv / "bin" / "extproc"), "check-config", str(quota))
    assert checked.returncode == 0, checked.stderr
    imports = run(
        python, "-c",
        "import importlib.util as u, extproc\n"
        "from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope\n"
        "print(extproc.__file__)\n"
        "print([m for m in ('llmsim', 'loadlab', 'stack', 'tests') if u.find_spec(m)])",
    )  # fmt: skip
    assert imports.returncode == 0, imports.stderr
    where, others = imports.stdout.splitlines()
    assert where.startswith(str(venv)) and others == "[]"  # extproc only
    scripts = run(
        python, "-c",
        "import importlib.metadata as md\n"
        "eps = md.distribution('token-quota-extproc').entry_points\n"
        "print([ep.name for ep in eps.select(group='console_scripts')])",
    )  # fmt: skip
    assert scripts.stdout.strip() == "['extproc']"  # no llmsim script without its module
    assert not (venv / "bin" / "llmsim").exists()
    tools = run(str(venv / "bin" / "extproc"), "bench", "--help")
    assert tools.returncode == 2 and "needs the lab distribution" in tools.stderr
    # And it serves: the image's CMD, on loopback ports and the in-memory backend.
    port = free_port()
    serve = subprocess.Popen(
        [str(venv / "bin" / "extproc"), "serve", "--config", str(quota),
         "--listen", f"127.0.0.1:{port}", "--metrics-listen", f"127.0.0.1:{free_port()}",
         "--redis-url", "memory://", "--drain-delay-s", "0"],
        cwd=tmp_path, env=image_env, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert wait_until(lambda: grpc_serving(port) or serve.poll() is not None, 60)
        assert serve.poll() is None, serve.stderr.read() if serve.stderr else ""
    finally:
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(60) == 0
    assert shlex.split(steps[-1])[-1].startswith("$(pip freeze")  # the repair came last
