"""The progress bar's loss between log lines: a one-process CPU run reports every step's loss
(`on_step_loss`), so a 5-step run at log_every 10 shows one from step 1; the bar shows it."""

from __future__ import annotations

import io
import math

from rich.console import Console

from merit_core.metrics import read_metrics
from merit_core.train.callbacks import TrainCallbacks
from tests.cli.test_run_safety import TINY


def test_a_cpu_run_reports_the_loss_of_every_step_between_log_lines(model_cfg, data_dir, tmp_path):
    from merit_core.train.config import load_config
    from merit_core.train.training_run import run_training

    seen: list[tuple[str, int, float]] = []

    class Record(TrainCallbacks):
        def on_step_loss(self, step: int, loss: float) -> None:
            seen.append(("bar", step, loss))

        def on_log(self, record: dict) -> None:
            seen.append(("log", record["step"], record["loss"]))

    out = tmp_path / "run"
    values = {**TINY, "log_every": 10, "eval_every": 0, "save_every": 0, "steps": 5}
    values |= {"model": str(model_cfg), "data": str(data_dir), "out": str(out), "eval_batch_size": 2}
    run_training(load_config(values=values), Record())
    assert [(kind, step) for kind, step, _ in seen] == [("bar", 1), ("bar", 2), ("bar", 3), ("bar", 4), ("log", 5)]
    assert all(math.isfinite(loss) and loss > 0 for _, _, loss in seen)
    assert [r["step"] for r in read_metrics(out) if "loss" in r] == [5]  # metrics.jsonl keeps its cadence


def test_the_bar_shows_the_step_loss():
    from merit_cli.render import fmt_float, training_progress
    from merit_cli.train_cmd import RichTrainReport

    report = RichTrainReport()
    report.out = Console(file=io.StringIO(), force_terminal=True, width=100)
    report.progress = training_progress(report.out)
    report.task = report.progress.add_task("train", total=5, **report.fields)
    assert report.progress.tasks[0].fields["loss"] == "-"
    report.on_step_loss(1, 5.4321)
    (task,) = report.progress.tasks
    assert (task.completed, task.fields["loss"]) == (1, fmt_float(5.4321))
