"""`merit eval RUN --all-steps` / `--steps 100,200`: score a run's checkpoints over its steps, beside
the max attention logit training recorded at each step, as a table and a figure.

The recorded max logit is the one `merit train` wrote at that step (metrics.jsonl's eval record,
max over layers; else the checkpoint's trainer_state.json): it is measured on the run's first
validation batch, not re-measured here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from merit_core.checkpoint import runs
from merit_core.diagnostics.plots import save_figure
from merit_core.errors import CheckpointError, ConfigError
from merit_core.fileio import display
from merit_core.metric_names import MAX_ATTENTION_LOGIT, STEP
from merit_core.metrics import read_metrics

RECORDED_LOGIT = "recorded_max_attention_logit"  # the key added to each result's meta


def parse_steps(text: str) -> list[int]:
    """'100,200' -> [100, 200] (sorted, unique); a ConfigError for anything else."""
    steps = set()
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if not part.isdigit():
            raise ConfigError(f"--steps {text}: give step numbers separated by commas, e.g. --steps 100,200")
        steps.add(int(part))
    if not steps:
        raise ConfigError("--steps is empty: give step numbers, e.g. --steps 100,200")
    return sorted(steps)


def step_checkpoints(given: str, steps: list[int] | None = None) -> list[tuple[int, Path]]:
    """The (step, folder) checkpoints of the run folder `given` that hold a model: all of them, or
    those in `steps` (each must exist)."""
    path = Path(given).expanduser()
    if not path.is_dir() or (path / runs.MODEL_CONFIG).is_file():
        raise ConfigError(
            f"--all-steps / --steps take a `merit train` run folder (with step_N/ checkpoints); "
            f"{display(given)} is not one"
        )
    found = runs.checkpoints(path, "model")
    if not found:
        raise CheckpointError(f"{display(given)} has no step_N/ checkpoint with a model")
    if steps is None:
        return found
    have = dict(found)
    missing = [s for s in steps if s not in have]
    if missing:
        raise ConfigError(
            f"--steps: {display(given)} has no checkpoint at step {', '.join(map(str, missing))}; "
            f"it has {', '.join(str(s) for s, _ in found)}"
        )
    return [(s, have[s]) for s in steps]


def recorded_max_logits(run: Path) -> dict[int, float]:
    """step -> the max attention logit (max over layers) training recorded at that step."""

    out: dict[int, float] = {}
    for step, folder in runs.checkpoints(run, "model"):
        value = runs.read_trainer_state(folder, strict=False).get(MAX_ATTENTION_LOGIT)
        peak = _peak(value)
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
