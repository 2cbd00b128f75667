"""A table of the instability precursors `merit train` records at each eval (docs/DIAGNOSTICS.md), carried
from a run's final eval record into compare's summary.json and rendered in REPORT.md for each best
run: max attention logit, smallest normalised attention entropy, largest residual-stream
activation ratio, mean output log Z and (MERIT) largest update / weight ratio."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from merit_core.compare.results import CompareSummary
from merit_core.compare.verdicts import no_verdict
from merit_core.metric_names import (
    ACTIVATION_RATIO,
    LOG_Z_MEAN,
    MAX_ATTENTION_LOGIT,
    NORMALIZED_ENTROPY_MIN,
    UPDATE_RATIO,
)
from merit_core.precursors import over_layers


def instability_record(final: Mapping[str, Any] | None) -> dict[str, float | None] | None:
    """From a run's final eval record: each precursor as one number over the layers
    (merit_core.precursors.over_layers: the max logit and activation ratio by max, the min normalised
    entropy by min), the mean log Z and the update ratio; None when the run recorded none of them."""
    if not final:
        return None
    keys = (MAX_ATTENTION_LOGIT, NORMALIZED_ENTROPY_MIN, ACTIVATION_RATIO, LOG_Z_MEAN, UPDATE_RATIO)
    out = {key: over_layers(key, final.get(key)) for key in keys}
    return out if any(out[k] is not None for k in (NORMALIZED_ENTROPY_MIN, ACTIVATION_RATIO, LOG_Z_MEAN)) else None


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def instability_lines(summary: CompareSummary) -> list[str]:
    """Markdown: one row per best run (its first seed) with the precursors at the end of training."""
    entries = [b for b in summary.best if b.instability]
    if not entries:
        return []
    which = "the one lr's first seed: a smoke run" if no_verdict(summary) else "the best lr's first seed"
    lines = [
        f"At the end of training, on the run's first validation batch ({which}; "
        "definitions and healthy values in docs/DIAGNOSTICS.md):",
        "",
        "| optimizer | batch | max attention logit | min entropy / log n | max activation ratio | mean log Z "
        "| max update / weight |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for b in entries:
        keys = (MAX_ATTENTION_LOGIT, NORMALIZED_ENTROPY_MIN, ACTIVATION_RATIO, LOG_Z_MEAN, UPDATE_RATIO)
        cells = [_cell((b.instability or {}).get(k)) for k in keys]
        lines.append(f"| {b.optimizer} | {b.batch_size} | " + " | ".join(cells) + " |")
    return lines
