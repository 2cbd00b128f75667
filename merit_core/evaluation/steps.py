"""Which checkpoints `merit eval` scores (`eval_targets`: a run folder's latest, all or chosen steps,
resolved once), and `merit eval RUN --checkpoints all` / `--checkpoints 100,200`: a run's checkpoints scored over
its steps, beside the max attention logit training recorded at each step, as a table and a figure.

The recorded max logit is the one `merit train` wrote at that step (metrics.jsonl's eval record,
max over layers; else the checkpoint's trainer_state.json): it is measured on the run's first
validation batch, not re-measured here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from merit_core.checkpoint import runs
from merit_core.checkpoint.hub_revisions import HubRequest, parse_hub_model
from merit_core.checkpoint.resolve import LATEST, Selection, Taken, is_run_folder, take, take_revisions
from merit_core.checkpoint.safe import refuse_special_files
from merit_core.checkpoint.state import optional_trainer_state
from merit_core.diagnostics.plots import save_figure
from merit_core.errors import ConfigError
from merit_core.evaluation.hub_logits import measured_max_logits
from merit_core.file_reading import display
from merit_core.metric_names import MAX_ATTENTION_LOGIT, STEP
from merit_core.metrics import read_metrics
from merit_core.precursors import over_layers

RECORDED_LOGIT = "recorded_max_attention_logit"  # the key added to each result's meta


@dataclass(frozen=True)
class EvalTargets:
    """What `merit eval` evaluates, resolved once: `checkpoints`, the paths handed to the harness (each
    run folder's selected step folders in its place, oldest first), and `taken`, the run folders'
    selections, whose `line()` says which checkpoints were taken."""

    checkpoints: tuple[str, ...]
    taken: tuple[Taken, ...]

    def lines(self) -> list[str]:
        return [t.line() for t in self.taken]


def eval_targets(given: Sequence[str], selection: Selection = LATEST, hub: HubRequest | None = None) -> EvalTargets:
    """Resolve the user's checkpoints: a `merit train` run folder to the step_N checkpoints with a model
    that `selection` picks (merit_core.checkpoint.resolve.take); a model folder or hub name as given.
    Any selection but LATEST scores over steps and takes run folders only (ConfigError for another path);
    `hub.revisions` scores a hub model ORG/NAME over the revisions it picks (resolve.take_revisions), and
    `hub.drop_weights` takes hub models only (their weights are deleted once scored, never a local folder's)."""
    if hub is not None and hub.revisions is not None and len(given) != 1:
        raise ConfigError(f"--revisions {hub.revisions} scores one hub model ORG/NAME over its revisions")
    checkpoints: list[str] = []
    taken: list[Taken] = []
    for text in given:
        path = Path(text).expanduser()
        model = parse_hub_model(text) if not path.exists() else None
        if hub is not None and hub.revisions is not None and model is not None:
            revisions = take_revisions(model, hub)
            taken.append(revisions)
            checkpoints.extend(str(name) for name in revisions.folders)
            continue
        if hub is not None and hub.revisions is not None:
            raise ConfigError(f"--revisions {hub.revisions} takes a hub model ORG/NAME; {display(text)} is not one")
        if hub is not None and hub.drop_weights and model is None:
            raise ConfigError(
                f"--drop-weights deletes hub models' weights from the hub cache; {display(text)} is not a hub model"
            )
        if not is_run_folder(path):
            if selection != LATEST:
                raise ConfigError(
                    f"--checkpoints {selection} takes a `merit train` run folder (with step_N/ checkpoints); "
                    f"{display(text)} is not one"
                )
            checkpoints.append(text)
            continue
        chosen = take(path, selection, "model")
        refuse_special_files(path)
        taken.append(chosen)
        checkpoints.extend(str(folder) for folder in chosen.folders)
    return EvalTargets(tuple(checkpoints), tuple(taken))


def recorded_max_logits(run: Path, taken: Taken | None = None) -> dict[int, float]:
    """step -> the max attention logit (max over layers) training recorded at that step; for a hub
    model's revisions (`taken`), the one inspect's probe measures (merit_core.evaluation.hub_logits)."""
    if taken is not None and not run.exists() and parse_hub_model(str(run)) is not None:
        return measured_max_logits(taken)

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
    return over_layers(MAX_ATTENTION_LOGIT, value) if isinstance(value, list) else None


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
