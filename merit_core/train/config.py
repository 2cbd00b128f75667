"""Reading, checking and resolving a TrainConfig (merit_core.settings): TOML with `key=value` overrides.

Precedence: dataclass defaults < TOML file < overrides (in order). Override values are TOML
literals (`lr=3e-4`, `optimizer_args.betas=[0.9, 0.95]`, `compile=true`); a value that is not a
valid TOML literal is taken as a string (`model=gpt2-small`). Unknown keys raise ConfigError
naming the closest known key. `resolve()` fills the derived fields (lr and weight decay, steps from
tokens, warmup, min lr, micro-batch, run directory) so the saved `config.toml` replays the run
exactly, and says where a default lr came from (`Resolved`); the settings themselves, their defaults
and help are declared in merit_core.settings.
"""

from __future__ import annotations

import dataclasses
import datetime
import difflib
import math
import tomllib
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from merit_core.checkpoint.runs import CONFIG_HEADER
from merit_core.errors import ConfigError
from merit_core.fileio import atomic_write, check_utf8_path, read_toml_file
from merit_core.models import model_width
from merit_core.optim.lr_table import LrDefault
from merit_core.optim.registry import OptimizerSpec, default_lr, get_spec
from merit_core.settings import (
    ACTION_KEYS,
    DEFAULT_STEPS,
    DEVICE_PATTERN,
    DEVICE_WORDS,
    TRACKERS,
    ResolvedConfig,
    TrainConfig,
    setting_of,
)
from merit_core.values import coerce, deep_merge, nest

# TrainConfig and its resolved form are merit_core.settings' (plain data, no torch); importable from here too.
__all__ = [
    "ACTION_KEYS",
    "DEFAULT_STEPS",
    "TRACKERS",
    "ResolvedConfig",
    "Resolved",
    "TrainConfig",
    "dumps_toml",
    "from_dict",
    "load_config",
    "parse_override",
    "parse_report_to",
    "read_toml",
    "resolve",
    "save_config",
    "validate",
]

FIELD_NAMES = tuple(f.name for f in dataclasses.fields(TrainConfig))
_HINTS = typing.get_type_hints(TrainConfig)


# -- building a config ---------------------------------------------------------------------
def load_config(
    path: str | Path | Mapping[str, Any] | None = None,
    overrides: Iterable[str] = (),
    values: dict[str, Any] | None = None,
) -> TrainConfig:
    """A validated TrainConfig from defaults < TOML file < `key=value` overrides < `values`.

    `path`: a TOML file, or the table of one already read (a run's config.toml, which
    merit_core.checkpoint.read_run_config reads). `values` holds already-typed settings (CLI
    options); None entries are ignored.
    """
    data: dict[str, Any] = {}
    if isinstance(path, Mapping):
        deep_merge(data, dict(path))
    elif path is not None:
        deep_merge(data, read_toml(path))
    for item in overrides:
        deep_merge(data, nest(*parse_override(item)))
    if values:
        deep_merge(data, {k: v for k, v in values.items() if v is not None})
    return from_dict(data)


def read_toml(path: str | Path) -> dict[str, Any]:
    """The table of a train or compare config file (merit_core.fileio.read_toml_file); ConfigError
    in one line when it is missing, a folder or not readable TOML."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"config file {path} is a folder; give a .toml file")
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    return read_toml_file(path)


def parse_override(item: str) -> tuple[str, Any]:
    """'a.b=value' -> ('a.b', parsed value); the value is a TOML literal, else a plain string."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"--set expects KEY=VALUE, got {item!r}")
    raw = raw.strip()
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    except RecursionError:
        raise ConfigError(f"--set {key}: the value is nested too deeply to read") from None
    return key, value


def from_dict(data: dict[str, Any]) -> TrainConfig:
    """Check names and types of a (possibly nested) mapping and build the config."""
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key == "micro_batch_size" and isinstance(value, str) and value.strip().lower() == "auto":
            value = None  # 'auto': chosen by the trainer before step 0
        if key not in FIELD_NAMES:
            raise ConfigError(f"unknown config key {key!r}{_suggest(key, FIELD_NAMES)}")
        if key == "compile":
            kwargs[key] = _compile_setting(value)
            continue
        try:  # TOML cannot write None (a key left out is the default), so the words leave 'or None' out
            kwargs[key] = coerce(value, _HINTS[key], key, mention_none=False)
        except ConfigError:
            if isinstance(value, dict):  # a dotted key under a setting that is not a table
                raise ConfigError(
                    f"unknown config key {key + '.' + next(iter(value), '')!r}: {key} is not a table"
                ) from None
            raise
    config = TrainConfig(**kwargs)
    validate(config)
    return config


def validate(config: TrainConfig) -> None:
    """Value checks that need no model, data or process group."""
    for name in FIELD_NAMES:
        value = getattr(config, name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{name} must be a finite number, got {value}")
        if isinstance(value, str):  # a path with bytes that are not UTF-8: config.toml could not hold it
            check_utf8_path(value, name)
    if config.seed < 0 or config.seed >= 2**63:
        raise ConfigError(f"seed must be from 0 to 2**63 - 1, got {config.seed}")
    for f in dataclasses.fields(TrainConfig):  # the bounds and choices each setting declares
        declared, value = setting_of(TrainConfig, f.name), getattr(config, f.name)
        if value is None:
            continue
        if declared.bound == "positive" and not value > 0:
            raise ConfigError(f"{f.name} must be positive, got {value}")
        if declared.bound == "nonnegative" and value < 0:
            raise ConfigError(f"{f.name} must be >= 0, got {value}")
        if declared.choices is not None and value not in declared.choices:
            raise ConfigError(f"{f.name} must be one of {', '.join(declared.choices)}, got {value!r}")
    if config.min_lr is not None and config.lr is not None and config.min_lr > config.lr:
        raise ConfigError(f"min_lr ({config.min_lr}) must not exceed lr ({config.lr})")
    for key in ("lr", "weight_decay"):
        if key in config.optimizer_args:
            raise ConfigError(f"set {key} with the top-level key '{key}', not optimizer_args.{key}")
    if config.min_lr_ratio > 1 or config.warmup_ratio > 1:
        raise ConfigError("min_lr_ratio and warmup_ratio must be at most 1")
    if not DEVICE_PATTERN.fullmatch(config.device):
        raise ConfigError(f"device must be {DEVICE_WORDS}, got {config.device!r}")
    if config.on_instability == "rewind" and config.parallel == "fsdp":
        raise ConfigError("on_instability=rewind cannot reload sharded weights in place; use stop and --resume-from")
    if config.micro_batch_size is not None and config.batch_size % config.micro_batch_size:
        raise ConfigError(
            f"batch_size {config.batch_size} is not divisible by micro_batch_size {config.micro_batch_size}"
        )
    for key in config.optimizer_args:
        if not isinstance(key, str) or not key.isidentifier():
            raise ConfigError(f"optimizer_args key {key!r} is not a valid name")
    parse_report_to(config.report_to)


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
def save_config(config: TrainConfig, path: str | Path) -> None:
    """Write the config as TOML, atomically (None values are left out: they mean 'default'; the
    ACTION_KEYS are what one invocation does, not properties of the run, and are left out too)."""
    values = {k: v for k, v in config.to_dict().items() if k not in ACTION_KEYS}
    atomic_write(path, CONFIG_HEADER + "\n" + dumps_toml(values))


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


# -- helpers --------------------------------------------------------------------------------
def _suggest(key: str, names: Iterable[str]) -> str:
    close = difflib.get_close_matches(key, list(names), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(names)}"


def _compile_setting(value: Any) -> str | bool:
    """'auto', true or false (the strings 'true' / 'false' too, as a CLI option may pass them)."""
    if isinstance(value, bool):
        return value
    word = value.strip().lower() if isinstance(value, str) else None
    settings: dict[str, str | bool] = {"auto": "auto", "true": True, "false": False}
    if word in settings:
        return settings[word]
    raise ConfigError(f"compile must be auto, true or false, got {value!r}")


def parse_report_to(value: str | Iterable[str] | None) -> list[str]:
    """'tensorboard, wandb' -> ['tensorboard', 'wandb']; 'none', '' and None -> []. Unknown names: ConfigError."""
    if value is None:
        return []
    items = value.split(",") if isinstance(value, str) else list(value)
    names = [str(item).strip().lower() for item in items if str(item).strip()]
    if "none" in names:
        if len(names) > 1:
            raise ConfigError(f"report_to: 'none' cannot be combined with other trackers, got {value!r}")
        return []
    for name in names:
        if name not in TRACKERS:
            raise ConfigError(f"report_to: unknown tracker {name!r}; choose from {', '.join(TRACKERS)} or none")
    return list(dict.fromkeys(names))
