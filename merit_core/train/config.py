"""Resolving a TrainConfig (merit_core.settings) and its config.toml text; the reading (TOML with `key=value`
overrides, unknown keys named, values checked) is merit_core.config_reading's, torch-free, and importable
from here too.

`resolve()` fills the derived fields (lr and weight decay, steps from tokens, warmup, min lr,
micro-batch, run directory) so the saved `config.toml` replays the run exactly, and says where a
default lr came from (`Resolved`); the settings themselves, their defaults and help are declared in
merit_core.settings.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from merit_core.checkpoint.runs import CONFIG_HEADER
from merit_core.config_reading import (
    FIELD_NAMES,
    from_dict,
    load_config,
    parse_override,
    parse_report_to,
    validate,
)
from merit_core.errors import ConfigError
from merit_core.models import model_width
from merit_core.optim.lr_table import LrDefault
from merit_core.optim.registry import OptimizerSpec, default_lr, get_spec
from merit_core.settings import ACTION_KEYS, DEFAULT_STEPS, TRACKERS, ResolvedConfig, TrainConfig

# TrainConfig and its resolved form are merit_core.settings' (plain data, no torch); importable from here too.
__all__ = [
    "ACTION_KEYS",
    "FIELD_NAMES",
    "DEFAULT_STEPS",
    "TRACKERS",
    "ResolvedConfig",
    "Resolved",
    "TrainConfig",
    "config_toml",
    "dumps_toml",
    "from_dict",
    "load_config",
    "parse_override",
    "parse_report_to",
    "resolve",
    "validate",
]


@dataclass(frozen=True)
class Resolved:
    """What `resolve` decided: the config with its derived fields filled, and the default lr it
    applied with where that lr comes from (the source `merit train`'s start line prints), or None
    when the config gives the lr."""

    config: ResolvedConfig
    lr: LrDefault | None


def resolve(
    config: TrainConfig,
    world_size: int = 1,
    spec: OptimizerSpec | None = None,
    now: datetime.datetime | None = None,
    auto_micro_batch: bool = False,
) -> Resolved:
    """A ResolvedConfig, the config with its derived fields filled: lr and weight_decay (the registry defaults;
    for lr its measured default for the model and batch first), steps, warmup_steps, min_lr,
    micro_batch_size, out.

    `spec` is the optimizer's registry entry, looked up from `config.optimizer` when not given (a
    training run passes the one it looked up); the copy names the optimizer by its registry name.
    The model's name and width (None when its config cannot be read: then the registry default,
    said so in the source) go to the registry's lr table, which never reads model configs.

    An unset micro_batch_size becomes the whole per-process batch, unless `auto_micro_batch`
    (the training run, which lets its Trainer choose it once the model is on its device).

    Raises ConfigError when the global batch cannot be split over `world_size` processes.
    """
    spec = get_spec(spec or config.optimizer)
    c = config
    chosen = None
    lr = c.lr
    if lr is None:
        chosen = default_lr(spec, c.model, c.batch_size, c.seq_len, model_width(c.model))
        lr = chosen.lr
    weight_decay = c.weight_decay
    if weight_decay is None:
        if "weight_decay" not in spec.defaults:
            raise ConfigError(f"weight_decay is not set and optimizer {spec.name!r} has no default for it")
        weight_decay = float(spec.defaults["weight_decay"])
    if c.min_lr is not None and c.min_lr > lr:
        raise ConfigError(f"min_lr ({c.min_lr}) must not exceed lr ({lr})")
    steps = c.steps
    if steps is None:
        steps = math.ceil(c.tokens / c.tokens_per_step) if c.tokens is not None else DEFAULT_STEPS
    elif c.tokens is not None and steps != math.ceil(c.tokens / c.tokens_per_step):
        raise ConfigError(f"steps ({steps}) and tokens ({c.tokens}) disagree; give only one of them")
    per_rank, rest = divmod(c.batch_size, world_size)
    if rest:
        raise ConfigError(f"batch_size {c.batch_size} is not divisible by the world size {world_size}")
    micro = c.micro_batch_size
    if micro is None and not auto_micro_batch:
        micro = per_rank
    if micro is not None and per_rank % micro:
        raise ConfigError(
            f"batch_size {c.batch_size} is not divisible by micro_batch_size {micro} x world size "
            f"{world_size}; pick a micro-batch that divides {per_rank}"
        )
    out = c.out
    if out is None:
        stamp = (now or datetime.datetime.now()).strftime("%Y%m%d-%H%M%S")
        model = Path(c.model).parent.name if c.model.endswith(".json") else Path(c.model).name
        out = str(Path("runs") / f"{stamp}-{model}-{spec.name}")
    values = {f.name: getattr(c, f.name) for f in dataclasses.fields(TrainConfig)}
    values.update(
        optimizer=spec.name,
        optimizer_args=dict(c.optimizer_args),
        lr=lr,
        weight_decay=weight_decay,
        steps=steps,
        tokens=None,  # steps is now the single source of truth
        warmup_steps=int(c.warmup_ratio * steps) if c.warmup_steps is None else c.warmup_steps,
        min_lr=lr * c.min_lr_ratio if c.min_lr is None else c.min_lr,
        micro_batch_size=micro,
        out=out,
    )
    return Resolved(ResolvedConfig(**values), chosen)


# -- writing --------------------------------------------------------------------------------
def config_toml(config: TrainConfig) -> str:
    """config.toml's text for `config` (None values are left out: they mean 'default'; the
    ACTION_KEYS are what one invocation does, not properties of the run, and are left out too).
    The run folder's owner (merit_core.train.run_folder) writes it."""
    values = {k: v for k, v in config.to_dict().items() if k not in ACTION_KEYS}
    return CONFIG_HEADER + "\n" + dumps_toml(values)


def dumps_toml(data: dict[str, Any]) -> str:
    """A TOML document (written by tomli-w) for a mapping of scalars, lists and nested tables; None
    values, which TOML cannot hold, are left out (in a config they mean 'the default')."""
    import tomli_w

    try:
        return tomli_w.dumps(_without_none(data))
    except TypeError as exc:
        raise ConfigError(f"cannot write the config as TOML: {exc}") from None


def _without_none(data: dict[str, Any]) -> dict[str, Any]:
    return {k: _without_none(v) if isinstance(v, dict) else v for k, v in data.items() if v is not None}
