"""Read a processor's /metrics text (prometheus_client's exposition) into flat figures."""

from __future__ import annotations

from collections import defaultdict

from prometheus_client.parser import text_string_to_metric_families


def parse_metrics(text: str) -> dict[str, float]:
    """Every sample as ``name{k="v",...}``, plus sums: ``name`` over all of its samples and
    ``name{k="v"}`` over the samples with that one label value (e.g. settlements by
    reason whatever the model). ``_created`` samples are left out."""
    out: dict[str, float] = defaultdict(float)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            labels = sample.labels
            if labels:
                full = ",".join(f'{k}="{v}"' for k, v in labels.items())
                out[f"{sample.name}{{{full}}}"] = sample.value
                out[sample.name] += sample.value
                if len(labels) > 1:
                    for k, v in labels.items():
                        out[f'{sample.name}{{{k}="{v}"}}'] += sample.value
            else:
                out[sample.name] = sample.value
    return dict(out)
