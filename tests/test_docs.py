"""The docs, read as a reader would, agree with the code.

* every field the loader accepts has a row in docs/configuration.md (and no row names a
  field it refuses), each default that the normal form shows is the one documented, and
  every field a reload refuses is marked "restart";
* every flag of `extproc serve` is named there too;
* every metric family the processor exports is a row of docs/observability.md, with its
  type and labels (and no row names a family it does not export);
* every example configuration loads through the loader `extproc check-config` uses: the
  ```yaml config``` blocks of README.md and docs/, and the files in examples/ and docs/;
* every relative link of the READMEs and docs/ names a file that exists, and its #anchor a
  heading of that file;
* the README stays a page to start from (at most 150 lines).

The field and metric lists come from the code (the loader's key sets, the processor's own
metrics registry), never from a copy in this file.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.app import cli
from extproc.app.reload import RESTART_FIELDS
from extproc.app.runtime import Runtime
from extproc.config import limits as limits_module
from extproc.config import load_config, loader, parse_config
from extproc.config import ratelimit as ratelimit_module
from extproc.tokens.registry import TokenizerRule

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
CONFIGURATION = DOCS / "configuration.md"
OBSERVABILITY = DOCS / "observability.md"
PAGES = sorted(
    [
        ROOT / "README.md",
        ROOT / "deploy" / "README.md",
        ROOT / "benchmarks" / "README.md",
        ROOT / "simulator_profiles" / "README.md",
        *DOCS.glob("*.md"),
    ]
)
# Pages other branches are writing: a link to one passes until it exists, then is checked.
PENDING = {DOCS / "operations.md"}

# How configuration.md names the fields of each part of the file, and the loader's (or the
# schema's) set of the fields that part accepts. The module-level ``_*_KEYS`` sets are what
# ``_known`` checks a document against: the loader refuses any other field.
SECTIONS: dict[str, set[str]] = {
    "": loader._TOP_KEYS,
    "circuit_breaker.": loader._BREAKER_KEYS,
    "usage_ledger.": loader._LEDGER_KEYS,
    "admission_leases.": loader._LEASE_KEYS,
    "tls.": loader._TLS_KEYS,
    "models.<name>.": loader._MODEL_KEYS,
    "models.<name>.prices.": limits_module._PRICE_KEYS,
    "plans.<name>.": loader._PLAN_KEYS,
    "plans.<name>.limits.<model>.": loader._LIMIT_KEYS,
    "rules[].": limits_module._RULE_KEYS,
    "rules[].window.": limits_module._WINDOW_KEYS,
    "tenants.<id>.": loader._TENANT_KEYS,
    "tokenizers[].": {f.name for f in fields(TokenizerRule)},
    "ratelimit.": ratelimit_module._ROOT_KEYS,
    "ratelimit.descriptors[].": ratelimit_module._DESCRIPTOR_KEYS,
    "ratelimit.descriptors[].rate_limit.": ratelimit_module._RATE_LIMIT_KEYS,
}
KEY_SETS = {id(keys) for keys in SECTIONS.values()}
# A tenant's overrides take the plan's fields (documented there), but window_s.
COVERED_ELSEWHERE = {"_OVERRIDE_KEYS": loader._PLAN_KEYS}

# A configuration every default can be read from (normal form: defaults filled in).
MINIMAL: dict[str, Any] = {
    "models": {"m": {}},
    "plans": {"p": {"limits": {"*": {"rpm": 1}}}},
    "tenants": {"t": {"plan": "p", "key_sha256": ["0" * 64]}},
}
# The placeholder after each collection, and MINIMAL's entry it stands for.
PLACEHOLDERS = {("models", "<name>"): "m", ("plans", "<name>"): "p", ("tenants", "<id>"): "t"}


# -- reading Markdown ---------------------------------------------------------------------


def fenced_blocks(text: str) -> Iterator[tuple[str, str]]:
    """(info string, body) of every fenced code block."""
    info: str | None = None
    body: list[str] = []
    for line in text.splitlines():
        if info is None:
            if line.startswith("```"):
                info, body = line[3:].strip(), []
        elif line.startswith("```"):
            yield info, "\n".join(body) + "\n"
            info = None
        else:
            body.append(line)


def prose_lines(text: str) -> Iterator[str]:
    """The lines outside fenced code blocks."""
    fenced = False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            yield line


def tables(text: str) -> Iterator[list[list[str]]]:
    """Each table as rows of cells, the header first (the separator row left out)."""
    rows: list[list[str]] = []
    for line in [*prose_lines(text), ""]:
        if line.startswith("|"):
            cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line)[1:-1]]
            if not all(re.fullmatch(r":?-+:?", c) for c in cells):
                rows.append(cells)
        elif rows:
            yield rows
            rows = []


def spans(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def keyed_rows(text: str, first: str) -> Iterator[dict[str, str]]:
    """Rows of the tables whose first column is ``first``, as {column: cell}."""
    for header, *rows in tables(text):
        if header and header[0] == first:
            for row in rows:
                yield dict(zip(header, row, strict=False))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    found: set[str] = set()
    for line in prose_lines(text):
        match = re.match(r"#{1,6} (.*)", line)
        if match:
            base = slug(match[1])
            name, n = base, 0
            while name in found:
                n += 1
                name = f"{base}-{n}"
            found.add(name)
    return found


# -- configuration fields -----------------------------------------------------------------


def accepted_fields() -> set[str]:
    return {prefix + key for prefix, keys in SECTIONS.items() for key in keys}


def documented_fields() -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    for row in keyed_rows(CONFIGURATION.read_text(), "field"):
        (name,) = spans(row["field"]) or [row["field"]]
        assert name not in out, f"configuration.md: two rows for {name}"
        out[name] = row
    return out


def test_every_key_set_the_loader_checks_is_mapped_to_a_section_of_the_reference() -> None:
    """A new part of the file (a new ``_*_KEYS`` set) must get its rows too."""
    for module in (loader, limits_module, ratelimit_module):
        for name, value in vars(module).items():
            if not (name.startswith("_") and name.endswith("_KEYS")):
                continue
            if name in COVERED_ELSEWHERE:
                assert value <= COVERED_ELSEWHERE[name], name
                continue
            assert id(value) in KEY_SETS, f"{module.__name__}.{name} has no section in SECTIONS"


def test_every_field_the_loader_accepts_has_a_row_and_every_row_is_a_field() -> None:
    documented = set(documented_fields())
    accepted = accepted_fields()
    missing = sorted(accepted - documented)
    stale = sorted(documented - accepted)
    assert not missing, f"fields the loader accepts with no row in configuration.md: {missing}"
    assert not stale, f"rows in configuration.md for fields the loader refuses: {stale}"


def test_every_row_gives_a_type_and_a_default_or_says_it_is_required() -> None:
    for name, row in documented_fields().items():
        if "type" in row:
            assert row["type"], f"{name}: no type"
        if "default" in row:
            assert row["default"], f"{name}: no default (write 'none' or 'required')"


def _normal_value(normal: dict[str, Any], field: str) -> tuple[bool, Any]:
    """The normal form's value for a documented field of ``MINIMAL``, if it shows one."""
    node: Any = normal
    parts = field.split(".")
    for i, part in enumerate(parts):
        part = PLACEHOLDERS.get((parts[i - 1], part), part) if i else part
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def test_documented_defaults_are_the_ones_the_loader_fills_in() -> None:
    normal = parse_config(MINIMAL).normalised
    compared = []
    for name, row in documented_fields().items():
        cell = row.get("default", "")
        code = spans(cell)
        if len(code) != 1 or cell != f"`{code[0]}`":
            continue  # prose: "none", "required", "the plan's", a formula
        found, value = _normal_value(normal, name)
        if not found:
            continue  # the normal form does not show it (window_s, tls.*, rules)
        documented = yaml.safe_load(code[0])
        assert documented == value, f"{name}: documented {code[0]}, the loader fills in {value!r}"
        compared.append(name)
    assert len(compared) >= 25, compared  # the check itself ran


def test_every_field_a_reload_refuses_is_marked_restart() -> None:
    # The normal form's redis_auth is what these three fields set.
    restart = {f for f in RESTART_FIELDS if f != "redis_auth"}
    restart |= {"redis_username", "redis_password_file", "redis_password_env"}
    assert restart <= loader._TOP_KEYS
    rows = documented_fields()
    for name in restart:
        reload = rows.get(name, {}).get("reload", "(no row)")
        assert reload.startswith("restart"), f"{name} needs a restart, documented {reload!r}"


def test_every_flag_of_extproc_serve_is_documented(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    flags = set(re.findall(r"(?<![\w-])--[a-z][a-z-]+", capsys.readouterr().out)) - {"--help"}
    documented = set(re.findall(r"`(--[a-z][a-z-]+)", CONFIGURATION.read_text()))
    assert flags and not flags - documented, f"undocumented: {sorted(flags - documented)}"


# -- metrics ------------------------------------------------------------------------------


def exported_families() -> dict[str, tuple[str, set[str]]]:
    """What a scrape of a processor shows: {name as exposed: (type, label names)}."""
    runtime = Runtime(parse_config({**MINIMAL, "redis_url": "memory://"}))
    try:
        out: dict[str, tuple[str, set[str]]] = {}
        for family in runtime.metrics_registry.collect():
            suffix = {"counter": "_total", "info": "_info"}.get(family.type, "")
            labels = set(getattr(family, "_labelnames", ()))
            labels |= {k for s in family.samples for k in s.labels if k not in ("le", "quantile")}
            out[family.name + suffix] = (family.type, labels)
        return out
    finally:
        asyncio.run(runtime.close())


def test_every_exported_metric_family_is_documented_with_its_type_and_labels() -> None:
    exported = exported_families()
    rows = {}
    for row in keyed_rows(OBSERVABILITY.read_text(), "metric"):
        (name,) = spans(row["metric"])
        rows[name] = row
    if not any(n.startswith("process_") for n in exported):  # no /proc: no process collector
        rows = {n: r for n, r in rows.items() if not n.startswith("process_")}
    missing = sorted(set(exported) - set(rows))
    stale = sorted(set(rows) - set(exported))
    assert not missing, f"exported metric families with no row in observability.md: {missing}"
    assert not stale, f"rows in observability.md for families not exported: {stale}"
    for name, (kind, labels) in exported.items():
        row = rows[name]
        assert row["type"] == kind, f"{name}: documented {row['type']}, exported {kind}"
        assert set(spans(row["labels"])) == labels, f"{name}: labels {sorted(labels)}"


# -- example configurations ---------------------------------------------------------------


def _yaml_blocks() -> Iterator[tuple[str, list[str], str]]:
    """(where, info words, body) of every ```yaml block of README.md and docs/."""
    for page in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        for i, (info, body) in enumerate(fenced_blocks(page.read_text())):
            words = info.split()
            if words[:1] == ["yaml"]:
                yield f"{page.relative_to(ROOT)} block {i}", words, body


CONFIG_BLOCKS = [(where, body) for where, words, body in _yaml_blocks() if words[1:2] == ["config"]]


@pytest.mark.parametrize("where,body", CONFIG_BLOCKS, ids=[w for w, _ in CONFIG_BLOCKS])
def test_every_example_configuration_in_the_docs_loads(
    where: str, body: str, tmp_path: Path
) -> None:
    path = tmp_path / "quota.yaml"
    path.write_text(body)
    load_config(path)  # what `extproc check-config` runs; raises naming the field


def test_every_configuration_in_the_docs_is_marked_to_be_loaded() -> None:
    """A YAML block that reads as a processor configuration is a ```yaml config block."""
    unmarked = []
    for where, words, body in _yaml_blocks():
        try:
            doc = yaml.safe_load(body)
        except yaml.YAMLError:
            continue  # an excerpt, not a file
        if (
            words[1:2] != ["config"]
            and isinstance(doc, dict)
            and set(doc) <= loader._TOP_KEYS
            and {"models", "plans", "tenants"} & set(doc)
        ):
            unmarked.append(where)
    assert not unmarked, f"configurations in ```yaml blocks, mark them ```yaml config: {unmarked}"


def test_the_docs_hold_the_examples_they_promise() -> None:
    where = {w.split(" block")[0] for w, _ in CONFIG_BLOCKS}
    assert {"README.md", "docs/configuration.md", "docs/limits.md"} <= where


def test_every_configuration_file_in_examples_and_docs_loads() -> None:
    checked = []
    for path in sorted([*(ROOT / "examples").rglob("*.yaml"), *DOCS.rglob("*.yaml")]):
        doc = yaml.safe_load(path.read_text())
        if isinstance(doc, dict) and set(doc) <= loader._TOP_KEYS:
            load_config(path)
            checked.append(path.name)
    assert "first-tenant.yaml" in checked


# -- links --------------------------------------------------------------------------------


def _links(page: Path) -> Iterator[str]:
    for line in prose_lines(page.read_text()):
        line = re.sub(r"`[^`]*`", "", line)
        yield from re.findall(r"\]\(([^)\s]+)\)", line)


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_resolves_to_a_file_and_heading(page: Path) -> None:
    broken = []
    for link in _links(page):
        if re.match(r"[a-z]+:", link):
            continue  # https:, mailto:
        target, _, anchor = link.partition("#")
        path = (page.parent / target).resolve() if target else page
        if not path.exists():
            if path not in PENDING:
                broken.append(f"{link}: no such file")
            continue
        if anchor and path.suffix == ".md" and anchor not in anchors(path.read_text()):
            broken.append(f"{link}: no heading #{anchor} in {path.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"


def test_the_readme_stays_a_page_to_start_from() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150
