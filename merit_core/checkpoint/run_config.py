"""A run's config.toml, read by this module alone: its table (`read_run_config`, what compare's resume
check and measures, and `merit train --resume`, ask for) and the few settings reading its optimizer
state needs (`read_optimizer_settings`), without torch or train/.

`merit train` writes config.toml resolved (every value final), so the optimizer's name, its
hyperparameters and the lr schedule's ends are plain values there. inspect's update size rebuilds
the run's optimizer from them and sets the lr the schedule (merit_core.schedule) gives the next
update. Each value is checked for its type: the file may have been edited or planted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from merit_core.checkpoint.runs import CONFIG_FILE
from merit_core.errors import CheckpointError
from merit_core.file_reading import display, read_toml_file


@dataclass(frozen=True)
class OptimizerSettings:
    """How a run built its optimizer and its lr schedule."""

    optimizer: str
    lr: float
    min_lr: float
    warmup_steps: int
    steps: int
    weight_decay: float
    optimizer_args: dict[str, Any] = field(default_factory=dict)

    def lr_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of merit_core.schedule.lr_at besides the step."""
        return {"lr": self.lr, "min_lr": self.min_lr, "warmup_steps": self.warmup_steps, "total_steps": self.steps}


def read_run_config(run_dir: str | Path) -> dict[str, Any] | None:
    """The table of the run folder's config.toml, None when it has none; CheckpointError in one line
    when it is not a regular file of readable TOML (merit_core.file_reading.read_toml_file)."""
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        return None
    return read_toml_file(path, CheckpointError)


def read_optimizer_settings(run_dir: str | Path) -> OptimizerSettings | None:
    """The run folder's optimizer settings from its config.toml; None without one. CheckpointError
    for a file that is unreadable or holds a value of the wrong type."""
    found = read_run_config(run_dir)
    if found is None:
        return None
    data: dict[str, Any] = found
    where = display(Path(run_dir) / CONFIG_FILE)

    def number(key: str, integer: bool = False) -> Any:
        value = data.get(key)
        kinds = (int,) if integer else (int, float)
        if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value) or value < 0:
            raise CheckpointError(
                f"{where}: {key} is {value!r}, expected a non-negative number; not a resolved run config"
            )
        return value

    name = data.get("optimizer")
    if not isinstance(name, str):
        raise CheckpointError(f"{where}: optimizer is {name!r}, expected an optimizer name")
    args = data.get("optimizer_args", {})
    if not isinstance(args, dict):
        raise CheckpointError(f"{where}: optimizer_args is not a table")
    return OptimizerSettings(
        optimizer=name,
        lr=float(number("lr")),
        min_lr=float(number("min_lr")),
        warmup_steps=int(number("warmup_steps", integer=True)),
        steps=int(number("steps", integer=True)),
        weight_decay=float(number("weight_decay")),
        optimizer_args=dict(args),
    )
