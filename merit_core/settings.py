"""Every setting of `merit train` and `merit compare` with its default and its help, as plain data.

The standard library only (no torch, transformers or numpy), so that `--help` and the config
readers can use it without loading a model: `merit_cli` builds each option's help text and shown
default from here, `merit_core.config_reading` reads and checks a `TrainConfig`,
`merit_core.train.config` resolves it, and
`merit_core.compare.spec` fills a comparison from `CompareDefaults`.

- `TrainConfig`: a training run as the user gives it; `None` means "derived" (lr, steps, ...).
- `ResolvedConfig`: the same run after `merit_core.train.config.resolve`, those fields filled.
- `CompareDefaults`: the comparison's own keys (the top level of a compare TOML) and their defaults;
  `COMPARE_TRAIN`: the `merit train` settings a comparison runs with unless told otherwise.

Adding a `merit train` setting is one field of `TrainConfig`, declared with `setting(...)`: its
default, its help, and optionally `option="value"` (or "flag", "switch", "choice") for a
`merit train --NAME` option, `bound=` and `choices=` for the checks `validate` makes. The TOML key,
`--set NAME=...`, the option, its help and its shown default follow from that one declaration.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any

# -- constants named once ----------------------------------------------------------------------
# The vocabulary of the BPE merit trains on the data when no tokenizer is given, and so of the
# built-in corpus (its cache key names it) and of the tiny models built to fit it.
VOCAB_SIZE = 4096
# Optimizer updates of a run that sets neither steps nor tokens.
DEFAULT_STEPS = 300
# The device words train, eval, inspect and compare take.
DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:\d+)?|mps")
DEVICE_WORDS = "auto, cpu, cuda or cuda:N"
DEVICE_HELP = "auto (a CUDA GPU when one is visible, else the CPU), cpu, cuda or cuda:N."
# Dtype names as users type them -> the full name (merit eval takes all of them, merit train the
# compute dtypes of TRAIN_DTYPES, 'auto' besides).
DTYPE_SPELLINGS = {
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "float32": "float32",
    "fp32": "float32",
}
TRAIN_DTYPES = ("auto", "float32", "bfloat16")
KERNELS = ("auto", "liger", "none")  # see merit_core.train.liger_kernels
PARALLEL = ("ddp", "fsdp")
# The experiment trackers `report_to` may name (merit_core.train.trackers implements them).
TRACKERS = ("tensorboard", "wandb", "mlflow")
# What `merit train` does on an instability warning (merit_core.train.run_watch).
ON_INSTABILITY = ("record", "warn", "stop", "rewind")
# Actions of one invocation, not properties of the run: not written to the run's config.toml.
ACTION_KEYS = ("resume", "resume_from", "allow_changes", "verify")


# -- how a setting is declared -----------------------------------------------------------------
@dataclass(frozen=True)
class Setting:
    """What a setting says about itself besides its type and default.

    help: what it does, without its default (the help text adds that).
    option: the kind of its command-line option, or None when only `--set NAME=...` reaches it:
        "value" (`--name VALUE`, converted by the field's type), "flag" (`--name`), "switch"
        (`--name/--no-name`), "choice" (`--name` among `choices`).
    default_text: the default as `--help` shows it where the field's value does not say it (a
        derived default: None in the field); "" shows none.
    metavar: the option's value placeholder (INTEGER / FLOAT / TEXT from the type otherwise).
    choices: the allowed values. bound: "positive" (> 0) or "nonnegative" (>= 0); None values pass.
    """

    help: str
    option: str | None = None
    default_text: str | None = None
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    bound: str | None = None


OPTION_KINDS = ("value", "flag", "switch", "choice")
BOUNDS = ("positive", "nonnegative")


def setting(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    factory: Any = dataclasses.MISSING,
    option: str | None = None,
    default_text: str | None = None,
    metavar: str | None = None,
    choices: tuple[str, ...] | None = None,
    bound: str | None = None,
) -> Any:
    """A dataclass field carrying its `Setting` (in the field's metadata under "setting")."""
    if option is not None and option not in OPTION_KINDS:
        raise ValueError(f"option must be one of {OPTION_KINDS}, got {option!r}")
    if bound is not None and bound not in BOUNDS:
        raise ValueError(f"bound must be one of {BOUNDS}, got {bound!r}")
    meta = {"setting": Setting(help, option, default_text, metavar, choices, bound)}
    if factory is not dataclasses.MISSING:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


# -- merit train ---------------------------------------------------------------------------------
@dataclass(kw_only=True)
class TrainConfig:
    """A training run as given: defaults < a TOML file < `--set` < options (merit_core.train.config).

    Batch sizes count sequences; `batch_size` is the global batch. Each field's help says what it
    does (`setting_of(TrainConfig, name).help`); None in lr, weight_decay, min_lr, warmup_steps,
    steps and out means "derived": `merit_core.train.config.resolve` fills them into a
    ResolvedConfig (micro_batch_size None: chosen by the trainer before step 0).
    """

    model: str = setting(
        "gpt2-tiny", "Named model (gpt2-tiny, gpt2-small, llama-130m, ...) or a config.json path.", option="value"
    )
    optimizer: str = setting(
        "merit", "Optimizer name from the registry (merit, adamw, lamb, lion, sophiag, ...).", option="value"
    )
    optimizer_args: dict[str, Any] = setting(
        factory=dict, help="The optimizer's extra hyperparameters (betas, eps, ...), as a TOML table."
    )
    lr: float | None = setting(
        None,
        "Peak learning rate (linear warmup to it, then cosine decay to min_lr). For MERIT and LAMB the lr is "
        "relative: each step moves a weight by at most about lr x max|W| of its tensor (max-norm ratios; "
        "docs/MERIT.md), not by lr.",
        option="value",
        default_text="the measured lr for the model and batch, see merit_core.optim.lr_table; the start line says "
        "which and from which run, and 'extrapolated' with the cap when the batch or model is far from every "
        "measurement",
        bound="positive",
    )
    min_lr: float | None = setting(
        None, "The lr the cosine decay ends at.", default_text="lr x min_lr_ratio", bound="nonnegative"
    )
    min_lr_ratio: float = setting(0.1, "min_lr as a fraction of lr (at most 1).", bound="nonnegative")
    warmup_steps: int | None = setting(
        None, "Steps of linear warmup.", default_text="warmup_ratio x steps", bound="nonnegative"
    )
    warmup_ratio: float = setting(0.05, "Warmup as a fraction of the steps (at most 1).", bound="nonnegative")
    weight_decay: float | None = setting(
        None, "Decoupled weight decay.", default_text="the optimizer's registry default", bound="nonnegative"
    )
    grad_clip: float = setting(
        1.0, "Max global gradient norm; 0 disables clipping (the norm is still reported).", bound="nonnegative"
    )
    batch_size: int = setting(16, "Global batch size in sequences.", option="value", bound="positive")
    micro_batch_size: int | None = setting(
        None,
        "Sequences per forward pass per process (smaller: gradient accumulation), or auto: on CUDA the largest "
        "that fits (tried, halving on out-of-memory), on CPU the whole per-process batch unless host memory is "
        "short; the chosen value is recorded in the run's config.toml, so a resume reuses it.",
        option="value",
        default_text="auto",
        metavar="INTEGER|auto",
        bound="positive",
    )
    seq_len: int = setting(128, "Tokens per sequence.", option="value", bound="positive")
    steps: int | None = setting(
        None, "Optimizer updates.", option="value", default_text=f"{DEFAULT_STEPS}, or from --tokens", bound="positive"
    )
    tokens: int | None = setting(
        None, "Training tokens (instead of --steps; rounded up to whole steps).", option="value", bound="positive"
    )
    data: str | None = setting(
        None,
        "Prepared folder, text file/folder, dataset name or 'builtin' (the built-in corpus).",
        option="value",
        default_text="builtin",
    )
    data_config: str | None = setting(None, "Configuration of a hub dataset (e.g. 'en' for allenai/c4).")
    text_column: str = setting("text", "Column holding the text (.jsonl/.parquet/hub datasets).")
    tokenizer: str | None = setting(
        None, "Tokenizer name or path when data must be prepared.", option="value", default_text="train a BPE"
    )
    vocab_size: int = setting(VOCAB_SIZE, "Vocabulary of a BPE trained on the data.", option="value", bound="positive")
    out: str | None = setting(
        None,
        "Write the run into this folder (its config, metrics log, curves and step_N/ checkpoints).",
        option="value",
        default_text="runs/<date>-<model>-<optimizer>",
    )
    resume: bool = setting(False, "Continue the run in --out from its latest checkpoint.", option="flag")
    seed: int = setting(0, "Seed of the initialisation and the batch order.", option="value")
    device: str = setting("auto", DEVICE_HELP, option="value", metavar="DEVICE")
    dtype: str = setting(
        "auto",
        "Compute dtype: auto (bf16 autocast on CUDA, float32 on CPU), bfloat16 (or bf16) or float32 (fp32).",
        option="value",
        metavar="DTYPE",
        choices=TRAIN_DTYPES,
    )
    tf32: bool = setting(
        True,
        "Let CUDA float32 matrix products and convolutions use TF32 tensor cores (faster, ~1e-3 relative error; "
        "no effect on CPU or on bf16 autocast's products); --no-tf32 for full fp32 products.",
        option="switch",
        default_text="on",
    )
    compile: str | bool = setting(
        "auto",
        "torch.compile each transformer block (regional compilation, see merit_core.train.compiling).",
        option="switch",
        default_text="on CUDA, off on CPU",
    )
    kernels: str = setting(
        "auto",
        "auto (Liger Kernel's fused kernels on CUDA for the families it supports when liger-kernel is "
        "installed, merit's own chunked loss otherwise), liger (insist) or none (plain modules).",
        choices=KERNELS,
    )
    parallel: str = setting(
        "ddp",
        "Under torchrun: ddp (replicated weights) or fsdp (FSDP2: weights, gradients and optimizer state "
        "sharded over the processes).",
        option="choice",
        choices=PARALLEL,
    )
    eval_every: int = setting(
        50, "Steps between evaluations (0: only at the end).", option="value", bound="nonnegative"
    )
    eval_batches: int = setting(
        4,
        "Batches of the fixed validation set (evenly spaced windows, the same for every seed, batch split and "
        "process count); its first batch is where the max attention logit is measured.",
        bound="positive",
    )
    eval_batch_size: int = setting(16, "Sequences per validation batch.", bound="positive")
    save_every: int = setting(
        100, "Steps between checkpoints (0: only at the end).", option="value", bound="nonnegative"
    )
    keep_checkpoints: int = setting(0, "How many step_N/ folders to keep (0 keeps all).", bound="nonnegative")
    log_every: int = setting(10, "Steps between log lines.", bound="positive")
    report_to: str = setting(
        "none",
        "Experiment trackers, comma-separated: tensorboard, wandb, mlflow or none. TensorBoard writes to "
        "RUN/tensorboard; W&B runs offline unless WANDB_MODE or WANDB_API_KEY is set.",
        option="value",
        metavar="TRACKERS",
    )
    save_every_minutes: float = setting(
        0.0,
        "Also checkpoint when this many minutes passed since the last checkpoint (0: off).",
        option="value",
        bound="nonnegative",
    )
    resume_from: str | None = setting(
        None,
        "Continue the run in --out from this checkpoint (a step_N of the run) instead of the latest.",
        option="value",
        metavar="step_N",
    )
    allow_changes: bool = setting(
        False,
        "Let --resume continue with another seed, data or tokenizer than the run was trained with.",
        option="flag",
    )
    watch: bool = setting(
        True,
        "Watch for instability: probe the precursors every watch_every steps and warn ahead of a divergence "
        "(merit_core.train.watch_detector).",
        option="switch",
        default_text="on",
    )
    watch_every: int = setting(
        20,
        "Steps between the watcher's probes (each costs about a probe pass on 2 validation sequences and the "
        "update ratios; benchmarks/README.md has the cost per cadence).",
        bound="positive",
    )
    on_instability: str = setting(
        "record",
        "On a watcher warning: record it in the run's metrics and print nothing (the default: on the held-out 260-step "
        "runs of results/watch-train, probing every 2 steps, it came 20+ steps ahead of 19 of 26 divergences, too few "
        "to act on), warn and go on, stop "
        "naming the last checkpoint from before it, or rewind to that checkpoint with the lr halved "
        "(merit_core.train.run_watch).",
        option="choice",
        choices=ON_INSTABILITY,
    )
    verify: bool = setting(
        True,
        "Let --resume check the checkpoint's files against the checksums it recorded; --no-verify skips "
        "that (it says so).",
        option="switch",
        default_text="on",
    )

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(kw_only=True)
class ResolvedConfig(TrainConfig):
    """A TrainConfig after `merit_core.train.config.resolve`: the derived settings filled (tokens is
    then None: steps is the run length), so that a trainer reads `lr` or `steps` without a None case."""

    lr: float
    min_lr: float
    warmup_steps: int
    weight_decay: float
    steps: int
    out: str


# -- merit compare ------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class CompareDefaults:
    """The default comparison `merit compare` runs with no arguments, and its other settings.

    The paper's three optimizers on the tiny GPT-2 and the built-in corpus, a small and a large batch
    (8x apart) at one token budget, sized so the large batch takes 64 optimizer steps (at least 50)
    within the 2-core CPU budget (see merit_core.compare.__doc__ and benchmarks/README.md).
    """

    optimizers: tuple[str, ...] = setting(("adamw", "lamb", "merit"), "Comma-separated optimizers.", option="value")
    batch_sizes: tuple[int, ...] = setting((2, 16), "Comma-separated global batch sizes in sequences.", option="value")
    lrs: str = setting(
        "auto",
        "'auto': three lrs (x1/3, x1, x3) around the registry's measured lr for the model and each batch (or "
        "the nearest measured one x sqrt(tokens ratio)); or comma-separated lrs for every optimizer.",
        option="value",
    )
    tokens: int = setting(131_072, "Training tokens per run, the same at every batch size.", option="value")
    # `--quick`: the same comparison with half the tokens and one lr per optimizer (the auto grid's centre).
    quick_tokens: int = setting(65_536, "Training tokens per run of --quick.")
    out: str | None = setting(
        None,
        "Write the comparison into this folder (runs/, summary.json, REPORT.md, compare.png); re-running "
        "skips finished runs.",
        option="value",
        default_text="runs/compare-<model>",
    )
    jobs: int | None = setting(
        None,
        "Runs at once.",
        option="value",
        default_text="one per GPU; on CPU one per core, at most 4, sharing the cores",
    )
    seeds: int = setting(
        1, "Runs per learning rate, with train seeds seed, seed+1, ...; best lr on the mean.", option="value"
    )
    # Seeds of each best cell: after the grids, every best (optimizer, batch) cell is trained with at
    # least this many seeds (the grid's other lrs keep `seeds`), so each verdict rests on >= 3 values.
    best_seeds: int = setting(
        3, "Seeds of each best lr, topped up after the grids (at least --seeds; --seeds with --quick).", option="value"
    )
    environment_check: bool = setting(
        True,
        "Re-run each best cell's first seed at another thread count to measure the environment spread verdicts "
        "must exceed (off with --quick).",
        option="switch",
        default_text="on",
    )
    hessian: bool = setting(
        False,
        "Hessian eigenvalues (largest and smallest algebraic, largest magnitude) and trace of each best run's "
        "final weights on a fixed validation batch.",
        option="flag",
    )
    preset: str | None = setting(
        None,
        "ablations: merit, merit-noclip, merit-nobound, max-lamb, l2-merit, lamb-ref at the largest batch.",
        option="choice",
        choices=("ablations",),
    )
    # How many x3 steps an auto grid may grow beyond each of its edges while its best lr sits there.
    max_extensions: int = setting(
        2, "x3 steps an auto lr grid may grow past an edge holding the best lr, per side.", option="value"
    )


COMPARE = CompareDefaults()
# `--preset ablations`: MERIT and its registry ablations (each removes or changes one component)
# with the LAMB reference, at the comparison's largest batch only.
PRESETS = {"ablations": ("merit", "merit-noclip", "merit-nobound", "max-lamb", "l2-merit", "lamb-ref")}


# -- reading the declarations ------------------------------------------------------------------
def setting_of(cls: type, name: str) -> Setting:
    """The Setting declared for field `name` of a settings dataclass or the class it refines
    (ResolvedConfig redeclares TrainConfig's derived fields); KeyError: not a setting."""
    for klass in cls.__mro__:
        for f in dataclasses.fields(klass) if dataclasses.is_dataclass(klass) else ():
            if f.name == name and "setting" in f.metadata:
                return f.metadata["setting"]
    raise KeyError(f"{cls.__name__} has no setting {name!r}")


def default_of(cls: type, name: str) -> Any:
    """The default value of field `name` (a fresh one for a factory field)."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            if f.default_factory is not dataclasses.MISSING:
                return f.default_factory()
            return f.default
    raise KeyError(f"{cls.__name__} has no setting {name!r}")


def shown_default(cls: type, name: str, default: Any = dataclasses.MISSING) -> str:
    """The default as `--help` shows it: the declared default_text, else the value written as the
    user would type it ('' for None: nothing shown). `default` replaces the field's value (compare
    runs `merit train` settings with its own defaults, COMPARE_TRAIN)."""
    text = setting_of(cls, name).default_text
    if text is not None:
        return text
    value = default_of(cls, name) if default is dataclasses.MISSING else default
    if value is None:
        return ""
    if isinstance(value, bool):
        return "on" if value else ""  # a flag off unless given shows no default
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (tuple, list)):
        return ",".join(map(str, value))
    return str(value)


def value_type(cls: type, name: str) -> type:
    """The plain type of field `name`: int, float, str or bool (`X | None` -> X; `str | bool` -> bool)."""
    hint = typing.get_type_hints(cls)[name]
    union = isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
    args = [a for a in typing.get_args(hint) if a is not type(None)] if union else [hint]
    if bool in args:
        return bool
    origin = typing.get_origin(args[0]) or args[0]
    return str if origin in (tuple, list) else origin  # a list is given as comma-separated text


def option_names(cls: type) -> tuple[str, ...]:
    """The fields with a command-line option, in declaration order."""
    return tuple(f.name for f in dataclasses.fields(cls) if setting_of(cls, f.name).option is not None)


def _train_default(name: str) -> Any:
    return default_of(TrainConfig, name)


# The `merit train` settings every run of a comparison starts from (under its [train] table):
# train's own model and sequence length, a longer warmup than train's for the short runs.
COMPARE_TRAIN: dict[str, Any] = {
    "model": _train_default("model"),
    "seq_len": _train_default("seq_len"),
    "warmup_ratio": 0.1,
}
