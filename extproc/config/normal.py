"""The normal form of a validated configuration: a canonical plain document (defaults filled
in, overrides merged, every limit as a rule, secrets only as whether they are set), which
``extproc check-config`` prints and whose sha256 replicas compare (``Config.hash``)."""

from __future__ import annotations

import re
from typing import Any

from extproc.config import limits
from extproc.config.schema import Config, LimitSpec, PlanSpec

# Normal-form fields that differ between replicas of one deployment: not in the hash.
PER_REPLICA_FIELDS = frozenset({"listen", "health_listen"})


def normal_form(config: Config) -> dict[str, Any]:
    """A canonical plain form: defaults filled in, overrides merged, secrets only as hashes."""

    def entries(spec: dict[str, LimitSpec]) -> dict[str, Any]:
        return {
            k: {"rules": [limits.normal_rule(r) for r in v.rules], "batch_tokens": v.batch_tokens}
            for k, v in sorted(spec.items())
        }

    def plan(p: PlanSpec) -> dict[str, Any]:
        # Every limit as a rule, whichever form (sugar, rules, RLS) defined it.
        return {
            "limits": entries(p.limits),
            "tenant_rules": [limits.normal_rule(r) for r in p.tenant_rules],
            "charge_mode": p.charge_mode,
            "batch_tokens": p.batch_tokens,
            "on_exhaustion": p.on_exhaustion,
            "on_backend_failure": p.on_backend_failure,
            "fail_open_fraction": p.fail_open_fraction,
        }

    return {
        "listen": config.listen,
        "redis_url": redact(config.redis_url),
        "key_prefix": config.key_prefix,
        "max_body_bytes": config.max_body_bytes,
        "rpm_counts": config.rpm_counts,
        "shutdown_grace_s": config.shutdown_grace_s,
        "drain_delay_s": config.drain_delay_s,
        "stream_idle_timeout_s": config.stream_idle_timeout_s,
        "quota_timeout_ms": round(config.quota_timeout_s * 1000),
        "refund_wait_ms": round(config.refund_wait_s * 1000),
        "image_tokens": config.image_tokens,
        "default_model": config.default_model,
        "tokenizers": list(config.tokenizers) if config.tokenizers is not None else None,
        "circuit_breaker": {
            "failures": config.circuit_breaker.failures,
            "probe_interval_ms": round(config.circuit_breaker.probe_interval_s * 1000),
        },
        "settle_queue_max": config.settle_queue_max,
        "heartbeat_ttl_s": config.heartbeat_ttl_s,
        "orphan_sweep_s": config.orphan_sweep_s,
        # Only whether a password is set: it never reaches logs or hashes.
        "redis_auth": {
            "username": config.redis_username,
            "password": config.redis_password is not None,
        },
        "tls": None
        if config.tls is None
        else {
            "cert_file": config.tls.cert_file,
            "key_file": config.tls.key_file,
            "client_ca_file": config.tls.client_ca_file,
            "require_client_cert": config.tls.require_client_cert,
        },
        "health_listen": config.health_listen,
        "usage_ledger": {
            "enabled": config.usage_ledger.enabled,
            "max_len": config.usage_ledger.max_len,
            "retention_s": config.usage_ledger.retention_s,
        },
        "admission_leases": {
            "enabled": config.admission_leases.enabled,
            "fraction": config.admission_leases.fraction,
            "idle_ms": round(config.admission_leases.idle_s * 1000),
        },
        "models": {
            m.name: {
                "aliases": sorted(m.aliases),
                "tokenizer": m.tokenizer,
                "max_tokens": m.max_tokens,
                "default_max_tokens": m.default_max_tokens,
                "upstream_name": m.served_name,
                "continuous_usage": m.continuous_usage,
                "reserve_max": m.reserve_max,
                "usage_authority": m.usage_authority,
                "usage_tolerance": m.usage_tolerance,
                "prices": None
                if m.prices is None
                else {
                    "input": m.prices.input,
                    "output": m.prices.output,
                    "cached_input": m.prices.cached_input,
                    "unit": "nano per token",
                },
                # Only whether a credential is set: the secret never reaches logs or hashes.
                "upstream_credential": m.upstream_authorization is not None,
            }
            for m in sorted(config.models.values(), key=lambda m: m.name)
        },
        "plans": {name: plan(p) for name, p in sorted(config.plans.items())},
        "tenants": {
            t.id: {
                "plan": plan(t.plan),
                "plan_name": t.plan.name,
                "key_sha256": sorted(t.key_sha256),
            }
            for t in sorted(config.tenants.values(), key=lambda t: t.id)
        },
    }


def redact(url: str) -> str:
    """Drop the password from a Redis URL so the normalised form can be printed and logged."""
    url = re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", url)
    return re.sub(r"(sentinel_password=)[^&]*", r"\1***", url)
