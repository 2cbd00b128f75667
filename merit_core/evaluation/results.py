"""Evaluation result records: one per checkpoint, flattened into metric rows, written as JSON.

JSON shape: {"checkpoints": [{"path": str, "results": <lm-eval's results dict, unchanged>, "meta": {...}}]};
a run over several devices adds "devices": {"split": "checkpoints", "workers": [device, ...]} and, when a
checkpoint was not scored, "missing": [{"path": str, "error": str}].
"""

from __future__ import annotations

import datetime
import json
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from merit_core.durable_writes import atomic_write, write_new_file
from merit_core.errors import ConfigError
from merit_core.output_checks import check_path_names, refuse_dangling_parents

_NOT_METRICS = {"alias", "name", "sample_len", "samples", " "}


@dataclass
class CheckpointResult:
    """lm-eval's per-task results for one checkpoint, with where it came from and how it was evaluated."""

    path: str
    label: str
    results: dict[str, dict[str, Any]]
    meta: dict[str, Any]
    lm_eval: dict[str, Any] | None = field(default=None, repr=False)  # simple_evaluate's whole output

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "results": self.results, "meta": self.meta}


@dataclass(frozen=True)
class MetricRow:
    """One (task, metric) line of the results table, with a value and stderr per checkpoint."""

    task: str
    metric: str  # 'acc', or 'acc (filter)' for a filter other than lm-eval's 'none'
    higher_is_better: bool | None
    values: tuple[float | None, ...]
    stderrs: tuple[float | None, ...]


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None  # lm-eval writes "N/A" for a stderr it did not compute
    return float(value)


def metric_rows(records: Sequence[CheckpointResult]) -> list[MetricRow]:
    """Every (task, metric, filter) found in any record, in first-seen order, aligned across records."""
    keys: dict[tuple[str, str, str], None] = {}
    for record in records:
        for task, metrics in record.results.items():
            for key in metrics:
                name, _, filt = key.partition(",")
                if name in _NOT_METRICS or name.endswith("_stderr") or not filt:
                    continue
                keys.setdefault((task, name, filt), None)
    rows = []
    for task, name, filt in keys:
        values, stderrs, better = [], [], None
        for record in records:
            metrics = record.results.get(task, {})
            values.append(_number(metrics.get(f"{name},{filt}")))
            stderrs.append(_number(metrics.get(f"{name}_stderr,{filt}")))
            hib = ((record.meta.get("eval") or {}).get("higher_is_better") or {}).get(task, {})
            if better is None and isinstance(hib, dict) and isinstance(hib.get(name), bool):
                better = hib[name]
        label = name if filt == "none" else f"{name} ({filt})"
        rows.append(MetricRow(task, label, better, tuple(values), tuple(stderrs)))
    return rows


def _fmt(value: float) -> str:
    return f"{value:.4g}" if math.isfinite(value) and abs(value) >= 1e5 else f"{value:.4f}"


def format_value(value: float | None, stderr: float | None = None) -> str:
    """'12.3456 ± 0.0123' (4 decimals, or 4 significant digits from 1e5 on); '-' for a missing value."""
    if value is None:
        return "-"
    return _fmt(value) if stderr is None else f"{_fmt(value)} ± {_fmt(stderr)}"


def output_file(path: str | os.PathLike, now: datetime.datetime | None = None) -> Path:
    """Where `-o PATH` writes: PATH itself when it names a file (it has a suffix such as .json and is
    no folder), else a new `results-<date>T<time>.json` inside the folder PATH (as `merit prepare -o`
    and `merit train --out` name folders, and as lm-eval's --output_path takes one), never overwriting.

    For a folder this is the name free now; `write_results_json` takes the one free when it writes
    (another eval may have taken this one meanwhile)."""
    out = Path(path).expanduser()
    check_path_names(out, "-o/--out")
    if names_file(out):
        return out
    return out / next(n for n in _result_names(now) if not os.path.lexists(out / n))


def names_file(path: Path) -> bool:
    """True when `-o PATH` names the results file itself rather than a folder for one."""
    return bool(path.suffix) and not path.is_dir()


def _result_names(now: datetime.datetime | None = None) -> Iterator[str]:
    """`results-<date>T<time>.json`, then `results-<date>T<time>-2.json`, `-3`, ... (a bounded list)."""
    stamp = (now or datetime.datetime.now()).strftime("%Y%m%dT%H%M%S")
    yield f"results-{stamp}.json"
    for n in range(2, 100_000):
        yield f"results-{stamp}-{n}.json"


def check_output_path(path: str | os.PathLike) -> Path:
    """The output path, checked before the evaluation starts: not a folder, no name too long, no link
    to nothing on the way, and a writable folder to make it in."""
    out = Path(path).expanduser()
    check_path_names(out, "-o/--out")
    refuse_dangling_parents(out, "-o/--out")
    if out.is_dir():
        raise ConfigError(f"-o/--out {path}: is a folder; give a file name such as results.json")
    parent = out.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise ConfigError(f"-o/--out {path}: cannot write into {parent}")
    return out


def jsonable(value: Any) -> Any:
    """What merit's results JSON writes for a value JSON has no type for: a numpy / torch scalar's number, else its str."""
    item = getattr(value, "item", None)  # numpy / torch scalars
    if callable(item):
        return item()
    return str(value)


def write_results_json(
    path: str | os.PathLike,
    records: Sequence[CheckpointResult],
    now: datetime.datetime | None = None,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write all records durably to `path` (a file: replaced atomically, merit_core.durable_writes.atomic_write)
    or, when `path` names a folder, to a new `results-<date>T<time>[-N].json` in it, a name reserved
    as it is written (merit_core.durable_writes.write_new_file): two evals writing into one folder at the same
    second never share a file. `extra`: top-level keys beside "checkpoints" (a run over several devices:
    "missing", the checkpoints no worker scored, and "devices", how they were shared). Returns the file written."""
    given = Path(path).expanduser()
    whole = {"checkpoints": [r.to_json() for r in records], **(extra or {})}
    text = json.dumps(whole, indent=2, default=jsonable) + "\n"
    if names_file(given):
        out = check_output_path(given)
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(out, text)
        return out
    check_output_path(output_file(given, now))  # the folder can be made and written into
    given.mkdir(parents=True, exist_ok=True)
    return write_new_file(given, _result_names(now), text)  # a link planted at a name is skipped
