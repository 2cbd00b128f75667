"""The tables `merit eval` prints: the task aliases, the results per checkpoint, and the scores over a run's steps."""

from __future__ import annotations

from rich.table import Table

from merit_cli.render import shown
from merit_core.evaluation.results import CheckpointResult, format_value, metric_rows
from merit_core.evaluation.tasks import ALIASES, list_local_tasks


def aliases_table(include_path: str | None) -> Table:
    """merit eval's task aliases, and the local tasks of --include-path."""
    table = Table(title="merit eval tasks", title_justify="left")
    table.add_column("name", style="bold")
    table.add_column("lm-eval tasks")
    table.add_column("what")
    for alias in ALIASES.values():
        table.add_row(alias.name, ", ".join(alias.tasks), alias.description)
    if include_path:
        for name in list_local_tasks(include_path):
            table.add_row(shown(name), shown(name), f"local task from {shown(include_path)}")
    table.caption = "Any other lm-eval task name works too (e.g. hellaswag, piqa, arc_easy)."
    return table


# a metric's direction (higher_is_better: True, False or None when lm-eval does not say)
_ARROWS: dict[bool | None, str] = {True: " ↑", False: " ↓"}


def unique_labels(records: list[CheckpointResult]) -> list[str]:
    """Each checkpoint's column label, numbered where two are alike."""
    labels: list[str] = []
    seen: dict[str, int] = {}
    for record in records:
        seen[record.label] = seen.get(record.label, 0) + 1
        labels.append(record.label if seen[record.label] == 1 else f"{record.label} ({seen[record.label]})")
    return labels


def results_table(records: list[CheckpointResult], num_fewshot: int) -> Table:
    """Task, metric, value, stderr; with several checkpoints one 'value ± stderr' column each."""
    title = "zero-shot results" if num_fewshot == 0 else f"{num_fewshot}-shot results"
    table = Table(title=title, title_justify="left")
    table.add_column("task", style="bold")
    table.add_column("metric")
    single = len(records) == 1
    if single:
        table.add_column("value", justify="right")
        table.add_column("stderr", justify="right")
    else:
        for label in unique_labels(records):
            table.add_column(shown(label), justify="right")  # a label is a path
    last_task = None
    for row in metric_rows(records):
        arrow = _ARROWS.get(row.higher_is_better, "")
        task = shown(row.task) if row.task != last_task else ""  # a local task's name is a folder's
        last_task = row.task
        if single:
            stderr = row.stderrs[0]
            table.add_row(task, shown(row.metric) + arrow, format_value(row.values[0]), format_value(stderr))
        else:
            table.add_row(
                task, shown(row.metric) + arrow, *(format_value(v, s) for v, s in zip(row.values, row.stderrs))
            )
    return table


def steps_table(steps: list[int], records: list[CheckpointResult], logits: dict[int, float]) -> Table:
    """One row per step: the recorded max attention logit and each task metric's value."""
    rows = metric_rows(records)
    table = Table(title="scores over training steps", title_justify="left")
    table.add_column("step", justify="right")
    table.add_column("max logit (recorded)", justify="right")
    for row in rows:
        arrow = _ARROWS.get(row.higher_is_better, "")
        table.add_column(f"{shown(row.task)} {shown(row.metric)}{arrow}", justify="right")
    for i, step in enumerate(steps):
        logit = logits.get(step)
        table.add_row(str(step), format_value(logit), *(format_value(row.values[i]) for row in rows))
    return table
