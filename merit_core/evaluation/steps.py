"""`merit eval RUN --steps all` / `--steps 100,200`: score a run's checkpoints over its steps, beside
the max attention logit training recorded at each step, as a table and a figure.

The recorded max logit is the one `merit train` wrote at that step (metrics.jsonl's eval record,
max over layers; else the checkpoint's trainer_state.json): it is measured on the run's first
validation batch, not re-measured here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from merit_core.checkpoint import runs
from merit_core.checkpoint.resolve import Selection, is_run_folder, select_steps
from merit_core.checkpoint.state import optional_trainer_state
from merit_core.diagnostics.plots import save_figure
from merit_core.errors import ConfigError
from merit_core.fileio import display
from merit_core.metric_names import MAX_ATTENTION_LOGIT, STEP
from merit_core.metrics import read_metrics

RECORDED_LOGIT = "recorded_max_attention_logit"  # the key added to each result's meta


def step_checkpoints(given: str, selection: Selection) -> list[tuple[int, Path]]:
    """The (step, folder) checkpoints with a model of the run folder `given` that `selection` picks
    (merit_core.checkpoint.resolve.select_steps); ConfigError when `given` is not a run folder."""
    path = Path(given).expanduser()
    if not is_run_folder(path):
        raise ConfigError(
            f"--steps {selection} takes a `merit train` run folder (with step_N/ checkpoints); "
            f"{display(given)} is not one"
        )
    return select_steps(path, selection, "model")


def recorded_max_logits(run: Path) -> dict[int, float]:
    """step -> the max attention logit (max over layers) training recorded at that step."""

    out: dict[int, float] = {}
    for step, folder in runs.checkpoints(run, "model"):
        state = optional_trainer_state(folder, strict=False)
        peak = _peak(state.max_attention_logit if state is not None else None)
        if peak is not None:
            out[step] = peak
    if (run / runs.METRICS_FILE).is_file():
        for record in read_metrics(run):
            peak = _peak(record.get(MAX_ATTENTION_LOGIT))
            if peak is not None and isinstance(record.get(STEP), int):
                out[record[STEP]] = peak
    return out


def _peak(value: Any) -> float | None:
    if not isinstance(value, list):
        return None
    numbers = [v for v in value if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return float(max(numbers)) if numbers else None


def plot_steps(steps: list[int], series: dict[str, list[float | None]], logits: list[float | None], path) -> None:
    """Scores over steps (one line per task metric) and, on a second axis, the recorded max logit."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), constrained_layout=True)
    for label, values in series.items():
        ax.plot(steps, [float("nan") if v is None else v for v in values], marker="o", label=label)
    ax.set_xlabel("training step")
    ax.set_ylabel("score")
    ax.grid(alpha=0.3)
    if any(v is not None for v in logits):
        twin = ax.twinx()
        twin.plot(steps, [float("nan") if v is None else v for v in logits], "k--", marker="s", label="max logit")
        twin.set_ylabel("recorded max attention logit")
        twin.legend(loc="upper right", fontsize="small")
    ax.legend(loc="upper left", fontsize="small")
    ax.set_title("zero-shot scores over training steps")
    save_figure(plt, fig, Path(path))
