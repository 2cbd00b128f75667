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

from merit_core.compare.environment import DEFAULT_PERTURBATIONS, PERTURBATIONS
from merit_core.config_reading import FIELD_NAMES, from_dict, parse_override, read_toml
from merit_core.errors import ConfigError
from merit_core.optim import canonical_name, resolve_hparams
from merit_core.settings import COMPARE, COMPARE_TRAIN, PRESETS
from merit_core.values import coerce, deep_merge, is_number, nest, parse_number, positive_int

# The default comparison, its presets and every other default are merit_core.settings' (COMPARE).

COMPARE_KEYS = (
    "optimizers",
    "batch_sizes",
    "lrs",
    "tokens",
    "jobs",
    "out",
    "train",
    "per_optimizer",
    "seeds",
    "hessian",
    "eval",
    "preset",
    "max_extensions",
    "best_seeds",
    "environment_check",
    "environment_samples",
)
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


@dataclass(frozen=True)
class EvalRequest:
    """`--eval`: zero-shot tasks for each best run's final checkpoint (merit eval's task names)."""

    tasks: tuple[str, ...]
    include_path: str | None = None
    limit: int | None = None


@dataclass
class CompareSpec:
    """A comparison: every optimizer at each of its batch sizes and each lr of its grid.

    lrs: per optimizer, a list of learning rates or "auto" (see merit_core.compare.grid).
    train: `merit train` settings shared by every run (a TrainConfig mapping, no owned keys).
    seeds: runs per (optimizer, batch, lr) cell, with train seeds seed, seed + 1, ...
    hessian: estimate the extreme Hessian eigenvalues and trace of each best run's final weights.
    eval: zero-shot tasks for each best run's final checkpoint, or None.
    max_extensions: how many x3 steps an auto grid may grow past an edge holding the best lr.
    best_seeds: seeds of each best cell (topped up after the grids; at least `seeds`; `seeds` with --quick).
    environment_check: re-run best cells' seeds in a perturbed floating-point environment, to measure
        how far the environment alone moves their numbers (off with --quick; merit_core.compare.environment).
    environment_perturbations: which parts of the environment the check changes, one re-run each
        (the TOML's `environment_check` as a list, e.g. ["threads", "isa"]; true: all of PERTURBATIONS).
    environment_samples: how many seeds of each best cell (the first ones) the check re-runs.
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
    seeds: int = COMPARE.seeds
    hessian: bool = COMPARE.hessian
    eval: EvalRequest | None = None
    preset: str | None = None
    max_extensions: int = COMPARE.max_extensions
    best_seeds: int = 1
    environment_check: bool = False
    environment_perturbations: tuple[str, ...] = DEFAULT_PERTURBATIONS
    environment_samples: int = 1
    command: str | None = None  # the command line that made it, recorded in summary.json and REPORT.md

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
    seeds: int | None = None,
    hessian: bool | None = None,
    eval_tasks: str | None = None,
    include_path: str | None = None,
    eval_limit: int | None = None,
    preset: str | None = None,
    max_extensions: int | None = None,
    best_seeds: int | None = None,
    environment_check: bool | None = None,
) -> CompareSpec:
    """The comparison from defaults < `path` (a compare TOML) < the given values.

    String values are the command-line forms: comma-separated optimizers and batch sizes, and
    lrs as 'auto' or comma-separated numbers. `train_values` (None entries ignored) and the
    `key=value` `overrides` set [train] keys. `best_seeds` defaults to COMPARE.best_seeds and
    `environment_check` to true; `quick` turns both off. `preset` ('ablations') sets the optimizers and keeps
    only the largest batch size. Raises ConfigError on any bad value.
    """
    raw = read_toml(path) if path is not None else {}
    unknown = set(raw) - set(COMPARE_KEYS)
    if unknown:
        key = sorted(unknown)[0]
        hint = " (a merit train key? put it under [train])" if _is_train_key(key) else ""
        raise ConfigError(f"unknown compare key {key!r} in {path}{hint}; known keys: {', '.join(COMPARE_KEYS)}")

    preset_name = preset if preset is not None else raw.get("preset")
    if preset_name is not None and preset_name not in PRESETS:
        raise ConfigError(f"unknown preset {preset_name!r}; known: {', '.join(PRESETS)}")
    if preset_name is not None and (optimizers is not None or "optimizers" in raw):
        raise ConfigError(f"preset {preset_name!r} sets the optimizers: give either the preset or --optimizers")
    opt_list = (
        parse_optimizers(optimizers)
        if optimizers is not None
        else _optimizer_list(
            list(PRESETS[preset_name]) if preset_name else raw.get("optimizers", list(COMPARE.optimizers))
        )
    )
    default_batches = (
        parse_batch_sizes(batch_sizes)
        if batch_sizes is not None
        else _batch_list(raw.get("batch_sizes", list(COMPARE.batch_sizes)), "batch_sizes")
    )
    if preset_name is not None:
        default_batches = default_batches[-1:]  # the large batch: where the components are claimed to matter
    if lrs is not None:
        lr_setting: Any = parse_lrs(lrs)
    else:
        lr_setting = raw.get("lrs", COMPARE.lrs)
    budget = tokens if tokens is not None else raw.get("tokens", COMPARE.quick_tokens if quick else COMPARE.tokens)
    budget = positive_int(budget, "tokens")

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
            if batch_sizes is not None or preset_name is not None or "batch_sizes" not in table
            else _batch_list(table["batch_sizes"], f"per_optimizer.{name}.batch_sizes")
        )
        setting = lr_setting if lrs is not None else table.get("lrs", lr_setting)
        grids[name] = _lr_setting(setting, name)
        args[name] = _optimizer_args(name, table.get("optimizer_args", {}))

    train = _train_settings(raw.get("train", {}), train_values or {}, overrides, parse_override)
    out_dir = out if out is not None else raw.get("out")
    if out_dir is None:
        suffix = (f"-{preset_name}" if preset_name else "") + ("-quick" if quick else "")
        out_dir = Path("runs") / f"compare-{_model_stem(str(train['model']))}{suffix}"
    n_jobs = jobs if jobs is not None else raw.get("jobs")
    if n_jobs is not None:
        n_jobs = positive_int(n_jobs, "jobs")
    n_seeds = positive_int(seeds if seeds is not None else raw.get("seeds", COMPARE.seeds), "seeds")
    with_hessian = coerce(hessian if hessian else raw.get("hessian", COMPARE.hessian), bool, "hessian")
    extensions = max_extensions if max_extensions is not None else raw.get("max_extensions", COMPARE.max_extensions)
    extensions = positive_int(extensions, "max_extensions", zero=True)
    n_best = best_seeds if best_seeds is not None else raw.get("best_seeds", COMPARE.best_seeds)
    n_best = max(positive_int(n_best, "best_seeds"), n_seeds)
    env_setting = (
        environment_check if environment_check is not None else raw.get("environment_check", COMPARE.environment_check)
    )
    kinds = _perturbation_list(env_setting)
    env = bool(kinds)
    samples = positive_int(raw.get("environment_samples", 1), "environment_samples")
    if samples > n_best:
        raise ConfigError(f"environment_samples {samples} exceeds best_seeds {n_best}: a sample re-runs a best seed")
    if quick:  # a smoke run: no best cell to top up, no verdict to weigh against the environment
        n_best, env = n_seeds, False
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
        seeds=n_seeds,
        hessian=with_hessian,
        eval=_eval_request(raw.get("eval"), eval_tasks, include_path, eval_limit),
        preset=preset_name,
        max_extensions=extensions,
        best_seeds=n_best,
        environment_check=env,
        environment_perturbations=kinds or DEFAULT_PERTURBATIONS,
        environment_samples=samples,
    )


def _perturbation_list(value: Any) -> tuple[str, ...]:
    """environment_check: true (every perturbation), false (none) or a list of PERTURBATIONS' names."""
    if isinstance(value, list):
        bad = [v for v in value if v not in PERTURBATIONS]
        if bad or not value:
            raise ConfigError(
                f"environment_check: {bad[0] if bad else 'an empty list'!r} is not a perturbation; "
                f"give true, false or a list of {', '.join(PERTURBATIONS)}"
            )
        return tuple(dict.fromkeys(value))
    return DEFAULT_PERTURBATIONS if coerce(value, bool, "environment_check") else ()


def _eval_request(table: Any, tasks: str | None, include_path: str | None, limit: int | None) -> EvalRequest | None:
    """--eval / --include-path / --eval-limit over the TOML's [eval] table (tasks, include_path, limit)."""
    table = {} if table is None else table
    if not isinstance(table, dict) or set(table) - {"tasks", "include_path", "limit"}:
        raise ConfigError("eval must be a table with tasks, include_path and limit ([eval])")
    names = tasks if tasks is not None else table.get("tasks")
    if isinstance(names, str):
        names = [part.strip() for part in names.split(",") if part.strip()]
    if names is None or names == []:
        if tasks is not None or table:
            raise ConfigError("--eval is empty: give task names, e.g. --eval lambada_openai,wikitext")
        if include_path is not None or limit is not None:
            raise ConfigError("--include-path and --eval-limit need --eval TASKS")
        return None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ConfigError(f"eval tasks must be a list of task names, got {names!r}")
    path = include_path if include_path is not None else table.get("include_path")
    n = limit if limit is not None else table.get("limit")
    if n is not None:
        n = positive_int(n, "eval limit")
    return EvalRequest(tuple(names), None if path is None else str(path), n)


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
            values.append(parse_number(item.replace("_", ""), int, "--batch-sizes"))
        except ConfigError:
            if item.lower().endswith("k") and item[:-1].isascii() and item[:-1].isdigit():
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
            values.append(parse_number(item, float, "--lrs"))
        except ConfigError:
            raise ConfigError(f"--lrs: {item!r} is not a number (give 'auto' or numbers like 1e-3,3e-3)") from None
    return _lr_list(values, "--lrs")


# -- checks ---------------------------------------------------------------------------------
def _canonical(name: Any) -> str:
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
    return sorted({positive_int(v, what) for v in value})


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
        if not is_number(v) or not math.isfinite(v) or v <= 0:
            raise ConfigError(f"{what}: learning rates must be positive numbers, got {v!r}")
        out.append(float(v))
    return sorted(set(out))


def _optimizer_args(name: str, args: Any) -> dict[str, Any]:
    if not isinstance(args, dict):
        raise ConfigError(f"per_optimizer.{name}.optimizer_args must be a table")
    for key in ("lr", "weight_decay"):
        if key in args:
            hint = "lrs" if key == "lr" else "train.weight_decay"
            raise ConfigError(f"per_optimizer.{name}.optimizer_args.{key}: set it with {hint}")
    resolve_hparams(name, **args)  # unknown or mistyped hyperparameters fail now
    return dict(args)


def _is_train_key(key: str) -> bool:
    return key in FIELD_NAMES


def _train_settings(table: Any, values: dict[str, Any], overrides: Iterable[str], parse_override) -> dict[str, Any]:
    """COMPARE_TRAIN < [train] < --set < options, checked by building a TrainConfig."""
    if not isinstance(table, dict):
        raise ConfigError("train must be a table of merit train settings ([train])")
    merged: dict[str, Any] = dict(COMPARE_TRAIN)
    deep_merge(merged, table)
    for item in overrides:
        deep_merge(merged, nest(*parse_override(item)))
    deep_merge(merged, {k: v for k, v in values.items() if v is not None})
    for key in merged:
        if key in OWNED_TRAIN_KEYS:
            raise ConfigError(f"'{key}' is set by the comparison, not [train] or --set; use {OWNED_TRAIN_KEYS[key]}")
        if key not in FIELD_NAMES:
            from_dict({key: merged[key]})  # raises the train config's 'unknown key ... did you mean' error
    if merged.get("optimizer_args"):
        raise ConfigError("optimizer_args differ per optimizer: set them in [per_optimizer.NAME] tables")
    return merged


def _model_stem(model: str) -> str:
    path = Path(model)
    return path.parent.name if model.endswith(".json") else path.name
