"""TrainConfig: every knob of a training run, read from TOML with `key=value` overrides.

Precedence: dataclass defaults < TOML file < overrides (in order). Override values are TOML
literals (`lr=3e-4`, `optimizer_args.betas=[0.9, 0.95]`, `compile=true`); a value that is not a
valid TOML literal is taken as a string (`model=gpt2-small`). Unknown keys raise ConfigError
naming the closest known key. `resolve()` fills the derived fields (lr and weight decay, steps from
tokens, warmup, min lr, micro-batch, run directory) so the saved `config.toml` replays the run
exactly, and says where a default lr came from (`Resolved`).
"""

from __future__ import annotations

import dataclasses
import datetime
import difflib
import math
import re
import tomllib
import typing
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from merit_core.errors import ConfigError
from merit_core.fileio import atomic_write
from merit_core.models import model_width
from merit_core.optim.lr_table import LrDefault
from merit_core.optim.registry import OptimizerSpec, default_lr, get_spec
from merit_core.runs import CONFIG_HEADER
from merit_core.values import coerce, deep_merge, nest

DTYPES = ("auto", "float32", "bfloat16")
KERNELS = ("auto", "liger", "none")  # see merit_core.train.kernels
PARALLEL = ("ddp", "fsdp")


@dataclass
class TrainConfig:
    """A training run. Batch sizes count sequences; `batch_size` is the global batch.

    model: a named model (see merit_core.models) or a path to a config.json.
    optimizer / optimizer_args: a registry name and its extra hyperparameters (betas, eps, ...).
    lr / weight_decay: default to the optimizer's registry defaults (lr: its measured lr for the
        model and batch first, see merit_core.optim.registry.default_lr; `resolve` applies them).
    lr / min_lr / min_lr_ratio / warmup_steps / warmup_ratio: linear warmup to `lr`, then cosine
        decay to `min_lr` (default `lr * min_lr_ratio`); warmup defaults to `warmup_ratio * steps`.
    steps / tokens: the run length; give one (tokens are rounded up to whole steps).
    data / data_config / text_column: a prepared folder, raw text files, a dataset name (with its
        config name, e.g. 'en' for allenai/c4, and text column) or nothing (the built-in corpus).
    tokenizer / vocab_size: the tokenizer (name or path; default: a BPE of `vocab_size` trained on
        the data) used when the data must be prepared.
    micro_batch_size: sequences per forward pass per process; None (written 'auto' in TOML and on
        the command line) lets the trainer choose before step 0: on CUDA the largest that fits
        (tried, halving on out-of-memory), on CPU the whole per-process batch unless host memory
        is short. The chosen value is written to the run's config.toml, so a resume reuses it.
    device: 'auto' (cuda when available), 'cpu', 'cuda'. dtype: 'auto' (bf16 autocast on CUDA,
        float32 on CPU), 'float32', 'bfloat16' (autocast).
    compile: 'auto' (torch.compile on CUDA, not on CPU), true or false; each transformer block is
        compiled (regional compilation, see merit_core.train.compiling).
    tf32: let CUDA float32 matrix products and convolutions use TF32 tensor cores (faster, ~1e-3
        relative error; no effect on CPU or on bf16 autocast's bf16 products).
    eval_every / save_every / log_every: in steps; 0 means only at the end of the run.
    eval_batches / eval_batch_size: the fixed validation set (evenly spaced windows, the same for
        every seed, batch split and process count); its first batch is where the max attention
        logit is measured.
    grad_clip: max global gradient norm; 0 disables clipping (the norm is still reported).
    keep_checkpoints: how many `step_N/` folders to keep (0 keeps all).
    report_to: experiment trackers, comma-separated: tensorboard, wandb, mlflow, or none (see
        merit_core.train.trackers).
    save_every_minutes: also checkpoint when this many minutes passed since the last one (0: off).
    resume_from: resume from this checkpoint (`step_N` of the run, or a path) instead of the latest.
    allow_changes: let a resume continue with another seed, data or tokenizer than the run's.
    kernels: 'auto' (Liger Kernel's fused linear cross-entropy, RMSNorm, RoPE and SwiGLU on CUDA
        for the families it supports when liger-kernel is installed; merit's own chunked loss
        otherwise), 'liger' (insist), 'none' (plain modules); see merit_core.train.kernels.
    parallel: how to spread the model under torchrun: 'ddp' (replicas) or 'fsdp' (FSDP2 shards;
        see merit_core.train.fsdp). A single process ignores it, except that fsdp refuses the
        optimizers it cannot run.
    """

    model: str = "gpt2-tiny"
    optimizer: str = "merit"
    optimizer_args: dict[str, Any] = field(default_factory=dict)
    lr: float | None = None
    min_lr: float | None = None
    min_lr_ratio: float = 0.1
    warmup_steps: int | None = None
    warmup_ratio: float = 0.05
    weight_decay: float | None = None
    grad_clip: float = 1.0
    batch_size: int = 16
    micro_batch_size: int | None = None
    seq_len: int = 128
    steps: int | None = None
    tokens: int | None = None
    data: str | None = None
    data_config: str | None = None
    text_column: str = "text"
    tokenizer: str | None = None
    vocab_size: int = 4096
    out: str | None = None
    resume: bool = False
    seed: int = 0
    device: str = "auto"
    dtype: str = "auto"
    tf32: bool = True
    compile: str | bool = "auto"
    kernels: str = "auto"
    parallel: str = "ddp"
    eval_every: int = 50
    eval_batches: int = 4
    eval_batch_size: int = 16
    save_every: int = 100
    keep_checkpoints: int = 0
    log_every: int = 10
    report_to: str = "none"
    save_every_minutes: float = 0.0
    resume_from: str | None = None
    allow_changes: bool = False

    # -- derived values ------------------------------------------------------------------
    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


DEFAULT_STEPS = 300
FIELD_NAMES = tuple(f.name for f in dataclasses.fields(TrainConfig))
_HINTS = typing.get_type_hints(TrainConfig)


# -- building a config ---------------------------------------------------------------------
def load_config(
    path: str | Path | None = None, overrides: Iterable[str] = (), values: dict[str, Any] | None = None
) -> TrainConfig:
    """A validated TrainConfig from defaults < TOML file < `key=value` overrides < `values`.

    `values` holds already-typed settings (CLI options); None entries are ignored.
    """
    data: dict[str, Any] = {}
    if path is not None:
        deep_merge(data, read_toml(path))
    for item in overrides:
        deep_merge(data, nest(*parse_override(item)))
    if values:
        deep_merge(data, {k: v for k, v in values.items() if v is not None})
    return from_dict(data)


def read_toml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"config file {path} is a folder; give a .toml file")
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from None
    except RecursionError:
        raise ConfigError(f"{path}: a value is nested too deeply to read") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None


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


# Actions of one invocation, not properties of the run: not written to the run's config.toml.
ACTION_KEYS = ("resume", "resume_from", "allow_changes")


def validate(config: TrainConfig) -> None:
    """Value checks that need no model, data or process group."""
    for name in FIELD_NAMES:
        value = getattr(config, name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{name} must be a finite number, got {value}")
    if config.seed < 0 or config.seed >= 2**63:
        raise ConfigError(f"seed must be from 0 to 2**63 - 1, got {config.seed}")
    positive = [
        "batch_size",
        "seq_len",
        "eval_batches",
        "eval_batch_size",
        "log_every",
        "vocab_size",
        "lr",
        "micro_batch_size",
        "steps",
        "tokens",
    ]
    for name in positive:
        value = getattr(config, name)
        if value is not None and not value > 0:
            raise ConfigError(f"{name} must be positive, got {value}")
    for name in (
        "weight_decay",
        "grad_clip",
        "eval_every",
        "save_every",
        "keep_checkpoints",
        "min_lr_ratio",
        "warmup_ratio",
        "warmup_steps",
        "min_lr",
        "save_every_minutes",
    ):
        value = getattr(config, name)
        if value is not None and value < 0:
            raise ConfigError(f"{name} must be >= 0, got {value}")
    if config.min_lr is not None and config.lr is not None and config.min_lr > config.lr:
        raise ConfigError(f"min_lr ({config.min_lr}) must not exceed lr ({config.lr})")
    for key in ("lr", "weight_decay"):
        if key in config.optimizer_args:
            raise ConfigError(f"set {key} with the top-level key '{key}', not optimizer_args.{key}")
    if config.min_lr_ratio > 1 or config.warmup_ratio > 1:
        raise ConfigError("min_lr_ratio and warmup_ratio must be at most 1")
    if config.dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {config.dtype!r}")
    if config.kernels not in KERNELS:
        raise ConfigError(f"kernels must be one of {', '.join(KERNELS)}, got {config.kernels!r}")
    if config.parallel not in PARALLEL:
        raise ConfigError(f"parallel must be one of {', '.join(PARALLEL)}, got {config.parallel!r}")
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?|mps", config.device):
        raise ConfigError(f"device must be auto, cpu, cuda or cuda:N, got {config.device!r}")
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

    config: TrainConfig
    lr: LrDefault | None


def resolve(
    config: TrainConfig,
    world_size: int = 1,
    spec: OptimizerSpec | None = None,
    now: datetime.datetime | None = None,
    auto_micro_batch: bool = False,
) -> Resolved:
    """A copy with derived fields filled: lr and weight_decay (the optimizer's registry defaults;
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
    c = dataclasses.replace(config, optimizer=spec.name, optimizer_args=dict(config.optimizer_args))
    chosen = None
    if c.lr is None:
        chosen = default_lr(spec, c.model, c.batch_size, c.seq_len, model_width(c.model))
        c.lr = chosen.lr
    if c.weight_decay is None:
        if "weight_decay" not in spec.defaults:
            raise ConfigError(f"weight_decay is not set and optimizer {spec.name!r} has no default for it")
        c.weight_decay = float(spec.defaults["weight_decay"])
    if c.min_lr is not None and c.min_lr > c.lr:
        raise ConfigError(f"min_lr ({c.min_lr}) must not exceed lr ({c.lr})")
    if c.steps is None:
        c.steps = math.ceil(c.tokens / c.tokens_per_step) if c.tokens is not None else DEFAULT_STEPS
    elif c.tokens is not None and c.steps != math.ceil(c.tokens / c.tokens_per_step):
        raise ConfigError(f"steps ({c.steps}) and tokens ({c.tokens}) disagree; give only one of them")
    c.tokens = None  # steps is now the single source of truth
    if c.warmup_steps is None:
        c.warmup_steps = int(c.warmup_ratio * c.steps)
    if c.min_lr is None:
        c.min_lr = c.lr * c.min_lr_ratio
    per_rank, rest = divmod(c.batch_size, world_size)
    if rest:
        raise ConfigError(f"batch_size {c.batch_size} is not divisible by the world size {world_size}")
    if c.micro_batch_size is None and not auto_micro_batch:
        c.micro_batch_size = per_rank
    if c.micro_batch_size is not None and per_rank % c.micro_batch_size:
        raise ConfigError(
            f"batch_size {c.batch_size} is not divisible by micro_batch_size {c.micro_batch_size} x world size "
            f"{world_size}; pick a micro-batch that divides {per_rank}"
        )
    if c.out is None:
        stamp = (now or datetime.datetime.now()).strftime("%Y%m%d-%H%M%S")
        model = Path(c.model).parent.name if c.model.endswith(".json") else Path(c.model).name
        c.out = str(Path("runs") / f"{stamp}-{model}-{c.optimizer}")
    return Resolved(c, chosen)


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


# The experiment trackers `report_to` may name (train/trackers.py implements them).
TRACKERS = ("tensorboard", "wandb", "mlflow")


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
