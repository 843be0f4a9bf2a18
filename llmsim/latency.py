"""Time to first token and inter-token latency, following the real simulator's model.

Prefill is ``time-to-first-token`` (``constant``) or ``prefill-overhead + n ×
prefill-time-per-token`` (``per-token``); decode is ``inter-token-latency`` per token.
GPU-bound parts grow linearly with the running requests up to ``time-factor-under-load`` at
``max-num-seqs``. Jitter is Gaussian, clamped to ±70% of the mean, as documented there.
"""

from __future__ import annotations

import random

from llmsim.settings import SimConfig


def jitter(mean: float, std_dev: float, rng: random.Random) -> float:
    if std_dev <= 0 or mean <= 0:
        return max(0.0, mean)
    return min(1.7 * mean, max(0.3 * mean, rng.gauss(mean, std_dev)))


def load_factor(cfg: SimConfig, running: int) -> float:
    """1.0 with one request running, ``time-factor-under-load`` with ``max-num-seqs``."""
    if cfg.max_num_seqs <= 1 or cfg.time_factor_under_load == 1.0:
        return 1.0
    busy = min(max(running, 1), cfg.max_num_seqs)
    return 1 + (cfg.time_factor_under_load - 1) * (busy - 1) / (cfg.max_num_seqs - 1)


def _uses_per_token(cfg: SimConfig) -> bool:
    if cfg.latency_calculator == "per-token":
        return True
    if cfg.latency_calculator == "constant":
        return False
    # Unset calculator: the legacy rule, constant form whenever a TTFT is configured.
    return cfg.time_to_first_token == 0 and cfg.time_to_first_token_std_dev == 0


def time_to_first_token(
    cfg: SimConfig, prompt_tokens: int, running: int, rng: random.Random
) -> float:
    factor = load_factor(cfg, running)
    if _uses_per_token(cfg):
        mean = (cfg.prefill_overhead + prompt_tokens * cfg.prefill_time_per_token) * factor
        return jitter(mean, cfg.prefill_time_std_dev, rng)
    return jitter(cfg.time_to_first_token * factor, cfg.time_to_first_token_std_dev, rng)


def inter_token_latency(cfg: SimConfig, running: int, rng: random.Random) -> float:
    mean = cfg.inter_token_latency * load_factor(cfg, running)
    return jitter(mean, cfg.inter_token_latency_std_dev, rng)
