"""Shared rich rendering: consoles, number formats, key/value tables, a training progress bar."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table


def console(stderr: bool = False) -> Console:
    return Console(stderr=stderr, highlight=False)


def fmt_float(value: float | None, digits: int = 4) -> str:
    """A compact number ('-' for missing, 'nan'/'inf' as such)."""
    if value is None:
        return "-"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return f"{value:.{digits}g}"


def fmt_count(n: float | None) -> str:
    """1234 -> '1.23k', 5_600_000 -> '5.6M'."""
    if n is None:
        return "-"
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.0f}"


def fmt_duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def command_hints(title: str, hints: Iterable[tuple[str, str]]) -> Table:
    """'What to try next': commands (never wrapped) with a dim note each."""
    table = Table(title=title, show_header=False, box=None, padding=(0, 2), title_justify="left")
    table.add_column(no_wrap=True)
    table.add_column(style="dim")
    for command, note in hints:
        table.add_row(command, note)
    return table


def key_value_table(title: str | None, rows: Iterable[tuple[str, Any]]) -> Table:
    """A two-column table: dim keys, plain values."""
    table = Table(title=title, show_header=False, box=None, padding=(0, 2), title_justify="left")
    table.add_column(style="dim", no_wrap=True)
    table.add_column()
    for key, value in rows:
        table.add_row(key, str(value))
    return table


class StageProgress:
    """A transient bar per stage for `progress(stage, done, total)` callbacks (total None: unknown)."""

    def __init__(self, out: Console):
        from rich.progress import MofNCompleteColumn, SpinnerColumn, TimeElapsedColumn

        self.bar = Progress(
            SpinnerColumn(),
            TextColumn("{task.description:<24}"),
            BarColumn(bar_width=24),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=out,
            transient=True,
        )
        self.tasks: dict[str, Any] = {}
        self.started = False

    def __call__(self, stage: str, done: int, total: int | None) -> None:
        if not self.started:
            self.bar.start()
            self.started = True
        if stage not in self.tasks:
            self.tasks[stage] = self.bar.add_task(stage, total=total)
        self.bar.update(self.tasks[stage], completed=done, total=total)

    def stop(self) -> None:
        if self.started:
            self.bar.stop()
            self.started = False


def training_progress(out: Console) -> Progress:
    """A compact progress bar (fits 80 columns) whose task fields are loss, lr, tok_s and max_logit."""
    return Progress(
        BarColumn(bar_width=16),
        TextColumn("{task.completed:>.0f}/{task.total:.0f}"),
        TextColumn("loss [cyan]{task.fields[loss]}"),
        TextColumn("lr {task.fields[lr]}"),
        TextColumn("{task.fields[tok_s]} tok/s"),
        TextColumn("logit [magenta]{task.fields[max_logit]}"),
        TextColumn("eta"),
        TimeRemainingColumn(compact=True),
        console=out,
        transient=False,
    )


class LiveReport:
    """Base of the commands' rich callbacks: a console, stage bars started on the first
    `on_prepare`, a main progress bar set by the subclass, and `close()` that stops both."""

    def __init__(self):
        self.out = console()
        self.stages: StageProgress | None = None
        self.progress = None

    def on_prepare(self, stage: str, done: int, total: int | None) -> None:
        if self.stages is None:
            self.stages = StageProgress(self.out)
        self.stages(stage, done, total)

    def close(self) -> None:
        if self.stages is not None:
            self.stages.stop()
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
