"""The Grafana dashboard: valid JSON with the panels the operators need, and every metric
name in every PromQL expression served by a real running processor or simulator (their
/metrics list every family in HELP/TYPE lines, with or without samples)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator

import openai

from loadlab.gateway import http_get
from loadlab.simulator import running_simulator
from tests.deploy.conftest import DEPLOY, PRO_KEY, Deployed, load_yaml

DASHBOARD = json.loads((DEPLOY / "grafana" / "extproc-dashboard.json").read_text())
NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
            "unless", "offset", "le", "inf", "nan"}  # fmt: skip
# Families llm-d-inference-sim v0.10.2 serves (metrics.go): the dashboard's vllm:* must be
# among them as well as in llmsim's /metrics.
REAL_SIM_FAMILIES = {
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
    "vllm:time_to_first_token_seconds", "vllm:time_per_output_token_seconds",
    "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds", "vllm:request_inference_time_seconds",
    "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
    "vllm:request_prompt_tokens", "vllm:request_generation_tokens",
    "vllm:max_num_generation_tokens", "vllm:request_params_max_tokens",
}  # fmt: skip


def expressions() -> Iterator[tuple[str, str]]:
    for panel in DASHBOARD["panels"]:
        for target in panel.get("targets", []):
            yield panel["title"], target["expr"]


def metric_names(expr: str) -> set[str]:
    """Series names in a PromQL expression: identifiers that are not functions, keywords,
    label names, durations or Grafana variables."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # label values
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges
    expr = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", expr)  # grouping labels
    expr = re.sub(r"\$\w+", "", expr)
    names = set()
    for match in re.finditer(NAME, expr):
        word = match.group(0)
        following = expr[match.end() :].lstrip()
        if following.startswith("(") or word.lower() in KEYWORDS:
            continue  # a function call, or a keyword
        if re.fullmatch(r"\d.*", word):
            continue
        names.add(word)
    return names


def served_series(text: str) -> set[str]:
    """Every series name a /metrics text can have, from its TYPE lines."""
    out = set()
    for name, kind in re.findall(r"^# TYPE (\S+) (\w+)$", text, re.M):
        if kind == "histogram":
            out |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
        elif kind == "summary":
            out |= {name, f"{name}_sum", f"{name}_count"}
        else:
            out.add(name)
    return out


def dashboard_names(prefix: str) -> dict[str, str]:
    """Metric name -> the panel that uses it, for names with ``prefix``."""
    out = {}
    for title, expr in expressions():
        for name in metric_names(expr):
            if name.startswith(prefix):
                out.setdefault(name, title)
    return out


def test_metric_names_are_extracted_from_promql():
    expr = (
        "histogram_quantile(0.99, sum by (le, operation) (rate(extproc_quota_backend_duration_"
        'seconds_bucket{job=~"$job"}[$__rate_interval]))) > 0 and on (instance) '
        "count(count by (config_hash) (extproc_info)) > 1"
    )
    assert metric_names(expr) == {"extproc_quota_backend_duration_seconds_bucket", "extproc_info"}
    assert metric_names('sum by (model_name) (vllm:num_requests_running{job=~"$j"})') == {
        "vllm:num_requests_running"
    }


def test_dashboard_is_grafana_json_with_the_required_panels():
    assert DASHBOARD["uid"] and DASHBOARD["title"]
    ids = [p["id"] for p in DASHBOARD["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in DASHBOARD["templating"]["list"]}
    for title, expr in expressions():
        used = set(re.findall(r"\$(\w+)", expr)) - {"__rate_interval"}
        assert used <= variables, f"{title}: undefined {used - variables}"
    exprs = [e for _, e in expressions()]
    assert any(
        re.fullmatch(r"count\(count by \(config_hash\) \(extproc_info\{[^}]*\}\)\) > 1", e)
        for e in exprs
    )
    names = dashboard_names("")
    for histogram in (
        "extproc_admission_duration_seconds",
        "extproc_prompt_count_duration_seconds",
        "extproc_quota_backend_duration_seconds",
        "extproc_lease_wait_seconds",
        "extproc_message_duration_seconds",
    ):
        quantiles = {
            q for e in exprs if f"{histogram}_bucket" in e
            for q in re.findall(r"histogram_quantile\((0\.\d+)", e)
        }  # fmt: skip
        assert quantiles == {"0.5", "0.99"}, histogram
    for counter in (
        "extproc_requests_admitted_total",
        "extproc_requests_refused_total",
        "extproc_tokens_total",
        "extproc_cutoffs_total",
        "extproc_settlements_total",
        "extproc_quota_breaker_open",
        "extproc_quota_queue_depth",
        "process_resident_memory_bytes",
        "process_cpu_seconds_total",
        "vllm:generation_tokens_total",
    ):
        assert counter in names, counter


def test_every_vllm_metric_of_the_dashboard_is_the_real_simulators():
    names = dashboard_names("vllm:")
    assert names
    families = {re.sub(r"_(bucket|sum|count)$", "", n) for n in names}
    assert families <= REAL_SIM_FAMILIES, families - REAL_SIM_FAMILIES


def test_every_vllm_metric_of_the_dashboard_is_served_by_the_simulator(tmp_path):
    with running_simulator("fast.yaml", log_dir=tmp_path) as sim:
        _, text = http_get(sim.url("/metrics"))
    missing = {n: t for n, t in dashboard_names("vllm:").items() if n not in served_series(text)}
    assert not missing, missing


# The processor's metrics are being rewritten on prometheus_client in parallel: until that
# lands, most of the dashboard's extproc_* names are not served yet. Strict: once they are,
# this XPASSes and fails, and the marker goes.
def test_every_processor_metric_of_the_dashboard_is_served_by_the_processor(deployed: Deployed):
    client = openai.OpenAI(base_url=f"{deployed.base_url}/v1", api_key=PRO_KEY, max_retries=0)
    for stream in (True, False):  # a request of each kind through Envoy first
        client.completions.create(model="gpt-4.1", prompt="x", max_tokens=3, stream=stream)
    processor = deployed.processors[0]
    _, text = http_get(f"http://127.0.0.1:{processor.metrics_port}/metrics")
    served = served_series(text)
    used = dashboard_names("extproc_") | dashboard_names("process_")
    missing = {n: t for n, t in used.items() if n not in served}
    assert not missing, missing


def test_compose_healthcheck_passes_against_a_serving_processor(deployed: Deployed):
    processor = deployed.processors[0]
    compose = load_yaml(DEPLOY / "docker-compose.yaml")
    test = compose["services"]["extproc"]["healthcheck"]["test"]
    assert test[:3] == ["CMD", "python", "-c"]
    code = test[3].replace("127.0.0.1:50051", f"127.0.0.1:{processor.port}")
    assert code != test[3]
    ok = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    assert ok.returncode == 0, ok.stderr.decode()[-2000:]
    # Against a port nothing serves, the same check fails.
    dead = code.replace(f"127.0.0.1:{processor.port}", "127.0.0.1:1")
    assert subprocess.run([sys.executable, "-c", dead], capture_output=True, timeout=60).returncode
