"""Writing metrics.jsonl during training (MetricsLog); its format and reading are merit_core/metrics.py's
(json_safe and read_metrics are importable from here too)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from merit_core.checkpoint.runs import METRICS_FILE
from merit_core.fileio import atomic_write, refuse_link
from merit_core.metrics import json_safe, read_metrics


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


__all__ = ["MetricsLog", "json_safe", "read_metrics"]
