"""The settings of a run's config.toml that reading its optimizer state needs, without torch or train/.

`merit train` writes config.toml resolved (every value final), so the optimizer's name, its
hyperparameters and the lr schedule's ends are plain values there. inspect's update size rebuilds
the run's optimizer from them and sets the lr the schedule (merit_core.schedule) gives the next
update. Each value is checked for its type: the file may have been edited or planted.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from merit_core.checkpoint.runs import CONFIG_FILE
from merit_core.errors import CheckpointError
from merit_core.fileio import display, open_regular

MAX_CONFIG_BYTES = 1024 * 1024


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


def read_optimizer_settings(run_dir: str | Path) -> OptimizerSettings | None:
    """The run folder's optimizer settings from its config.toml; None without one. CheckpointError
    for a file that is unreadable or holds a value of the wrong type."""
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        return None
    try:
        with open_regular(path) as fh:
            raw = fh.read(MAX_CONFIG_BYTES + 1)
        if len(raw) > MAX_CONFIG_BYTES:
            raise ValueError(f"larger than {MAX_CONFIG_BYTES} bytes")
        data = tomllib.loads(raw.decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:  # TOMLDecodeError is a ValueError
        raise CheckpointError(f"{display(path)} is not a readable run configuration: {str(exc)[:120]}") from None
    where = display(path)

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
