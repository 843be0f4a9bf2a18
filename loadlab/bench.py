"""``extproc bench``: streaming-latency benchmark runs, and ``compare`` of two of them.

    extproc bench [SCENARIO.yaml] [--out DIR] [flags overriding the file]
    extproc bench --target http://127.0.0.1:10000 --api-key KEY [--model M] ...
    extproc bench --target ours=URL_A --target theirs=URL_B --api-key KEY ...
    extproc bench compare RESULTS_A RESULTS_B [--out DIR]
    extproc bench compare RESULTS [--baseline ROUTE]

Several targets are run as one scenario, their rounds interleaved at every level, and put
side by side as ratios against the first.

Exit status: 0 done, 1 a part failed or a phase completed no request, 2 a bad scenario or
flag, 130 interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadlab.compare import (
    CompareError,
    Comparison,
    compare,
    compare_routes,
    load_results,
    print_compare,
    write_compare,
)
from loadlab.engine import Engine, Phase, Record, merge_rounds
from loadlab.harness import Run
from loadlab.parts import Parts, Route
from loadlab.plots import write_plots
from loadlab.quota_watch import BudgetWatch
from loadlab.report import Live, summary_table, write_results
from loadlab.rig import MODEL
from loadlab.scenario import Scenario, ScenarioError, check, load_scenario, parse_scenario
from loadlab.stats import summarize
from loadlab.tables import output_console


def _csv(kind: type, key: str) -> Any:
    def parse(text: str) -> tuple[Any, ...]:
        try:
            values = tuple(kind(x) for x in text.split(",") if x.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{key}: expected a comma-separated list") from None
        if not values:
            raise argparse.ArgumentTypeError(f"{key}: must not be empty")
        return values

    return parse


def run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="extproc bench",
        description="Streaming-latency benchmark runs (docs/benchmarking.md); "
        "'extproc bench compare A B' puts two results folders side by side.",
    )
    p.add_argument("scenario", nargs="?", type=Path, help="scenario YAML (default: built-in)")
    p.add_argument("--out", type=Path, help="results folder (default: results/<name>-<time>)")
    p.add_argument("--quiet", action="store_true", help="no progress bars: a line per phase")
    g = p.add_argument_group("overrides of the scenario file")
    g.add_argument("--name")
    g.add_argument("--seed", type=int)
    g.add_argument("--profile", help="simulator profile (in simulator_profiles/ or a path)")
    g.add_argument("--itl-ms", type=float)
    g.add_argument("--ttft-ms", type=float)
    g.add_argument("--tokens-per-chunk", type=int)
    g.add_argument("--routes", type=_csv(str, "routes"), help="direct,envoy,noop,processor")
    g.add_argument("--charge-modes", type=_csv(str, "charge_modes"))
    g.add_argument("--batch-tokens", type=_csv(int, "batch_tokens"))
    g.add_argument(
        "--admission-leases",
        action=argparse.BooleanOptionalAction,
        help="the processor admits from blocks held in process (its admission_leases)",
    )
    g.add_argument("--budget-tpm", type=int, help="a TPM budget on the processor routes")
    g.add_argument("--window-s", type=int, help="the budget's window (default 60)")
    g.add_argument(
        "--window", type=_csv(str, "window"), help="fixed,sliding: a processor variant each"
    )
    g.add_argument("--bucket-s", type=int, help="a sliding window's bucket (default window/60)")
    g.add_argument("--mode", choices=("closed", "rate"))
    g.add_argument("--levels", type=_csv(float, "levels"), help="streams, or req/s with rate")
    g.add_argument("--requests", type=int, help="requests per route and level (at least)")
    g.add_argument("--rounds", type=int, help="… and at least rounds × level")
    g.add_argument("--duration-s", type=float, help="instead of --requests: seconds per phase")
    g.add_argument("--max-concurrency", type=int)
    g.add_argument("--prompt-tokens", type=int, help="fixed prompt length")
    g.add_argument("--output-tokens", type=int, help="fixed answer length")
    g.add_argument("--warmup-requests", type=int)
    g.add_argument("--timeout-s", type=float)
    g.add_argument("--api", choices=("chat", "completions"), help="the request's API")
    g.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        help="ask for exactly max_tokens tokens (vLLM, llmsim; default on). Off for an API "
        "that refuses the field",
    )
    g.add_argument("--interleave", type=int, help="rounds per level, the routes in turn")
    t = p.add_argument_group("already running endpoints (client-side figures only)")
    t.add_argument(
        "--target",
        action="append",
        help="[NAME=]URL of an OpenAI-compatible endpoint, e.g. http://127.0.0.1:10000 "
        "(http or https); repeat it to compare endpoints side by side",
    )
    t.add_argument(
        "--api-key", action="append", help="its API key: one for all, or one per --target"
    )
    t.add_argument("--model", help="the model to ask for")
    return p


def _targets(args: argparse.Namespace, base: Scenario) -> list[dict[str, Any]] | None:
    """The --target/--api-key flags as the scenario's ``targets`` (None: neither given)."""
    keys = list(args.api_key or [])
    if args.target:
        targets: list[dict[str, Any]] = []
        for value in args.target:
            name, sep, url = value.partition("=")
            if not sep or "://" in name:
                name, url = "", value
            targets.append({"url": url} | ({"name": name} if name else {}))
    elif keys:
        if not base.targets:
            raise ScenarioError("target.api_key", "--api-key needs a --target")
        targets = [t.to_doc() for t in base.targets]
    else:
        return None
    if keys and len(keys) not in (1, len(targets)):
        raise ScenarioError(
            "target.api_key", f"give one --api-key, or one per --target ({len(targets)})"
        )
    for i, target in enumerate(targets):
        if keys:
            target["api_key"] = keys[0] if len(keys) == 1 else keys[i]
        elif args.target is None and base.targets[i].api_key is not None:
            target["api_key"] = base.targets[i].api_key
    return targets


def build_scenario(args: argparse.Namespace) -> Scenario:
    """The file's scenario (or the built-in one) with the flags applied over it; the flags
    become a document of the file's shape, so they pass the same checks and errors."""
    base = load_scenario(args.scenario) if args.scenario is not None else check(Scenario())
    doc: dict[str, Any] = {}

    def put(section: str | None, key: str, value: Any) -> None:
        if value is None:
            return
        value = list(value) if isinstance(value, tuple) else value
        (doc if section is None else doc.setdefault(section, {}))[key] = value

    put(None, "name", args.name)
    put(None, "seed", args.seed)
    put("simulator", "profile", args.profile)
    put("simulator", "itl_ms", args.itl_ms)
    put("simulator", "ttft_ms", args.ttft_ms)
    put("simulator", "tokens_per_chunk", args.tokens_per_chunk)
    put(None, "routes", args.routes)
    put("processor", "charge_modes", args.charge_modes)
    put("processor", "batch_tokens", args.batch_tokens)
    put("processor", "admission_leases", args.admission_leases)
    budget_flags = {"tpm": args.budget_tpm, "window_s": args.window_s,
                    "window": args.window, "bucket_s": args.bucket_s}  # fmt: skip
    if any(v is not None for v in budget_flags.values()):
        budget: dict[str, Any] = {}
        if base.budget is not None:
            b = base.budget
            budget = {"tpm": b.tpm, "window_s": b.window_s, "window": list(b.windows)}
            if b.bucket_s is not None:
                budget["bucket_s"] = b.bucket_s
        if args.window is not None and "sliding" not in args.window:
            budget.pop("bucket_s", None)  # the file's sliding bucket, not the flag's fixed window
        put(None, "processor", doc.get("processor", {}))
        doc["processor"]["budget"] = budget
        budget |= {k: list(v) if isinstance(v, tuple) else v
                   for k, v in budget_flags.items() if v is not None}  # fmt: skip
    put("load", "mode", args.mode)
    put("load", "levels", args.levels)
    if args.requests is not None and args.duration_s is not None:
        raise ScenarioError("load.duration_s", "give --requests or --duration-s, not both")
    if args.requests is not None:
        put("load", "requests", args.requests)
        doc["load"]["duration_s"] = None
    if args.duration_s is not None:
        put("load", "duration_s", args.duration_s)
        doc["load"]["requests"] = None
    put("load", "rounds", args.rounds)
    put("load", "max_concurrency", args.max_concurrency)
    put("load", "prompt_tokens", args.prompt_tokens)
    put("load", "output_tokens", args.output_tokens)
    put("load", "warmup_requests", args.warmup_requests)
    put("load", "timeout_s", args.timeout_s)
    put("load", "api", args.api)
    put("load", "ignore_eos", args.ignore_eos)
    put("load", "interleave", args.interleave)
    put(None, "model", args.model)
    targets = _targets(args, base)
    if targets is not None:
        doc["targets"] = targets
    return parse_scenario(doc, base) if doc else base


async def _level(
    engine: Engine,
    scenario: Scenario,
    routes: Sequence[Route],
    level_index: int,
    live: Live,
    redis_url: str,
    tag: str = "",
) -> list[Phase]:
    """Every route in turn at one level: a change in the machine's load hits all alike. In
    rounds (``rounds_per_level``), forward then backward (ABBA…), merged per route."""
    level = scenario.levels[level_index]
    unit = "streams" if scenario.mode == "closed" else "req/s"
    rounds = scenario.rounds_per_level
    per_round = engine.round_requests(level)
    total = None if per_round is None else per_round * rounds
    done: dict[str, list[Phase]] = {route.name: [] for route in routes}

    def kind(record: Record) -> str:
        if record.outcome == "ok":
            return "ok"
        if scenario.budget is not None and record.outcome in ("cut", "refused"):
            return "cut" if record.outcome == "cut" else "429"  # what a budget does
        return "failed"

    for round_index in range(rounds):
        for route in routes if round_index % 2 == 0 else list(reversed(routes)):
            watch = None
            variant = scenario.variant_of(route.name)
            # A sliding counter has no per-fixed-window figure to read: its check is the
            # busiest interval of what the client received (stats.busiest_interval).
            fixed = variant is not None and variant.window == "fixed"
            if scenario.budget and fixed and route.tenants and redis_url.startswith("redis"):
                watch = BudgetWatch(
                    redis_url, route.tenants[level_index], MODEL, scenario.budget.window_s
                )
                watch.start()
            part = f"round {round_index + 1}/{rounds}" if rounds > 1 else ""
            with live.phase(f"{route.name} @ {level:g} {unit}{tag}", total, part) as advance:
                phase = await engine.run_phase(
                    route, level_index, lambda r: advance(kind(r)), round_index
                )
            if watch is not None:
                phase.charged = await watch.stop()
            done[route.name].append(phase)
    return [merge_rounds(done[route.name]) for route in routes]


def ceiling_trips(phases: Sequence[Phase], scenario: Scenario) -> tuple[list[str], dict[str, Any]]:
    """Why one level counts as saturated for the ceiling's route (empty: it doesn't)."""
    assert scenario.ceiling is not None
    c = scenario.ceiling
    rows = {row["route"]: row for row in summarize(phases, scenario)}
    route = next(r for r in rows if r == c.route or r.startswith(f"{c.route}/"))
    mine, base = rows[route], rows[c.baseline]
    reasons = []
    failed = {r: row["requests"] - row["completed"] for r, row in rows.items()}
    if any(failed.values()):
        reasons.append("failed requests (" + ", ".join(f"{r} {n}" for r, n in failed.items()) + ")")
    ratio = None
    if mine["e2el_ms"]["p99"] and base["e2el_ms"]["p99"]:
        ratio = mine["e2el_ms"]["p99"] / base["e2el_ms"]["p99"]
        if ratio > c.e2el_p99_ratio:
            reasons.append(f"e2el p99 {ratio:.2f}× {c.baseline}'s > {c.e2el_p99_ratio:g}×")
    cpu = mine["cpu_share"].get("processor")
    if cpu is not None and cpu > c.cpu_share:
        reasons.append(f"processor CPU {cpu:.0%} of a core > {c.cpu_share:.0%}")
    figures = {
        "e2el_p99_ratio": None if ratio is None else round(ratio, 3),
        "processor_cpu_share": cpu,
        "machine_cpu_share": mine["cpu_share"].get("machine"),
        "failed": failed,
    }
    return reasons, figures


async def _run(
    scenario: Scenario, routes: Sequence[Route], live: Live, redis_url: str
) -> tuple[list[Phase], dict[str, Any] | None]:
    engine = Engine(scenario)
    for route in routes:
        await engine.warm(route)
    phases: list[Phase] = []
    if scenario.ceiling is None:
        for level_index in range(len(scenario.levels)):
            phases += await _level(engine, scenario, routes, level_index, live, redis_url)
        return phases, None
    ceiling: dict[str, Any] = {"passed_level": None, "stopped_at": None, "attempts": []}
    for level_index, level in enumerate(scenario.levels):
        for attempt in (1, 2):
            tag = f" (attempt {attempt})"
            level_phases = await _level(engine, scenario, routes, level_index, live, redis_url, tag)
            reasons, figures = ceiling_trips(level_phases, scenario)
            ceiling["attempts"].append(
                {"level": level, "attempt": attempt, "reasons": reasons, **figures}
            )
            live.note(
                f"  level {level:g}, attempt {attempt}: {'; '.join(reasons) or 'unsaturated'}"
            )
            if not reasons:
                break
        phases += level_phases  # the level's last attempt
        if reasons:
            ceiling["stopped_at"] = {"level": level, "reasons": reasons}
            break
        ceiling["passed_level"] = level
    return phases, ceiling


def processor_figures(metrics: dict[str, float]) -> dict[str, Any]:
    """The processor's own counts over the run (warm-up included)."""
    events = metrics.get("extproc_sse_events_total", 0.0)
    waited = metrics.get("extproc_events_waited_total", 0.0)
    return {
        "admitted": int(metrics.get("extproc_requests_admitted_total", 0)),
        "admitted_from_blocks": int(metrics.get("extproc_local_admissions_total", 0)),
        "refused": int(metrics.get("extproc_requests_refused_total", 0)),
        "sse_events": int(events),
        "events_waited_on_redis": int(waited),
        "events_waited_share": round(waited / events, 6) if events else None,
        "cutoffs": int(metrics.get("extproc_cutoffs_total", 0)),
    }


def ceiling_line(scenario: Scenario, ceiling: dict[str, Any]) -> str:
    assert scenario.ceiling is not None
    passed, stopped = ceiling["passed_level"], ceiling["stopped_at"]
    head = (
        f"below {scenario.levels[0]:g}" if passed is None else f"{passed:g} (the last level passed)"
    )
    if stopped is None:
        tail = f"not stopped up to {scenario.levels[-1]:g}"
    else:
        tail = f"stopped at {stopped['level']:g} by: {'; '.join(stopped['reasons'])}"
    return f"ceiling of {scenario.ceiling.route} vs {scenario.ceiling.baseline}: {head}; {tail}"


def run(argv: Sequence[str]) -> int:
    args = run_parser().parse_args(list(argv))
    try:
        scenario = build_scenario(args)
    except ScenarioError as exc:
        print(f"extproc bench: invalid scenario: {exc}", file=sys.stderr)
        return 2
    run = Run.begin("extproc bench", args.out, scenario.name)
    out = run.out
    console = output_console()
    info = run.info()
    parts = Parts(scenario, run.logs)

    def work(live: Live) -> tuple[list[Phase], dict[str, Any] | None]:
        live.note(
            f"extproc bench, scenario {scenario.name}: "
            f"routes {', '.join(scenario.route_names)}, "
            f"levels {', '.join(f'{x:g}' for x in scenario.levels)} ({scenario.mode}), "
            f"load average {os.getloadavg()[0]:.1f}; results in {out}"
        )
        routes = parts.start()
        done = asyncio.run(_run(scenario, routes, live, parts.redis_url))
        if parts.processor is not None:
            try:
                info["processor_metrics"] = processor_figures(parts.processor.metrics())
            except OSError:  # a figure less, not a lost run
                info["processor_metrics"] = None
        return done

    result = run.with_parts(parts, args.quiet, work)
    if result is None:
        return run.exit_code
    phases, ceiling = result
    info |= run.finished()
    info["redis_url"] = parts.redis_url or None
    rows = summarize(phases, scenario)
    if ceiling is not None:
        info["ceiling"] = ceiling
    write_results(out, scenario.to_doc(), info, phases, rows)
    plots = write_plots(phases, rows, out / "plots", scenario.mode, scenario.budget is not None)
    summary_table(rows, console)
    if ceiling is not None:
        console.print(ceiling_line(scenario, ceiling))
    if len(scenario.targets) > 1:
        side_by_side = compare_routes(rows)
        write_compare(side_by_side.rows, out)
        print_compare(side_by_side, console)
    console.print(f"results: {out} ({info['wall_s']:.0f}s); plots: {plots.line()}")
    empty = [r for r in rows if r["completed"] == 0]
    for row in empty:
        print(f"extproc bench: {no_request_completed(row, phases)}", file=sys.stderr)
    return 1 if empty else 0


def no_request_completed(row: dict[str, Any], phases: Sequence[Phase]) -> str:
    """Why a phase measured nothing: its outcomes and the first failure's detail."""
    phase = next(p for p in phases if (p.route, p.level) == (row["route"], row["level"]))
    outcomes = ", ".join(f"{k} {n}" for k, n in row["outcomes"].items())
    first = next((r.detail for r in phase.records if r.detail), None)
    why = f"; the first: {first}" if first else ""
    return (
        f"no request completed at {row['route']} @ {row['level']:g} "
        f"({row['requests']} sent: {outcomes or 'none'}){why}"
    )


def compare_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(
        prog="extproc bench compare",
        description="Two results folders side by side (B/A), or one run's routes against "
        "its first (or --baseline). For two gateways on one backend, prefer one run with "
        "two --target flags: the same scenario, rounds interleaved.",
    )
    p.add_argument("a", type=Path)
    p.add_argument("b", type=Path, nargs="?")
    p.add_argument("--baseline", help="with one folder: the route the others are divided by")
    p.add_argument("--out", type=Path, help="where compare.json/csv go (default: B, or A)")
    args = p.parse_args(list(argv))
    try:
        if args.b is None:
            results = load_results(args.a)["results"]
            comparison: Comparison = compare_routes(results, args.baseline)
        else:
            comparison = compare(args.a, args.b)
    except CompareError as exc:
        print(f"extproc bench compare: {exc}", file=sys.stderr)
        return 2
    json_path, csv_path = write_compare(comparison.rows, args.out or args.b or args.a)
    console = output_console()
    print_compare(comparison, console)
    console.print(f"written: {json_path}, {csv_path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "compare":
        return compare_main(argv[1:])
    return run(argv)


if __name__ == "__main__":
    raise SystemExit(main())
