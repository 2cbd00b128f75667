"""The figures' artists, read from the figure before it is saved: `merit inspect --plot`'s titles, chart
kind and step axis, and curves.png's marker for a lone training point."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from merit_core.diagnostics import plots
from merit_core.diagnostics.inspect_report import InspectOptions, inspect_paths
from merit_core.metric_names import NORMALIZED_ENTROPY_MIN
from tests.diagnostics.test_inspect import _make_run


@pytest.fixture
def figures(monkeypatch) -> list:
    """The figures merit_core.diagnostics.plots saves (still open), in order."""
    caught: list = []

    def keep(plt, fig, path: Path) -> None:
        caught.append(fig)

    monkeypatch.setattr(plots, "save_figure", keep)
    yield caught
    import matplotlib.pyplot as plt

    for fig in caught:
        plt.close(fig)


def _titles(fig) -> dict[str, object]:
    return {ax.get_title(): ax for ax in fig.axes if ax.get_visible()}


def test_trajectory_of_two_runs_names_min_for_entropy_and_ticks_whole_steps(tmp_path, figures):
    runs = [_make_run(tmp_path / name, None) for name in ("a", "b")]
    report = inspect_paths(runs, InspectOptions(seq_len=8))
    assert plots.plot_report(report, tmp_path / "t.png") == "trajectory"
    (fig,) = figures
    titles = _titles(fig)
    entropy = [t for t in titles if t.startswith(dict((k, v) for k, v, _ in plots.PANELS)[NORMALIZED_ENTROPY_MIN])]
    assert entropy == ["min attention entropy / log(keys seen), min over layers"]
    assert "max-norm of $W_Q$, max over layers" in titles
    for ax in titles.values():
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks), (ax.get_title(), ticks)
        for line in ax.get_lines():
            assert line.get_marker() == "o"  # every checkpoint is a visible point


def test_one_checkpoint_per_run_is_a_bar_chart_not_a_trajectory_of_dots(tmp_path, figures):
    runs = []
    for name in ("a", "b"):
        run = _make_run(tmp_path / name, None)
        for step in (0, 10):
            shutil.rmtree(run / f"step_{step}")
        runs.append(run)
    report = inspect_paths(runs, InspectOptions(seq_len=8))
    assert sorted(c.step for c in report.checkpoints) == [5, 5]
    assert plots.plot_report(report, tmp_path / "one.png") == "layers"
    (fig,) = figures
    bars = [ax for ax in fig.axes if ax.get_visible() and ax.patches]
    assert bars and all(ax.get_xlabel() in ("layer", "") for ax in bars)


def test_curves_png_marks_a_lone_training_point(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    from merit_core.train import plots as train_plots

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 5, "tokens": 640, "loss": 5.0, "lr": 1e-3}) + "\n")
    kept: list = []
    monkeypatch.setattr(plt, "close", kept.append)  # keep the figure open to read it
    assert train_plots.plot_curves(run) is not None
    (fig,) = kept
    loss_ax = next(ax for ax in fig.axes if ax.get_title() == "Loss")
    (train,) = [line for line in loss_ax.get_lines() if line.get_label() == "train"]
    assert train.get_marker() == "o" and list(train.get_xdata()) == [5]
    monkeypatch.undo()
    plt.close(fig)
