"""Reading metrics.jsonl, a run folder's training curve (written by train/metrics.py's MetricsLog):
one JSON object per line, each with `step` and `tokens`.

Log lines add `loss`, `lr`, `grad_norm`, `tokens_per_s`; eval lines add `val_loss` and
`max_attention_logit` (one value per layer). Non-finite numbers are written as null (json_safe).
Next to runs.py so that inspect, compare and the training loop read a run's curve from one place.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from merit_core.fileio import open_regular
from merit_core.runs import METRICS_FILE


def json_safe(value: Any) -> Any:
    """Floats that are nan/inf become None; lists and dicts are cleaned recursively."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    return value


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All records of a metrics.jsonl (or of <run>/metrics.jsonl); a torn line is skipped.

    ValueError for a line that parses but is not a record (a number, a list, an object whose
    `step` is not an integer): merit never wrote it, and resuming would trip over it later.
    CheckpointError for a FIFO, socket or device in its place (reading it could block forever)."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    records: list[dict[str, Any]] = []
    if not path.exists():
        return records
    with open_regular(path) as fh:
        text = fh.read().decode("utf-8")
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        step = record.get("step", 0) if isinstance(record, dict) else None
        if not isinstance(step, int) or isinstance(step, bool):
            raise ValueError(f"line {number} is not a metrics record (a JSON object with an integer step)")
        records.append(record)
    return records
