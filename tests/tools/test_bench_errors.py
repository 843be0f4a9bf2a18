"""Bad scenarios and flags: exit 2 and one line naming the key, before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadlab.bench import main
from tests.tools.conftest import TINY, bench, write_scenario


def with_load(**load: object) -> dict:
    return {**TINY, "load": {**TINY["load"], **load}}


BAD_FILES = [
    ({**TINY, "routez": ["direct"]}, "routez"),
    ({**TINY, "routes": ["direct", "gateway"]}, "routes"),
    ({**TINY, "routes": []}, "routes"),
    (with_load(levelz=[1]), "load.levelz"),
    (with_load(levels=[1.5]), "load.levels"),
    (with_load(levels=[0]), "load.levels"),
    (with_load(mode="burst"), "load.mode"),
    (with_load(requests=0), "load.requests"),
    (with_load(requests=5, duration_s=3), "load.duration_s"),
    (with_load(output_tokens={"dist": "uniform", "min": 50, "max": 10}), "load.output_tokens.max"),
    (with_load(prompt_tokens={"dist": "zipf"}), "load.prompt_tokens.dist"),
    ({**TINY, "simulator": {"itl_ms": -1}}, "simulator.itl_ms"),
    ({**TINY, "simulator": {"profile": "no-such-profile.yaml"}}, "simulator.profile"),
    ({**TINY, "simulator": {"itl_ms": 10, "itl_std_ms": 5}}, "simulator.itl_std_ms"),
    ({**TINY, "processor": {"budget": {"window_s": 5}}}, "processor.budget.tpm"),
    ({**TINY, "processor": {"charge_modes": ["postpaid"]}}, "processor.charge_modes"),
    ({**TINY, "processor": {"admission_leases": "yes"}}, "processor.admission_leases"),
    (
        {**TINY, "target": {"url": "http://127.0.0.1:1"}, "processor": {"admission_leases": True}},
        "processor.admission_leases",
    ),
    ({**TINY, "routes": ["direct"], "processor": {"budget": {"tpm": 10}}}, "processor.budget"),
    ({**TINY, "target": {"url": "ftp://gw.example"}}, "target.url"),
    ({**TINY, "target": {"model": "m"}}, "target.url"),
    (
        {**TINY, "targets": [{"url": "http://a:1"}, {"url": "http://b:1", "name": 3}]},
        "targets[1].name",
    ),
    ({**TINY, "targets": [{"url": "http://a:1"}, {"url": "http://a:1"}]}, "targets"),
    ({**TINY, "target": {"url": "http://a:1"}, "targets": [{"url": "http://b:1"}]}, "targets"),
    (with_load(api="responses"), "load.api"),
    (with_load(ignore_eos="yes"), "load.ignore_eos"),
    (with_load(interleave=0), "load.interleave"),
    (
        {**with_load(interleave=2), "routes": ["processor"], "processor": {"budget": {"tpm": 9}}},
        "load.interleave",
    ),
    (
        {**TINY, "target": {"url": "http://127.0.0.1:1"}, "processor": {"budget": {"tpm": 9}}},
        "processor.budget",
    ),
]


@pytest.mark.parametrize(("doc", "key"), BAD_FILES, ids=[key for _, key in BAD_FILES])
def test_a_bad_scenario_file_exits_2_naming_the_key(
    doc: dict, key: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # In process (the parts are never reached); the subprocess path is tested below.
    status = main([str(write_scenario(tmp_path / "bad.yaml", doc)), "--out", str(tmp_path / "out")])
    assert status == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"extproc bench: invalid scenario: {key}: "), lines[0]
    assert not (tmp_path / "out").exists()  # refused before a results folder or a part


def test_unreadable_yaml_exits_2_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("load: [1, 2\nroutes: direct\n")
    done = bench(path)
    assert done.returncode == 2
    assert done.stderr.strip() == (
        f"extproc bench: invalid scenario: scenario: {path} is not valid YAML (line 2)"
    )


def test_a_flag_is_checked_like_the_key_it_overrides(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    scenario = str(write_scenario(tmp_path / "ok.yaml", TINY))
    assert main([scenario, "--routes", "direct,bogus", "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.startswith(
        "extproc bench: invalid scenario: routes: must be one of"
    )
    assert main([scenario, "--levels", "2.5"]) == 2
    assert "invalid scenario: load.levels: closed-loop levels are stream counts" in (
        capsys.readouterr().err
    )
    assert main([scenario, "--window-s", "5"]) == 2  # a window without a budget
    assert "invalid scenario: processor.budget.tpm: is required" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_compare_of_a_folder_without_results_exits_2(tmp_path: Path) -> None:
    done = bench("compare", tmp_path, tmp_path)
    assert done.returncode == 2
    assert "summary.json: not a results folder of extproc bench" in done.stderr
