"""metrics.jsonl: one JSON object per line, each with `step` and `tokens`.

Log lines add `loss`, `lr`, `grad_norm`, `tokens_per_s`; eval lines add `val_loss` and
`max_attention_logit` (one value per layer). Non-finite numbers are written as null.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from merit_core.fileio import atomic_write, refuse_link
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


class MetricsLog:
    """Appends records to <run>/metrics.jsonl, flushed per line."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / METRICS_FILE

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps(json_safe(record), allow_nan=False) + "\n"
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(self.path, flags, 0o666)  # never appends through a link planted at the name
        except OSError:
            refuse_link(self.path, "in a run folder")
            raise
        with os.fdopen(fd, "a", encoding="utf-8") as fh:
            fh.write(line)

    def truncate_after(self, step: int) -> None:
        """Drop records of steps after `step` (what a crash left past the resumed checkpoint)."""
        if not self.path.exists():
            return
        kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= step]
        atomic_write(self.path, "".join(json.dumps(r) + "\n" for r in kept))

    def reset(self) -> None:
        self.path.unlink(missing_ok=True)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All records of a metrics.jsonl (or of <run>/metrics.jsonl); a torn line is skipped.

    ValueError for a line that parses but is not a record (a number, a list, an object whose
    `step` is not an integer): merit never wrote it, and resuming would trip over it later."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    records = []
    if not path.exists():
        return records
    for number, line in enumerate(path.read_text().splitlines(), 1):
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
