"""Experiment trackers fed from the training callbacks: TensorBoard, Weights & Biases, MLflow.

`report_to` (config key, `merit train --report-to`) is a comma-separated list of tracker names
or "none". Each tracker is an optional dependency: asking for one that is not installed fails
before anything is written, with one line saying what to pip install. Trackers only see what
`TrainCallbacks` report on the main process: the config at the start, every log record
(loss, lr, grad_norm, tokens_per_s) and every eval record (val_loss, the max attention logit
overall and per layer), keyed by optimizer step.

- tensorboard: event files in `<run folder>/tensorboard` (torch.utils.tensorboard); a resumed
  run drops the events after its checkpoint's step (`purge_step`).
- wandb: `wandb.init(dir=<run folder>)`, project $WANDB_PROJECT or "merit". Runs offline
  (no network; `wandb sync` uploads later) unless WANDB_MODE or WANDB_API_KEY is set.
- mlflow: a run named after the run folder, in $MLFLOW_TRACKING_URI or MLflow's default
  store; the config as parameters.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from merit_core.extras import is_installed, require
from merit_core.metric_names import (
    ACTIVATION_RATIO,
    MAX_ATTENTION_LOGIT,
    NORMALIZED_ENTROPY_MIN,
    VAL_LOSS,
    WATCH_WARNINGS,
)
from merit_core.precursors import WATCH_KEYS, over_layers
from merit_core.train.callbacks import CallbackList, ClosingCallbacks, RunInfo, RunSummary, TrainCallbacks
from merit_core.train.config import parse_report_to

# per-layer lists of an eval or watch record -> the precursor each holds, whose one overall scalar
# a tracker is given (merit_core.precursors.over_layers)
PER_LAYER = {name: name for name in (MAX_ATTENTION_LOGIT, ACTIVATION_RATIO, NORMALIZED_ENTROPY_MIN)}
PER_LAYER.update({WATCH_KEYS[name]: name for name in (MAX_ATTENTION_LOGIT, ACTIVATION_RATIO, NORMALIZED_ENTROPY_MIN)})
TENSORBOARD_DIR = "tensorboard"
# what `pip install` brings each tracker (the import name of each is the tracker's name)
_INSTALL = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


def check_installed(names: Iterable[str]) -> None:
    """Raise MissingDependencyError (one line) for the first tracker whose package is missing."""
    for name in names:
        if not is_installed(name):
            require(name, f"--report-to {name}", _INSTALL[name])


def build_trackers(report_to: str | Iterable[str] | None) -> list[TrainCallbacks]:
    """The trackers `report_to` asks for, checked to be installed; they connect in `on_start`."""
    names = parse_report_to(report_to)
    check_installed(names)
    classes = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker, "mlflow": MlflowTracker}
    return [classes[name]() for name in names]


def with_trackers(report_to: str | Iterable[str] | None, callbacks: TrainCallbacks | None) -> CallbackList:
    """`callbacks` (the front end's) followed by the trackers `report_to` names."""
    return CallbackList([callbacks, *build_trackers(report_to)])


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """A log or eval record as tracker scalars: 'train/loss', 'eval/val_loss', 'eval/max_attention_logit',
    'eval/max_attention_logit/layer_3', ... (step and tokens are the x axis, not scalars). A per-layer
    list gives its overall max (min for entropy) and one scalar per layer."""
    out: dict[str, float] = {}
    section = "eval" if VAL_LOSS in record or MAX_ATTENTION_LOGIT in record else "train"
    for key, value in record.items():
        if key in ("step", "tokens") or value is None:
            continue
        if key in PER_LAYER and isinstance(value, (list, tuple)):
            layers = [(i, float(v)) for i, v in enumerate(value) if v is not None]
            overall = over_layers(PER_LAYER[key], value)
            if overall is not None:
                out[f"{section}/{key}"] = overall
            for i, v in layers:
                out[f"{section}/{key}/layer_{i}"] = v
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[f"{section}/{key}"] = float(value)
    return out


def _flat_config(info: RunInfo) -> dict[str, Any]:
    """The resolved config plus the run's facts, flattened (optimizer_args.betas) for trackers' param tables."""
    flat: dict[str, Any] = {}
    for key, value in info.config.to_dict().items():
        if isinstance(value, dict):
            flat.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            flat[key] = value
    flat.update(n_params=info.n_params, world_size=info.world_size, device=info.device)
    return flat


class Tracker(ClosingCallbacks):
    """A tracker: `start(info)` connects, `log(values, step)` records scalars, `close(failed)` finishes."""

    def __init__(self):
        self.started = False

    def on_start(self, info: RunInfo) -> None:
        self.start(info)
        self.started = True

    def on_log(self, record: dict[str, Any]) -> None:
        if self.started:
            self.log(scalars(record), int(record["step"]))

    def on_eval(self, record: dict[str, Any]) -> None:
        if self.started:
            self.log(scalars(record), int(record["step"]))

    def on_watch(self, record: dict[str, Any]) -> None:
        """The watcher's precursors as 'train/watch_*' scalars, and 'train/watch_warnings': how many
        warnings this step raised (0 on a quiet step, so that a warning stands out on the chart)."""
        if self.started:
            values = scalars({k: v for k, v in record.items() if k != WATCH_WARNINGS})
            values["train/" + WATCH_WARNINGS] = float(len(record.get(WATCH_WARNINGS) or ()))
            self.log(values, int(record["step"]))

    def on_end(self, summary: RunSummary) -> None:
        self.close(failed=False)

    def close(self, failed: bool = False) -> None:
        if self.started:
            self.started = False
            self.finish(failed)

    def start(self, info: RunInfo) -> None:
        raise NotImplementedError

    def log(self, values: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def finish(self, failed: bool) -> None:
        raise NotImplementedError


class TensorBoardTracker(Tracker):
    """Scalars into `<run folder>/tensorboard` through torch.utils.tensorboard.SummaryWriter."""

    def start(self, info: RunInfo) -> None:
        from torch.utils.tensorboard import SummaryWriter

        purge = info.start_step if info.resumed_from is not None else None
        self.writer = SummaryWriter(log_dir=str(Path(info.run_dir) / TENSORBOARD_DIR), purge_step=purge)
        config = _flat_config(info)
        self.writer.add_text("config", "\n".join(f"    {k} = {v!r}" for k, v in config.items()), info.start_step)

    def log(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def finish(self, failed: bool) -> None:
        self.writer.close()


class WandbTracker(Tracker):
    """A Weights & Biases run in the run folder; offline unless WANDB_MODE or WANDB_API_KEY is set."""

    def start(self, info: RunInfo) -> None:
        import wandb

        mode = os.environ.get("WANDB_MODE") or (None if os.environ.get("WANDB_API_KEY") else "offline")
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "merit"),
            name=Path(info.run_dir).name,
            dir=str(info.run_dir),
            config=_flat_config(info),
            mode=mode,
            resume="allow" if info.resumed_from is not None else None,
            id=os.environ.get("WANDB_RUN_ID"),
        )

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def finish(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class MlflowTracker(Tracker):
    """An MLflow run named after the run folder, in $MLFLOW_TRACKING_URI (or MLflow's default store)."""

    def start(self, info: RunInfo) -> None:
        import mlflow

        self.mlflow = mlflow
        self.run = mlflow.start_run(run_name=Path(info.run_dir).name)
        params = {k: ("" if v is None else str(v))[:500] for k, v in _flat_config(info).items()}
        mlflow.log_params(params)

    def log(self, values: dict[str, float], step: int) -> None:
        # MLflow metric names may not contain every character; '/' is allowed.
        self.mlflow.log_metrics(values, step=step)

    def finish(self, failed: bool) -> None:
        self.mlflow.end_run(status="FAILED" if failed else "FINISHED")
