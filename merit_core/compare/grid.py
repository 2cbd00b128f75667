"""The runs of a comparison: the learning-rate grids, and one `merit train` config per run.

The auto grid for optimizer `o` at batch size `B` is `centre * AUTO_FACTORS` (x {1/3, 1, 3};
just the centre with --quick), rounded to three significant digits (run folders are named
after them), where

    centre = lr_centre(o).at(scale) * sqrt(B / B_min)

- `B_min` is the smallest batch of the comparison; the square-root rule of Adam-type and
  layer-wise adaptive optimizers shifts the grid up for larger batches (for an 8x larger
  batch, x2.8, and the x3 grid points then reach both "no shift" and "linear shift");
- `scale` is "small" for models narrower than 512 (CPU models) and "gpt2" otherwise;
- the centres are the optimizer's registry spec (`merit_core.optim.registry.lr_centre`: measured
  ones for AdamW, LAMB and MERIT, MERIT's for its ablations, the others from their default lr).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from merit_core.compare.spec import CompareSpec
from merit_core.errors import ConfigError

AUTO_FACTORS = (1 / 3, 1.0, 3.0)
QUICK_FACTORS = (1.0,)
SMALL_WIDTH = 512
RUNS_DIR = "runs"
# Keys of a run's config.toml that do not change what the run computes; a finished run whose
# saved config differs from the planned one in any *other* key belongs to another comparison.
NON_IDENTITY_KEYS = frozenset(
    {
        "out",
        "resume",
        "device",
        "compile",
        "micro_batch_size",
        "log_every",
        "save_every",
        "keep_checkpoints",
        "eval_every",
        "parallel",
        "save_every_minutes",
        "resume_from",
        "allow_changes",
    }
)
MAIN_KEYS = ("model", "data", "seq_len", "steps", "optimizer", "batch_size", "lr")  # reported first when they differ


@dataclass(frozen=True)
class PlannedRun:
    """One training run of the comparison. `config` is resolved (steps, warmup, out are filled)."""

    optimizer: str
    batch_size: int
    lr: float
    grid: tuple[float, ...]
    config: Any  # merit_core.train.config.TrainConfig

    @property
    def name(self) -> str:
        return run_name(self.optimizer, self.batch_size, self.lr)

    @property
    def run_dir(self) -> Path:
        return Path(self.config.out)

    @property
    def steps(self) -> int:
        return int(self.config.steps)

    @property
    def tokens(self) -> int:
        return self.steps * self.batch_size * int(self.config.seq_len)


def run_name(optimizer: str, batch_size: int, lr: float) -> str:
    """'<optimizer>-b<batch>-lr<lr>', e.g. 'merit-b64-lr0.003'."""
    return f"{optimizer}-b{batch_size}-lr{lr:.3g}"


def round_lr(value: float) -> float:
    return float(f"{value:.3g}")


def model_width(model: str) -> int:
    """d_model of a named model or config.json (ConfigError for an unknown model)."""
    from merit_core.models import model_config

    config = model_config(model)
    return int(getattr(config, "n_embd", None) or config.hidden_size)


def auto_centre(optimizer: str, d_model: int) -> float:
    """The auto grid's centre at the comparison's smallest batch (see the module docstring)."""
    from merit_core.optim.registry import lr_centre

    return lr_centre(optimizer).at("small" if d_model < SMALL_WIDTH else "gpt2")


def auto_lr_grid(
    optimizer: str, batch_size: int, smallest_batch: int, d_model: int, quick: bool = False
) -> list[float]:
    """The auto grid (see the module docstring), ascending."""
    centre = auto_centre(optimizer, d_model) * math.sqrt(batch_size / smallest_batch)
    factors = QUICK_FACTORS if quick else AUTO_FACTORS
    return sorted({round_lr(centre * f) for f in factors})


def lr_grids(spec: CompareSpec) -> dict[tuple[str, int], list[float]]:
    """(optimizer, batch size) -> the learning rates to try, in the spec's order."""
    d_model = model_width(str(spec.train["model"]))
    smallest = min(spec.all_batch_sizes)
    grids = {}
    for name in spec.optimizers:
        for batch in spec.batch_sizes[name]:
            setting = spec.lrs[name]
            grids[name, batch] = (
                auto_lr_grid(name, batch, smallest, d_model, spec.quick)
                if setting == "auto"
                else sorted({round_lr(v) for v in setting})
            )
    return grids


def plan_runs(spec: CompareSpec) -> list[PlannedRun]:
    """Every run of the comparison with its resolved train config; ConfigError on bad settings."""
    from merit_core.models import context_length, model_config
    from merit_core.optim import default_hparams
    from merit_core.train.config import from_dict, resolve

    model = str(spec.train["model"])
    context = context_length(model_config(model))
    seq_len = int(spec.train.get("seq_len", 128))
    if seq_len <= 0:
        raise ConfigError(f"seq_len must be positive, got {seq_len}")
    if seq_len > context:
        raise ConfigError(f"seq_len {seq_len} is beyond the context of {model} ({context} tokens)")
    runs = []
    for (optimizer, batch), grid in lr_grids(spec).items():
        steps = max(1, math.ceil(spec.tokens / (batch * seq_len)))
        for lr in grid:
            values = {
                **spec.train,
                "optimizer": optimizer,
                "batch_size": batch,
                "lr": lr,
                "steps": steps,
                "optimizer_args": dict(spec.optimizer_args.get(optimizer, {})),
                "out": str(spec.out / RUNS_DIR / run_name(optimizer, batch, lr)),
            }
            values.setdefault("eval_every", max(1, steps // 8))
            values.setdefault("save_every", max(1, math.ceil(steps / 4)))
            values.setdefault("keep_checkpoints", 1)
            config = resolve(from_dict(values), 1, default_hparams(optimizer))
            runs.append(PlannedRun(optimizer, batch, lr, tuple(grid), config))
    return runs


def config_mismatch(saved: dict[str, Any], planned: Any) -> str | None:
    """The first key (other than NON_IDENTITY_KEYS) where a run's saved config.toml differs from
    the planned resolved config, as 'key: saved != planned'; None when they describe the same run."""
    wanted = _plain(dataclasses.asdict(planned))
    have = _plain(saved)
    keys = [k for k in MAIN_KEYS if k in wanted] + [k for k in wanted if k not in MAIN_KEYS]
    for key in keys:
        if key not in NON_IDENTITY_KEYS and have.get(key) != wanted[key]:
            return f"{key}: {have.get(key)!r} != {wanted[key]!r}"
    return None


def _plain(value: Any) -> Any:
    """Tuples -> lists, recursively; drop None values of mappings (TOML leaves them out)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if v is not None}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
