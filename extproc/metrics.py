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
        ):
            lines.append(f"extproc_{name} {getattr(self, name)}")
        for code, n in sorted(self.refused.items()):
            lines.append(f'extproc_refused_total{{code="{code}"}} {n}')
        for reason, n in sorted(self.settled.items()):
            lines.append(f'extproc_settled_total{{reason="{reason}"}} {n}')
        return "\n".join(lines) + "\n"
