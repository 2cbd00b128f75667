"""Reading and checking a user's config without torch: a TrainConfig (merit_core.settings) from
TOML with `key=value` overrides, and the checks that need neither a model nor data.

Precedence: dataclass defaults < TOML file < overrides (in order). Override values are TOML
literals (`lr=3e-4`, `optimizer_args.betas=[0.9, 0.95]`, `compile=true`); a value that is not a
valid TOML literal is taken as a string (`model=gpt2-small`). Unknown keys raise ConfigError
naming the closest known key. `check_names_and_out` answers a misspelt model or optimizer and a
reused run folder before the training package (torch, transformers: seconds of imports) loads;
merit_core.train.config resolves the derived fields and re-exports what is here.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import tomllib
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from merit_core.checkpoint.runs import check_new_run, check_out
from merit_core.errors import ConfigError
from merit_core.file_reading import read_toml_file
from merit_core.models import check_model_name
from merit_core.optimizer_names import known_optimizer
from merit_core.output_checks import check_utf8_path
from merit_core.settings import DEVICE_PATTERN, DEVICE_WORDS, TRACKERS, TrainConfig, setting_of
from merit_core.values import coerce, deep_merge, nest

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
    """The table of a train or compare config file (merit_core.file_reading.read_toml_file); ConfigError
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
    if config.micro_batch_size is not None and config.batch_size % config.micro_batch_size:
        raise ConfigError(
            f"batch_size {config.batch_size} is not divisible by micro_batch_size {config.micro_batch_size}"
        )
    for key in config.optimizer_args:
        if not isinstance(key, str) or not key.isidentifier():
            raise ConfigError(f"optimizer_args key {key!r} is not a valid name")
    parse_report_to(config.report_to)


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


def check_names_and_out(config: TrainConfig) -> None:
    """The checks of a new run that read no model, data or optimizer code: the model is a named one or
    a config.json path, the optimizer a built-in name, and the run folder (`--out`) may hold a run and,
    without --resume, holds no checkpoints yet. The training run makes them again (the folder under its
    lock); here they come before the seconds of importing torch and transformers."""
    check_model_name(config.model)
    known_optimizer(config.optimizer)
    if config.out is not None:
        check_out(config.out)
        if not (config.resume or config.resume_from):
            check_new_run(Path(config.out))
