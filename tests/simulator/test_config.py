"""Profiles and flags: precedence, Go durations, clear startup errors, ignored keys, ranks."""

from __future__ import annotations

import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from llmsim.durations import format_duration, parse_duration
from llmsim.settings import ConfigError, build_config
from loadlab.procs import free_port
from loadlab.simulator import PROFILES_DIR, REPO_ROOT, running_simulator


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("250us", 250e-6),
        ("250µs", 250e-6),
        ("12ms", 0.012),
        ("1.5s", 1.5),
        ("1m30s", 90.0),
        ("0", 0.0),
        ("2000", 2.0),
        ("-5ms", -0.005),
    ],
)
def test_go_durations_parse_to_seconds(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)
    assert parse_duration(format_duration(seconds)) == pytest.approx(seconds)


def test_flags_override_sim_model_which_overrides_yaml(tmp_path: Path):
    profile = tmp_path / "p.yaml"
    profile.write_text("model: from-yaml\nmax-num-seqs: 3\ninter-token-latency: 12ms\n")
    assert build_config(profile, {}, {}).model == "from-yaml"
    assert build_config(profile, {}, {"SIM_MODEL": "from-env"}).model == "from-env"
    cfg = build_config(profile, {"model": "from-flag", "max-num-seqs": "7"}, {"SIM_MODEL": "e"})
    assert (cfg.model, cfg.max_num_seqs, cfg.inter_token_latency) == ("from-flag", 7, 0.012)


def test_every_shipped_profile_loads():
    for path in sorted(PROFILES_DIR.glob("*.yaml")):
        cfg = build_config(path, {}, {})
        assert cfg.model, path


def _start_error(tmp_path: Path, profile_text: str, *flags: str) -> tuple[int, str]:
    profile = tmp_path / "bad.yaml"
    profile.write_text(profile_text)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "llmsim",
            "--config",
            str(profile),
            "--port",
            str(free_port()),
            *flags,
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return proc.returncode, proc.stderr


@pytest.mark.parametrize(
    ("profile_text", "key"),
    [
        ("model: m\ninter-token-latency: -5ms\n", "inter-token-latency"),
        (
            "model: m\ntime-to-first-token: 100ms\ntime-to-first-token-std-dev: 40ms\n",
            "time-to-first-token-std-dev",
        ),
        ("model: m\nfailure-injection-rate: 101\n", "failure-injection-rate"),
        ("model: m\nfailure-types: [rate_limit, gremlins]\n", "failure-types"),
        ("model: m\nmax-num-sequences: 4\n", "max-num-sequences"),
        ("model: m\next-disconect-rate: 4\n", "ext-disconect-rate"),
        ("model: m\nprefill-time-per-token: fast\n", "prefill-time-per-token"),
        ("mode: random\n", "model"),
        ("model: m\next-tokenizer: p50k_base\n", "p50k_base"),
    ],
)
def test_invalid_profile_fails_at_startup_naming_the_key(tmp_path, profile_text, key):
    code, stderr = _start_error(tmp_path, profile_text)
    assert code == 2
    assert key in stderr


def test_invalid_flag_value_fails_at_startup_naming_the_key(tmp_path):
    code, stderr = _start_error(tmp_path, "model: m\n", "--ext-stall-rate", "250")
    assert code == 2
    assert "ext-stall-rate" in stderr


def test_keys_of_the_real_simulator_we_ignore_warn_once_and_still_serve(tmp_path):
    profile = tmp_path / "real.yaml"
    profile.write_text(
        "model: m\nenable-kvcache: true\nkv-cache-size: 1024\nlora-modules: []\n"
        "kv-cache-transfer-latency: 5ms\n"
    )
    with running_simulator(profile, "--tensor-parallel-size", "2", log_dir=tmp_path) as sim:
        with urllib.request.urlopen(sim.url("/v1/models")) as resp:
            assert resp.status == 200
        log = sim.log_text()
    for key in ("enable-kvcache", "kv-cache-size", "lora-modules", "tensor-parallel-size"):
        assert log.count(f"'{key}' is not implemented by llmsim") == 1, key


def _two_free_ports() -> int:
    for _ in range(50):
        port = free_port()
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two consecutive free ports")


def test_data_parallel_ranks_serve_on_consecutive_ports(tmp_path):
    from loadlab.simulator import Simulator

    port = _two_free_ports()
    sim = Simulator("fast.yaml", "--data-parallel-size", "2", port=port, log_dir=tmp_path)
    try:
        for rank_port in (port, port + 1):
            with urllib.request.urlopen(f"http://127.0.0.1:{rank_port}/health") as resp:
                assert resp.status == 200
            with urllib.request.urlopen(f"http://127.0.0.1:{rank_port}/v1/models") as resp:
                assert b"gpt-4.1" in resp.read()
    finally:
        sim.stop()


def test_config_error_message_names_key():
    with pytest.raises(ConfigError) as raised:
        build_config(None, {"model": "m", "max-num-seqs": "0"}, {})
    assert raised.value.key == "max-num-seqs"
