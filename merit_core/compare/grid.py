"""The runs of a comparison: the learning-rate grids, and one `merit train` config per run.

The auto grid for optimizer `o` at batch size `B` is `centre * AUTO_FACTORS` (x {1/3, 1, 3};
just the centre with --quick), rounded to three significant digits (run folders are named
after them). The centre:

- for an optimizer with measured lrs (AdamW, LAMB, MERIT and MERIT's ablations) it is
  `merit_core.optim.registry.default_lr(o, model, B, seq_len)`: the lr measured for that model
  at that batch and sequence length, or the nearest measured one scaled by the square root of
  the tokens-per-step ratio (the rule and how well the CPU grids bear it out are in the
  registry's docstring and benchmarks/README.md); so every batch's grid is centred on a value
  measured (or scaled) for that batch, not on one measured at another batch;
- otherwise `lr_centre(o)[scale] * sqrt(B / B_min)`, with `B_min` the smallest batch of the
  comparison and `scale` "small" for models narrower than 512 (CPU models), "gpt2" otherwise
  (the spec's unmeasured centre, from its default lr).

No optimum on a grid edge: when the best lr of an auto grid of several points is its smallest
or largest, the comparison adds the next point beyond that edge (x3 or x1/3, `edge_extension`)
and trains it, until the best is interior or `spec.max_extensions` points were added on that
side (`next_extensions`). Given lists (--lrs 1e-3,...) are never extended.

With `spec.seeds` > 1 every lr is trained with train seeds seed, seed + 1, ...; the first keeps
the plain run name, the others add '-s<seed>' (so a one-seed comparison's runs are reused).
After the grids, each best cell is topped up to `spec.best_seeds` seeds (`top_ups`: the same
names, more seeds), and with `spec.environment_check` its first `spec.environment_samples` seeds
are trained once more under each perturbation of the floating-point environment (`env_runs`:
'-env2t', '-envisa-avx2', ..., merit_core.compare.environment): the same computation in another
environment, whose largest difference from the original is the environment spread the verdicts
weigh against (merit_core.compare.verdicts).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from merit_core import models
from merit_core.compare.environment import Perturbation
from merit_core.compare.results import BestResult
from merit_core.compare.spec import CompareSpec
from merit_core.errors import ConfigError
from merit_core.models import context_length, model_config
from merit_core.optim.registry import default_lr, lr_centre, measured_lr
from merit_core.train.config import from_dict, resolve

AUTO_FACTORS = (1 / 3, 1.0, 3.0)
EXTENSION_FACTOR = 3.0
QUICK_FACTORS = (1.0,)
SMALL_WIDTH = 512
RUNS_DIR = "runs"
EVAL_POINTS = 8  # validation points per run: the max-attention-logit and loss curves over steps
QUICK_EVAL_POINTS = 4  # --quick: a smoke run's curves need fewer (each is a forward pass over the validation set)
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
        "verify",
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
    seed_index: int = 0  # 0 for the comparison's first seed
    # an environment re-run's change of the floating-point environment; None for every other run
    perturbation: Perturbation | None = None

    @property
    def threads(self) -> int | None:
        """An environment re-run's own intra-op thread count (None: the comparison's)."""
        return None if self.perturbation is None else self.perturbation.threads

    @property
    def env(self) -> dict[str, str]:
        """Environment variables of the run's process beside the comparison's (an ISA or BLAS re-run's)."""
        return {} if self.perturbation is None else self.perturbation.env()

    @property
    def seed(self) -> int:
        return int(self.config.seed)

    @property
    def name(self) -> str:
        return run_name(self.optimizer, self.batch_size, self.lr, self.seed if self.seed_index else None) + (
            "" if self.perturbation is None else self.perturbation.suffix
        )

    @property
    def run_dir(self) -> Path:
        return Path(self.config.out)

    @property
    def steps(self) -> int:
        return int(self.config.steps)

    @property
    def tokens(self) -> int:
        return self.steps * self.batch_size * int(self.config.seq_len)


def run_name(optimizer: str, batch_size: int, lr: float, seed: int | None = None) -> str:
    """'<optimizer>-b<batch>-lr<lr>', e.g. 'merit-b64-lr0.003'; '-s<seed>' added for a seed other than the first."""
    return f"{optimizer}-b{batch_size}-lr{lr:.3g}" + ("" if seed is None else f"-s{seed}")


def seed_list(spec: CompareSpec, n: int | None = None) -> list[int]:
    """The train seeds of a cell: the [train] seed (default 0) and the next n - 1 (n: spec.seeds)."""
    base = int(spec.train.get("seed", 0))
    return [base + k for k in range(spec.seeds if n is None else n)]


Cell = tuple[str, int, float]  # (optimizer, batch size, lr)


def next_top_ups(spec: CompareSpec, best: list[BestResult], top_ups: dict[Cell, int]) -> dict[Cell, int]:
    """`top_ups` with every finished best cell short of spec.best_seeds seeds added, or {} when
    none is (a best cell changed by the new seeds is topped up in the next round)."""
    grown = dict(top_ups)
    for entry in best:
        cell = (entry.optimizer, entry.batch_size, entry.lr)
        if entry.status == "finished" and len(entry.seeds or [0]) < spec.best_seeds and cell not in grown:
            grown[cell] = spec.best_seeds
    return grown if grown != top_ups else {}


def round_lr(value: float) -> float:
    return float(f"{value:.3g}")


def model_width(model: str) -> int:
    """d_model of a named model or config.json (ConfigError for an unknown or unreadable model)."""
    width = models.model_width(model)
    if width is None:
        model_config(model)  # raises the model's own error (unknown name, unreadable file)
        raise ConfigError(f"{model}: its config has neither n_embd nor hidden_size")
    return width


def auto_centre(optimizer: str, batch_size: int, smallest_batch: int, model: str, seq_len: int) -> float:
    """The auto grid's centre for `optimizer` at `batch_size` (see the module docstring)."""
    width = model_width(model)
    measured = measured_lr(optimizer, model, batch_size, seq_len, width)
    if measured is not None:
        return measured.lr
    centre = lr_centre(optimizer)
    if centre is None:  # measured lrs, but none that reaches this model
        return default_lr(optimizer, model, batch_size, seq_len, width).lr
    scale = "small" if width < SMALL_WIDTH else "gpt2"
    return centre[scale] * math.sqrt(batch_size / smallest_batch)


def auto_lr_grid(
    optimizer: str, batch_size: int, smallest_batch: int, model: str, seq_len: int, quick: bool = False
) -> list[float]:
    """The auto grid (see the module docstring), ascending."""
    centre = auto_centre(optimizer, batch_size, smallest_batch, model, seq_len)
    factors = QUICK_FACTORS if quick else AUTO_FACTORS
    return sorted({round_lr(centre * f) for f in factors})


def lr_grids(
    spec: CompareSpec, extra: dict[tuple[str, int], list[float]] | None = None
) -> dict[tuple[str, int], list[float]]:
    """(optimizer, batch size) -> the learning rates to try, in the spec's order, with `extra`
    (the edge extensions found so far, see `next_extensions`) merged in."""
    model, seq_len = str(spec.train["model"]), int(spec.train.get("seq_len", 128))
    model_width(model)  # an unknown model fails here, with the models to choose from
    smallest = min(spec.all_batch_sizes)
    grids = {}
    for name in spec.optimizers:
        for batch in spec.batch_sizes[name]:
            setting = spec.lrs[name]
            grid = (
                auto_lr_grid(name, batch, smallest, model, seq_len, spec.quick)
                if setting == "auto"
                else sorted({round_lr(float(v)) for v in setting})
            )
            grids[name, batch] = sorted(set(grid) | set((extra or {}).get((name, batch), ())))
    return grids


def edge_extension(lr: float, edge: str) -> float:
    """The next grid point beyond an edge: lr x3 past the 'high' edge, lr / 3 past the 'low' one."""
    return round_lr(lr * EXTENSION_FACTOR if edge == "high" else lr / EXTENSION_FACTOR)


def extension_counts(base: list[float], grid: list[float]) -> tuple[int, int]:
    """How many points of `grid` lie below and above the base grid (the extensions so far)."""
    return sum(lr < min(base) for lr in grid), sum(lr > max(base) for lr in grid)


def next_extensions(
    spec: CompareSpec, best: list[BestResult], extra: dict[tuple[str, int], list[float]]
) -> dict[tuple[str, int], list[float]]:
    """The extended `extra` after this round's best entries, or {} when no grid grows.

    An auto grid of several points grows by one point past the edge holding its best lr while
    fewer than spec.max_extensions points were added on that side (see the module docstring).
    """
    if spec.quick:
        return {}
    base = lr_grids(spec)
    grown = {key: list(lrs) for key, lrs in extra.items()}
    changed = False
    for entry in best:
        key = (entry.optimizer, entry.batch_size)
        edge = entry.lr_at_edge
        if spec.lrs.get(key[0]) != "auto" or edge is None or len(base[key]) < 2:
            continue
        low, high = extension_counts(base[key], entry.grid)
        if (low if edge == "low" else high) >= spec.max_extensions:
            continue
        grown.setdefault(key, []).append(edge_extension(entry.lr, edge))
        changed = True
    return grown if changed else {}


def annotate_extensions(spec: CompareSpec, best: list[BestResult]) -> None:
    """Add to each best entry `lr_extended` (the lrs added past its base grid's edges) and
    `edge_reason` when its best lr still sits on an edge: 'limit' (spec.max_extensions points
    were added on that side), 'given' (a given lr list, never extended) or 'quick'."""
    base = lr_grids(spec)
    for entry in best:
        key = (entry.optimizer, entry.batch_size)
        grid = base.get(key, entry.grid)
        entry.lr_extended = sorted(set(entry.grid) - set(grid))
        edge = entry.lr_at_edge
        if edge is None:
            entry.edge_reason = None
        elif spec.lrs.get(key[0]) != "auto":
            entry.edge_reason = "given"
        elif spec.quick:
            entry.edge_reason = "quick"
        else:
            entry.edge_reason = "limit"


def plan_runs(
    spec: CompareSpec,
    extra: dict[tuple[str, int], list[float]] | None = None,
    top_ups: dict[Cell, int] | None = None,
    env_runs: dict[Cell, list[tuple[int, Perturbation]]] | None = None,
) -> list[PlannedRun]:
    """Every run of the comparison with its resolved train config; ConfigError on bad settings.

    `top_ups`: cells trained with more seeds than spec.seeds; `env_runs`: cells whose seeds (by
    index) are trained again under the given perturbations (see the module docstring)."""
    model = str(spec.train["model"])
    context = context_length(model_config(model))
    seq_len = int(spec.train.get("seq_len", 128))
    if seq_len <= 0:
        raise ConfigError(f"seq_len must be positive, got {seq_len}")
    if seq_len > context:
        raise ConfigError(f"seq_len {seq_len} is beyond the context of {model} ({context} tokens)")
    runs = []
    for (optimizer, batch), grid in lr_grids(spec, extra).items():
        steps = max(1, math.ceil(spec.tokens / (batch * seq_len)))
        for lr in grid:
            cell = (optimizer, batch, lr)
            n_seeds = max(spec.seeds, (top_ups or {}).get(cell, 0))
            seeds = seed_list(spec, n_seeds)
            plans: list[tuple[int, int, Perturbation | None]] = [
                (index, seed, None) for index, seed in enumerate(seeds)
            ]
            for index, change in (env_runs or {}).get(cell, []):
                plans.append((index, seed_list(spec, index + 1)[index], change))
            for index, seed, perturbation in plans:
                name = run_name(optimizer, batch, lr, seed if index else None)
                if perturbation is not None:
                    name += perturbation.suffix
                values = {
                    **spec.train,
                    "optimizer": optimizer,
                    "batch_size": batch,
                    "lr": lr,
                    "steps": steps,
                    "seed": seed,
                    "optimizer_args": dict(spec.optimizer_args.get(optimizer, {})),
                    "out": str(spec.out / RUNS_DIR / name),
                }
                values.setdefault("eval_every", max(1, steps // (QUICK_EVAL_POINTS if spec.quick else EVAL_POINTS)))
                values.setdefault("save_every", max(1, math.ceil(steps / 4)))
                values.setdefault("keep_checkpoints", 1)
                config = resolve(from_dict(values)).config
                runs.append(PlannedRun(optimizer, batch, lr, tuple(grid), config, index, perturbation))
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
