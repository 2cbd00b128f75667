"""metrics.jsonl, a run folder's training curve: the one module that knows its name and format, with
its one writer (`MetricsLog`) and its one reader (`read_metrics`).

One JSON object per line, a `MetricsRecord`: each has `step` and `tokens`; log lines add `loss`,
`lr`, `grad_norm`, `tokens_per_s`; eval lines add `val_loss` and, per layer, `max_attention_logit`
and the other instability precursors (merit_core.metric_names). Non-finite numbers are written as
null (json_safe). Inspect, compare, eval and the training loop read a run's curve from here.

A new kind of line (a warning, say) is a record with `step`, `tokens` and keys of its own: add
their names to merit_core.metric_names and to `MetricsRecord` (each optional, as every key but
step and tokens is), and write it with `MetricsLog.write`. Readers that pick log or eval lines
(`log_lines`, `eval_lines`) pass over it.
"""

import json
import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Required, TypedDict

from merit_core.durable_writes import atomic_write, refuse_link
from merit_core.file_reading import open_regular
from merit_core.metric_names import LOSS, STEP, VAL_LOSS

METRICS_FILE = "metrics.jsonl"


# (No `from __future__ import annotations` here: TypedDict reads Required[...] from evaluated annotations.)
class MetricsRecord(TypedDict, total=False):
    """One line of metrics.jsonl (its keys are merit_core.metric_names' spellings; None: a
    non-finite number). Lists hold one value per layer."""

    step: Required[int]
    tokens: Required[int]
    # a log line
    loss: float | None
    lr: float
    grad_norm: float | None
    tokens_per_s: float
    # an eval line
    val_loss: float | None
    max_attention_logit: list[float | None]
    normalized_attention_entropy_min: list[float | None]
    activation_ratio: list[float | None]
    log_z_mean: float | None
    update_rms_ratio: float | None


def json_safe(value: Any) -> Any:
    """Floats that are nan/inf become None; lists and dicts are cleaned recursively."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    return value


def count_non_finite(value: Any) -> int:
    """How many floats in `value` (lists and dicts searched recursively) `json_safe` turns into None."""
    if isinstance(value, float):
        return 0 if math.isfinite(value) else 1
    if isinstance(value, (list, tuple)):
        return sum(count_non_finite(v) for v in value)
    if isinstance(value, dict):
        return sum(count_non_finite(v) for v in value.values())
    return 0


def read_metrics(path: str | Path) -> list[MetricsRecord]:
    """All records of a metrics.jsonl (or of <run>/metrics.jsonl); a torn line is skipped.

    ValueError for a line that parses but is not a record (a number, a list, an object whose
    `step` is not an integer): merit never wrote it, and resuming would trip over it later.
    CheckpointError for a FIFO, socket or device in its place (reading it could block forever)."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    records: list[MetricsRecord] = []
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
        except (json.JSONDecodeError, RecursionError):  # torn, or nested deeper than any record merit writes
            continue
        step = record.get(STEP, 0) if isinstance(record, dict) else None
        if not isinstance(step, int) or isinstance(step, bool):
            raise ValueError(f"line {number} is not a metrics record (a JSON object with an integer step)")
        records.append(record)
    return records


def log_lines(records: Iterable[MetricsRecord]) -> list[MetricsRecord]:
    """The log lines (those with a training loss) of `records`, in order."""
    return [r for r in records if LOSS in r]


def eval_lines(records: Iterable[MetricsRecord]) -> list[MetricsRecord]:
    """The eval lines (those with a validation loss) of `records`, in order."""
    return [r for r in records if VAL_LOSS in r]


class MetricsLog:
    """Appends records to <run>/metrics.jsonl, one line each, written whole per record."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / METRICS_FILE

    def write(self, record: Mapping[str, Any]) -> None:
        """Append one record (a MetricsRecord's keys), its non-finite numbers as null."""
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
