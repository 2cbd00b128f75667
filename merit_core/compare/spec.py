"""CompareSpec: what `merit compare` runs, read from defaults < a compare TOML < command-line values.

A compare TOML has top-level comparison keys and a `[train]` table of `merit train` settings
shared by every run; `[per_optimizer.NAME]` tables refine one optimizer:

    optimizers = ["adamw", "lamb", "merit"]
    batch_sizes = [480, 1024]
    tokens = 2_480_000_000
    lrs = "auto"                      # or [3e-4, 6e-4], or a table {adamw = [...], merit = "auto"}
    [train]
    model = "gpt2-small"
    seq_len = 1024
    [per_optimizer.adamw]
    batch_sizes = [480, 1024]         # this optimizer's own batch sizes
    optimizer_args = {betas = [0.9, 0.95]}

The comparison owns the keys that vary between runs (optimizer, batch_size, lr, the run
length, out, resume); setting them under [train] is a ConfigError that says where they go.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from merit_core.errors import ConfigError

# The default comparison (no arguments): the paper's three optimizers on the tiny GPT-2 and the
# built-in corpus, a small and a large batch (8x apart) at one token budget. Sized by measuring
# throughput on a 2-core CPU (see merit_core.compare.__doc__).
DEFAULT_OPTIMIZERS = ("adamw", "lamb", "merit")
DEFAULT_BATCH_SIZES = (8, 64)
DEFAULT_TOKENS = 131_072
DEFAULT_TRAIN: dict[str, Any] = {"model": "gpt2-tiny", "seq_len": 128, "warmup_ratio": 0.1}
# `--quick`: the same comparison with half the tokens and one lr per optimizer (the auto grid's centre).
QUICK_TOKENS = 65_536

COMPARE_KEYS = ("optimizers", "batch_sizes", "lrs", "tokens", "jobs", "out", "train", "per_optimizer")
PER_OPTIMIZER_KEYS = ("lrs", "batch_sizes", "optimizer_args")
OWNED_TRAIN_KEYS = {
    "optimizer": "--optimizers / optimizers",
    "batch_size": "--batch-sizes / batch_sizes",
    "lr": "--lrs / lrs",
    "steps": "--tokens / tokens (the budget is in tokens, the same for every batch size)",
    "tokens": "--tokens / the top-level key tokens",
    "out": "--out / the top-level key out",
    "resume": "nothing: re-running the comparison resumes unfinished runs",
}


@dataclass
class CompareSpec:
    """A comparison: every optimizer at each of its batch sizes and each lr of its grid.

    lrs: per optimizer, a list of learning rates or "auto" (see merit_core.compare.grid).
    train: `merit train` settings shared by every run (a TrainConfig mapping, no owned keys).
    """

    optimizers: list[str]
    batch_sizes: dict[str, list[int]]
    lrs: dict[str, list[float] | str]
    tokens: int
    train: dict[str, Any]
    optimizer_args: dict[str, dict[str, Any]] = field(default_factory=dict)
    out: Path = Path("runs/compare")
    jobs: int | None = None
    quick: bool = False

    @property
    def all_batch_sizes(self) -> list[int]:
        return sorted({b for sizes in self.batch_sizes.values() for b in sizes})


def load_spec(
    path: str | Path | None = None,
    *,
    optimizers: str | None = None,
    batch_sizes: str | None = None,
    lrs: str | None = None,
    tokens: int | None = None,
    out: str | None = None,
    jobs: int | None = None,
    quick: bool = False,
    train_values: dict[str, Any] | None = None,
    overrides: Iterable[str] = (),
) -> CompareSpec:
    """The comparison from defaults < `path` (a compare TOML) < the given values.

    String values are the command-line forms: comma-separated optimizers and batch sizes, and
    lrs as 'auto' or comma-separated numbers. `train_values` (None entries ignored) and the
    `key=value` `overrides` set [train] keys. Raises ConfigError on any bad value.
    """
    from merit_core.train.config import parse_override, read_toml

    raw = read_toml(path) if path is not None else {}
    unknown = set(raw) - set(COMPARE_KEYS)
    if unknown:
        key = sorted(unknown)[0]
        hint = " (a merit train key? put it under [train])" if _is_train_key(key) else ""
        raise ConfigError(f"unknown compare key {key!r} in {path}{hint}; known keys: {', '.join(COMPARE_KEYS)}")

    opt_list = (
        parse_optimizers(optimizers)
        if optimizers is not None
        else _optimizer_list(raw.get("optimizers", list(DEFAULT_OPTIMIZERS)))
    )
    default_batches = (
        parse_batch_sizes(batch_sizes)
        if batch_sizes is not None
        else _batch_list(raw.get("batch_sizes", list(DEFAULT_BATCH_SIZES)), "batch_sizes")
    )
    if lrs is not None:
        lr_setting: Any = parse_lrs(lrs)
    else:
        lr_setting = raw.get("lrs", "auto")
    budget = tokens if tokens is not None else raw.get("tokens", QUICK_TOKENS if quick else DEFAULT_TOKENS)
    budget = _positive_int(budget, "tokens")

    per = raw.get("per_optimizer", {})
    if not isinstance(per, dict):
        raise ConfigError("per_optimizer must be a table of [per_optimizer.NAME] tables")
    per = {_canonical(name): value for name, value in per.items()}
    batches: dict[str, list[int]] = {}
    grids: dict[str, list[float] | str] = {}
    args: dict[str, dict[str, Any]] = {}
    for name in opt_list:
        table = per.get(name, {})
        if not isinstance(table, dict):
            raise ConfigError(f"per_optimizer.{name} must be a table")
        bad = set(table) - set(PER_OPTIMIZER_KEYS)
        if bad:
            raise ConfigError(
                f"unknown key {sorted(bad)[0]!r} in per_optimizer.{name}; known: {', '.join(PER_OPTIMIZER_KEYS)}"
            )
        batches[name] = (
            default_batches
            if batch_sizes is not None or "batch_sizes" not in table
            else _batch_list(table["batch_sizes"], f"per_optimizer.{name}.batch_sizes")
        )
        setting = lr_setting if lrs is not None else table.get("lrs", lr_setting)
        grids[name] = _lr_setting(setting, name)
        args[name] = _optimizer_args(name, table.get("optimizer_args", {}))

    train = _train_settings(raw.get("train", {}), train_values or {}, overrides, parse_override)
    out_dir = out if out is not None else raw.get("out")
    if out_dir is None:
        out_dir = Path("runs") / f"compare-{_model_stem(str(train['model']))}{'-quick' if quick else ''}"
    n_jobs = jobs if jobs is not None else raw.get("jobs")
    if n_jobs is not None:
        n_jobs = _positive_int(n_jobs, "jobs")
    return CompareSpec(
        optimizers=opt_list,
        batch_sizes=batches,
        lrs=grids,
        tokens=budget,
        train=train,
        optimizer_args=args,
        out=Path(out_dir),
        jobs=n_jobs,
        quick=quick,
    )


# -- parsing the command-line forms ---------------------------------------------------------
def parse_optimizers(text: str) -> list[str]:
    """'adamw, lamb,merit' -> canonical registry names; ConfigError when empty or unknown."""
    return _optimizer_list([part for part in text.split(",") if part.strip()] if text.strip() else [])


def parse_batch_sizes(text: str) -> list[int]:
    """'8,64' -> [8, 64]; ConfigError on an empty list or a value that is not a positive integer."""
    items = [part.strip() for part in text.split(",") if part.strip()]
    values = []
    for item in items:
        try:
            values.append(int(item.replace("_", "")))
        except ValueError:
            if item.lower().endswith("k") and item[:-1].isdigit():
                values.append(int(item[:-1]) * 1024)
            else:
                raise ConfigError(f"--batch-sizes: {item!r} is not an integer") from None
    return _batch_list(values, "--batch-sizes")


def parse_lrs(text: str) -> list[float] | str:
    """'auto' -> 'auto'; '1e-3,3e-3' -> [0.001, 0.003]; ConfigError when empty or not positive."""
    if text.strip().lower() == "auto":
        return "auto"
    values = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        try:
            values.append(float(item))
        except ValueError:
            raise ConfigError(f"--lrs: {item!r} is not a number (give 'auto' or numbers like 1e-3,3e-3)") from None
    return _lr_list(values, "--lrs")


# -- checks ---------------------------------------------------------------------------------
def _canonical(name: Any) -> str:
    from merit_core.optim import canonical_name

    return canonical_name(name)


def _optimizer_list(value: Any) -> list[str]:
    if isinstance(value, str):
        value = [part for part in value.split(",") if part.strip()]
    if not isinstance(value, list) or not value:
        raise ConfigError("no optimizers to compare: give at least one, e.g. --optimizers adamw,lamb,merit")
    names = [_canonical(v.strip() if isinstance(v, str) else v) for v in value]
    return list(dict.fromkeys(names))


def _batch_list(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{what} is empty: give at least one batch size, e.g. --batch-sizes 8,64")
    return sorted({_positive_int(v, what) for v in value})


def _lr_setting(value: Any, optimizer: str) -> list[float] | str:
    if isinstance(value, dict):
        if optimizer not in {_canonical(k) for k in value}:
            return "auto"
        value = next(v for k, v in value.items() if _canonical(k) == optimizer)
    if isinstance(value, str):
        return parse_lrs(value)
    if isinstance(value, list):
        return _lr_list(value, f"lrs for {optimizer}")
    raise ConfigError(f"lrs for {optimizer} must be 'auto' or a list of numbers, got {value!r}")


def _lr_list(values: list[Any], what: str) -> list[float]:
    if not values:
        raise ConfigError(f"{what} is empty: give 'auto' or at least one learning rate")
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ConfigError(f"{what}: learning rates must be positive numbers, got {v!r}")
        out.append(float(v))
    return sorted(set(out))


def _positive_int(value: Any, what: str) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{what} must be a positive integer, got {value!r}")
    return value


def _optimizer_args(name: str, args: Any) -> dict[str, Any]:
    from merit_core.optim import resolve_hparams

    if not isinstance(args, dict):
        raise ConfigError(f"per_optimizer.{name}.optimizer_args must be a table")
    for key in ("lr", "weight_decay"):
        if key in args:
            hint = "lrs" if key == "lr" else "train.weight_decay"
            raise ConfigError(f"per_optimizer.{name}.optimizer_args.{key}: set it with {hint}")
    resolve_hparams(name, **args)  # unknown or mistyped hyperparameters fail now
    return dict(args)


def _is_train_key(key: str) -> bool:
    from merit_core.train.config import FIELD_NAMES

    return key in FIELD_NAMES


def _train_settings(table: Any, values: dict[str, Any], overrides: Iterable[str], parse_override) -> dict[str, Any]:
    """DEFAULT_TRAIN < [train] < --set < options, checked by building a TrainConfig."""
    from merit_core.train.config import FIELD_NAMES

    if not isinstance(table, dict):
        raise ConfigError("train must be a table of merit train settings ([train])")
    merged: dict[str, Any] = dict(DEFAULT_TRAIN)
    _deep_merge(merged, table)
    for item in overrides:
        key, value = parse_override(item)
        nested: Any = value
        for part in reversed(key.split(".")[1:]):
            nested = {part: nested}
        _deep_merge(merged, {key.split(".")[0]: nested})
    _deep_merge(merged, {k: v for k, v in values.items() if v is not None})
    for key in merged:
        if key in OWNED_TRAIN_KEYS:
            raise ConfigError(f"'{key}' is set by the comparison, not [train] or --set; use {OWNED_TRAIN_KEYS[key]}")
        if key not in FIELD_NAMES:
            from merit_core.train.config import from_dict

            from_dict({key: merged[key]})  # raises the train config's 'unknown key ... did you mean' error
    if merged.get("optimizer_args"):
        raise ConfigError("optimizer_args differ per optimizer: set them in [per_optimizer.NAME] tables")
    return merged


def _deep_merge(base: dict[str, Any], new: dict[str, Any]) -> None:
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _deep_merge(base[key], value)
        else:
            base[key] = value


def _model_stem(model: str) -> str:
    path = Path(model)
    return path.parent.name if model.endswith(".json") else path.name
