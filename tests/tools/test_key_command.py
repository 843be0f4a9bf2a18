"""``extproc key hash`` and ``extproc key add``, run as processes: the digest the config lists,
and a key added to a file that keeps its comments and still loads."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from extproc.config import load_config
from tests.tools.conftest import ROOT

FIRST = ROOT / "examples" / "first-tenant.yaml"


def key(*args: str | Path, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "extproc", "key", *map(str, args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        input=stdin,
        timeout=60,
    )


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def test_hash_prints_the_digest_of_a_key_given_or_piped() -> None:
    given = key("hash", "sk-team-a-demo")
    piped = key("hash", stdin="sk-team-a-demo\n")
    assert given.returncode == piped.returncode == 0, given.stderr + piped.stderr
    assert given.stdout == piped.stdout == sha("sk-team-a-demo") + "\n"
    assert sha("sk-team-a-demo") in FIRST.read_text()  # the example lists the demo key
    empty = key("hash", stdin="\n")
    assert empty.returncode == 2
    assert empty.stderr == "extproc key: a key is one word: no spaces, not empty\n"


def test_add_gives_a_new_tenant_a_generated_key_and_the_file_still_loads(tmp_path: Path) -> None:
    config = tmp_path / "quota.yaml"
    shutil.copy(FIRST, config)
    before = config.read_text()
    done = key("add", "--tenant", "team-b", "--plan", "starter", "--generate", config)
    assert done.returncode == 0, done.stderr
    new_key = done.stdout.strip()  # stdout: the key alone, e.g. KEY=$(extproc key add ...)
    assert new_key.startswith("sk-") and len(new_key) > 30
    assert done.stderr == (
        f"extproc key: added sha256 {sha(new_key)} to new tenant team-b (plan starter) "
        f"in {config}\n"
    )
    after = config.read_text()
    assert after.startswith(before.rstrip("\n"))  # comments and layout kept, the tenant added
    tenants = load_config(config).tenants
    assert tenants["team-b"].key_sha256 == (sha(new_key),)
    assert tenants["team-b"].plan.name == "starter"
    check = subprocess.run(
        [sys.executable, "-m", "extproc", "check-config", str(config)],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
    )  # fmt: skip
    assert check.returncode == 0, check.stderr


def test_add_appends_a_piped_key_to_an_existing_tenant_once(tmp_path: Path) -> None:
    config = tmp_path / "quota.yaml"
    shutil.copy(FIRST, config)
    done = key("add", "--tenant", "team-a", config, stdin="sk-second\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""  # a key it was given is never printed
    assert load_config(config).tenants["team-a"].key_sha256 == (
        sha("sk-team-a-demo"),
        sha("sk-second"),
    )
    assert yaml.safe_load(config.read_text())["plans"]  # the rest is as it was
    again = key("add", "--tenant", "team-a", config, stdin="sk-second\n")
    assert again.returncode == 2
    assert again.stderr == "extproc key: this key is already listed for it\n"


def test_add_refuses_what_would_not_load_and_leaves_the_file_alone(tmp_path: Path) -> None:
    config = tmp_path / "quota.yaml"
    shutil.copy(FIRST, config)
    before = config.read_bytes()
    no_plan = key("add", "--tenant", "team-c", config, stdin="sk-c\n")
    assert no_plan.returncode == 2
    assert no_plan.stderr == "extproc key: tenant team-c is new: give its --plan\n"
    unknown = key("add", "--tenant", "team-c", "--plan", "gold", config, stdin="sk-c\n")
    assert unknown.returncode == 2
    assert unknown.stderr.startswith(
        "extproc key: not changed: the result would not load (tenants.team-c.plan: "
        "unknown plan 'gold')"
    )
    taken = key("add", "--tenant", "team-c", "--plan", "starter", config, stdin="sk-team-a-demo")
    assert taken.returncode == 2
    assert taken.stderr == "extproc key: this key is already listed for tenant team-a\n"
    assert config.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["quota.yaml"]  # no temporary file left
