"""The busiest sliding window of ``extproc bench``: computed on constructed records, the
scenario's ``processor.budget.window``, and a real run under a sliding budget."""

from __future__ import annotations

import itertools
from pathlib import Path

import orjson
import pytest
import yaml

from extproc.config.loader import parse_config
from loadlab.bench import build_scenario, run_parser
from loadlab.engine import Phase, Record
from loadlab.parts import processor_config
from loadlab.scenario import ScenarioError, load_scenario, parse_scenario
from loadlab.stats import budget_figures, busiest_interval, delivered_tokens, trailing_sums
from tests.tools.conftest import PNG_SIGNATURE, ROOT, TINY, bench, write_scenario


def record(
    start_s: float, prompt: int, output: int, arrivals_ms: list[float], status: int = 200
) -> Record:
    return Record(
        route="processor", level=1, index=0, start_ns=round(start_s * 1e9), status=status,
        outcome="ok" if status == 200 else "refused", prompt_tokens=prompt, max_tokens=output,
        output_tokens=output, events=len(arrivals_ms), ttft_ms=None, e2el_ms=None,
        tpot_ms=None, chunk_arrival_ms=arrivals_ms,
    )  # fmt: skip


# Prompt at the send, output over the token events: (100, 10) (100.5, 10) (101, 10)
# (101.5, 10), then (103, 25) (103.2, 3) (103.9, 4); the refusal delivered nothing.
RECORDS = [
    record(100.0, 10, 30, [500.0, 1000.0, 1500.0]),
    record(101.2, 100, 0, [], status=429),
    record(103.0, 25, 7, [200.0, 900.0]),
]


def test_delivered_tokens_are_whole_and_sum_to_each_records_output() -> None:
    points = delivered_tokens([record(7.0, 2, 7, [10.0, 20.0, 30.0]), *RECORDS])
    assert points[:4] == [(7.0, 2), (7.01, 2), (7.02, 2), (7.03, 3)]
    assert [t for _, t in points[4:]] == [10, 10, 10, 10, 25, 3, 4]
    assert sum(t for _, t in points) == 2 + 7 + 40 + 32


@pytest.mark.parametrize(
    ("window_s", "tokens", "start"),
    [
        (0.4, 28, 103.0),
        (1.0, 32, 103.0),
        (2.5, 48, 101.0),  # [100.5, 103) holds 30: the prompt sent at 103.0 is not in it
        (2.5001, 55, 100.5),  # … and now it is
        (3.0, 58, 100.5),
        (4.0, 72, 100.0),
    ],
)
def test_the_busiest_interval_is_exact_and_half_open(
    window_s: float, tokens: int, start: float
) -> None:
    points = delivered_tokens(RECORDS)
    assert busiest_interval(points, window_s) == (tokens, start)
    # Against every interval starting at a point, summed the slow way.
    assert tokens == max(sum(n for t, n in points if s <= t < s + window_s) for s, _ in points)
    # The plot's trailing window, (t − window_s, t] at each delivery, peaks at the same figure.
    assert max(held for _, held in trailing_sums(points, window_s)) == tokens


def test_the_trailing_window_drops_what_is_window_s_old() -> None:
    points = delivered_tokens(RECORDS)
    steps = trailing_sums(points, 2.5)
    # At 103.0 the prompt arrives as (100.5, 10) leaves: one step of both.
    assert [held for _, held in steps] == [10, 20, 30, 40, 30, 45, 48, 38, 42, 32, 7, 4, 0]
    assert [at for at, _ in steps][:6] == [100.0, 100.5, 101.0, 101.5, 102.5, 103.0]


def test_nothing_delivered_is_a_busiest_interval_of_zero() -> None:
    assert busiest_interval([], 60) == (0, 0.0)
    figures = budget_figures(Phase("processor", 1, [], 1.0, {}), 100, 60, "sliding")
    assert figures["busiest_sliding_window_tokens"] == 0
    assert figures["busiest_sliding_ratio"] == 0
    assert figures["busiest_sliding_window_start_s"] is None


def test_a_burst_across_a_fixed_boundary_passes_the_sliding_window_not_a_fixed_one() -> None:
    # The measurement in small: 100 tokens at the end of [100, 110), 100 at the start
    # of [110, 120).
    burst = [100.0, 200.0, 300.0, 400.0]
    phase = Phase("processor", 1, [record(109.0, 20, 80, burst), record(110.0, 20, 80, burst)],
                  11.0, {})  # fmt: skip
    b = budget_figures(phase, 100, 10)
    assert [(w["window_start_s"], w["delivered_tokens"]) for w in b["windows"]] == [
        (100, 100),
        (110, 100),
    ]
    assert (b["windows_over_budget"], b["max_utilisation"]) == (0, 1.0)
    assert b["busiest_sliding_window_tokens"] == 200
    assert b["busiest_sliding_window_start_s"] == 109.0
    assert b["busiest_sliding_ratio"] == 2.0
    # Charged figures read from Redis (fixed windows) stay beside them.
    phase.charged = {100: 100, 110: 100}
    b = budget_figures(phase, 100, 10)
    assert b["utilisation_basis"] == "charged" and b["charged_minus_delivered"] == 0
    assert b["busiest_sliding_ratio"] == 2.0


# --- the scenario's window ------------------------------------------------------------------

ONE_ROUTE = {**TINY, "routes": ["processor"]}


def with_budget(**budget: object) -> dict:
    return {**ONE_ROUTE, "processor": {"budget": {"tpm": 600, **budget}}}


BAD_WINDOWS = [
    (with_budget(window="rolling"), "processor.budget.window", "must be one of fixed, sliding"),
    (with_budget(window=[]), "processor.budget.window", "must not be empty"),
    (with_budget(bucket_s=1), "processor.budget.bucket_s", "only applies to window: sliding"),
    (with_budget(window="sliding", bucket_s=0), "processor.budget.bucket_s", "at least 1"),
    (with_budget(window="sliding", bucket_s=True), "processor.budget.bucket_s", "an integer"),
    (
        with_budget(window="sliding", window_s=60, bucket_s=7),
        "processor.budget.bucket_s",
        "7 does not divide window_s (60)",
    ),
    (
        with_budget(window="sliding", window_s=125),
        "processor.budget.bucket_s",
        "the default 2 does not divide window_s (125)",
    ),
    (
        with_budget(window="sliding", window_s=7200, bucket_s=1),
        "processor.budget.bucket_s",
        "more than 600 buckets",
    ),
]


@pytest.mark.parametrize(("doc", "key", "says"), BAD_WINDOWS, ids=[s for _, _, s in BAD_WINDOWS])
def test_a_bad_budget_window_is_a_scenario_error_naming_the_key(
    doc: dict, key: str, says: str
) -> None:
    with pytest.raises(ScenarioError) as caught:
        parse_scenario(doc)
    assert caught.value.key == key
    assert says in str(caught.value)


def test_the_normal_form_shows_the_window_and_runs_again_as_it_is() -> None:
    fixed = parse_scenario(with_budget())
    assert fixed.to_doc()["processor"]["budget"] == {"tpm": 600, "window_s": 60,
                                                     "window": ["fixed"]}  # fmt: skip
    both = parse_scenario(with_budget(window_s=4, window=["fixed", "sliding"]))
    assert both.to_doc()["processor"]["budget"] == {
        "tpm": 600, "window_s": 4, "window": ["fixed", "sliding"], "bucket_s": 1,
    }  # fmt: skip
    assert both.route_names == ("processor/incremental/b32", "processor/incremental/b32/sliding")
    again = parse_scenario(yaml.safe_load(yaml.safe_dump(both.to_doc())))
    assert again.to_doc() == both.to_doc() and again.variants == both.variants
    one = parse_scenario(with_budget(window="sliding", window_s=120))
    assert one.route_names == ("processor",)
    assert one.to_doc()["processor"]["budget"]["bucket_s"] == 2  # the processor's default


def test_each_window_kind_is_a_plan_the_processor_loads(tmp_path: Path) -> None:
    scenario = parse_scenario(with_budget(window_s=4, window=["fixed", "sliding"], bucket_s=2))
    path = processor_config(tmp_path / "quota.yaml", scenario, "memory://")
    config = parse_config(yaml.safe_load(path.read_text()), tmp_path)
    tpm = {
        name: next(r.window for r in plan.limits["*"].rules if r.metric == "tokens")
        for name, plan in config.plans.items()
    }
    assert (tpm["p0"].kind, tpm["p0"].seconds) == ("fixed", 4)
    assert (tpm["p1"].kind, tpm["p1"].seconds, tpm["p1"].bucket_s) == ("sliding", 4, 2)


def test_window_flags_override_the_file_and_are_checked_like_its_keys(tmp_path: Path) -> None:
    path = write_scenario(tmp_path / "s.yaml", with_budget(window_s=4))

    def built(*flags: str) -> tuple:
        b = build_scenario(run_parser().parse_args([str(path), *flags])).budget
        assert b is not None
        return b.tpm, b.window_s, b.windows, b.bucket_s

    assert built("--window", "fixed,sliding", "--bucket-s", "2") == (
        600, 4, ("fixed", "sliding"), 2,
    )  # fmt: skip
    assert built("--window", "sliding", "--window-s", "6") == (600, 6, ("sliding",), None)
    with pytest.raises(ScenarioError, match=r"^processor\.budget\.bucket_s: 3 does not divide"):
        built("--window", "sliding", "--bucket-s", "3")
    sliding = write_scenario(tmp_path / "sl.yaml", with_budget(window="sliding", bucket_s=2))
    path = sliding
    assert built("--window", "fixed") == (600, 60, ("fixed",), None)  # the file's bucket goes


# --- a real run -----------------------------------------------------------------------------

TPM = 600  # 10 + 40 tokens a request, 6 streams at 5 ms ITL: spent in well under a second
SLIDING = {
    **TINY,
    "name": "tiny-sliding",
    "routes": ["processor"],
    "processor": {"charge_modes": ["incremental"], "batch_tokens": [8],
                  "budget": {"tpm": TPM, "window_s": 4, "window": "sliding", "bucket_s": 1}},
    "load": {**TINY["load"], "levels": [6], "requests": None, "duration_s": 8,
             "output_tokens": 40, "warmup_requests": 0},
}  # fmt: skip


def test_a_sliding_budget_holds_every_interval_of_its_window_in_a_real_run(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    done = bench(write_scenario(tmp_path / "sliding.yaml", SLIDING), "--out", out, "--quiet")
    assert done.returncode == 0, done.stderr[-3000:]
    doc = orjson.loads((out / "summary.json").read_bytes())
    assert doc["scenario"]["processor"]["budget"] == {
        "tpm": TPM, "window_s": 4, "window": ["sliding"], "bucket_s": 1,
    }  # fmt: skip
    [row] = doc["results"]
    b = row["budget"]
    assert b["window"] == "sliding"
    # No fixed-window charge exists to read: the per-window figures are what was delivered.
    assert b["utilisation_basis"] == "delivered" and b["charged_tokens"] is None
    assert b["windows"] and all(w["charged_tokens"] is None for w in b["windows"])
    # The budget bound (cuts or refusals), and slid: more than one window's budget went by.
    assert b["streams_cut"] + b["refused_429"] > 0
    assert b["delivered_tokens"] > TPM
    # Charges in any 4 s are at most TPM; deliveries trail their charge by at most what a
    # stream holds leased ahead (1.5 batches) and count a prompt when it is sent, before its
    # admission charges it: so delivered in any 4 s <= TPM + per stream one such share.
    in_flight = 6 * (12 + 10)
    assert 0 < b["busiest_sliding_window_tokens"] <= TPM + in_flight
    assert b["busiest_sliding_ratio"] == round(b["busiest_sliding_window_tokens"] / TPM, 4)
    # The figure is the records' own: every 4 s interval from a delivery, summed the slow way.
    records = [
        Record(**orjson.loads(line)) for line in (out / "records.jsonl").read_bytes().splitlines()
    ]
    points = delivered_tokens(records)
    assert sum(n for _, n in points) == b["delivered_tokens"]
    slow = max(
        sum(n for t, n in itertools.takewhile(lambda p, s=s: p[0] < s + 4, points[i:]))
        for i, (s, _) in enumerate(points)
    )
    assert slow == b["busiest_sliding_window_tokens"]
    summary_csv = (out / "summary.csv").read_text().splitlines()
    assert "budget_busiest_sliding_ratio" in summary_csv[0].split(",")
    assert "busiest/budget" in done.stdout
    png = (out / "plots" / "sliding_use.png").read_bytes()
    assert png.startswith(PNG_SIGNATURE) and len(png) > 1000


@pytest.mark.parametrize(
    "path", sorted((ROOT / "benchmarks" / "scenarios").glob("*.yaml")), ids=lambda p: p.name
)
def test_every_shipped_scenario_is_valid(path: Path) -> None:
    scenario = load_scenario(path)
    if path.name == "sliding_vs_fixed.yaml":
        assert scenario.budget is not None and scenario.budget.windows == ("fixed", "sliding")
