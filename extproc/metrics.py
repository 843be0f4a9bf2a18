"""Process-wide counters, exported as Prometheus text on the optional metrics port.

Plain integers on one event loop: no locks and ~20 ns per increment on the hot path.
"""

from __future__ import annotations

from collections import Counter as _Tally
from dataclasses import dataclass, field


@dataclass
class Metrics:
    admitted_total: int = 0
    refused: _Tally[str] = field(default_factory=_Tally)
    settled: _Tally[str] = field(default_factory=_Tally)
    cutoffs_total: int = 0
    lease_batches_total: int = 0
    lease_refusals_total: int = 0
    quota_round_trips_total: int = 0
    body_messages_total: int = 0
    events_total: int = 0
    events_waited_total: int = 0  # events held back while a lease batch was being reserved
    usage_disagreements_total: int = 0
    malformed_events_total: int = 0
    settle_errors_total: int = 0
    tokenizer_fallbacks_total: int = 0
    lost_admissions_total: int = 0  # admissions whose reply was lost: cancelled by key
    lease_failures_total: int = 0  # lease batches the backend could not answer
    lease_retries_total: int = 0  # refused leases asked again (others held reservations)
    admission_waits_total: int = 0  # admissions asked again (others held reservations)
    # Records of dead processors this one settled (used = reserved): extproc.quota.orphans.
    orphan_settlements_total: int = 0
    heartbeat_lapses_total: int = 0  # this processor's heartbeat was found expired
    liveness_errors_total: int = 0  # heartbeat/registration/sweep calls that failed
    # Backend faults (extproc.quota.resilient). Gauges: quota_breaker_open, quota_queue_depth.
    quota_breaker_open: int = 0  # 1 while the circuit breaker keeps calls off the backend
    quota_breaker_opened_total: int = 0
    quota_breaker_probes_total: int = 0  # calls that reached the backend while it was open
    quota_backend_calls_total: int = 0  # quota calls sent to the backend (probes not included)
    quota_backend_failures_total: int = 0  # of those, the ones that failed
    quota_short_circuited_total: int = 0  # calls answered without the backend (breaker open)
    fail_open_admissions_total: int = 0  # admitted from the local allowance
    fail_open_refusals_total: int = 0  # local allowance used up: 503 quota_unavailable
    fail_open_lease_batches_total: int = 0  # lease batches granted from the local allowance
    fail_open_tokens_total: int = 0  # tokens granted locally (admissions + batches)
    reconciled_reservations_total: int = 0  # local reservations charged into the backend
    reconciled_tokens_total: int = 0  # tokens served locally and charged into the backend
    quota_queue_depth: int = 0  # settlements, cancels, reconciliations waiting
    quota_queued_total: int = 0
    quota_queue_applied_total: int = 0
    quota_queue_dropped_total: int = 0  # queue full (or a call that kept failing): lost
    config_reloads_total: int = 0  # new configurations installed (extproc.config.reload)
    config_reload_failures_total: int = 0  # reloads refused: the old configuration stayed

    def refusal(self, code: str) -> None:
        self.refused[code] += 1

    def prometheus(self) -> str:
        lines: list[str] = []
        for name in (
            "admitted_total",
            "cutoffs_total",
            "lease_batches_total",
            "lease_refusals_total",
            "quota_round_trips_total",
            "body_messages_total",
            "events_total",
            "events_waited_total",
            "usage_disagreements_total",
            "malformed_events_total",
            "settle_errors_total",
            "tokenizer_fallbacks_total",
            "lost_admissions_total",
            "lease_failures_total",
            "lease_retries_total",
            "admission_waits_total",
            "orphan_settlements_total",
            "heartbeat_lapses_total",
            "liveness_errors_total",
            "quota_breaker_open",
            "quota_breaker_opened_total",
            "quota_breaker_probes_total",
            "quota_backend_calls_total",
            "quota_backend_failures_total",
            "quota_short_circuited_total",
            "fail_open_admissions_total",
            "fail_open_refusals_total",
            "fail_open_lease_batches_total",
            "fail_open_tokens_total",
            "reconciled_reservations_total",
            "reconciled_tokens_total",
            "quota_queue_depth",
            "quota_queued_total",
            "quota_queue_applied_total",
            "quota_queue_dropped_total",
            "config_reloads_total",
            "config_reload_failures_total",
        ):
            lines.append(f"extproc_{name} {getattr(self, name)}")
        for code, n in sorted(self.refused.items()):
            lines.append(f'extproc_refused_total{{code="{code}"}} {n}')
        for reason, n in sorted(self.settled.items()):
            lines.append(f'extproc_settled_total{{reason="{reason}"}} {n}')
        return "\n".join(lines) + "\n"
