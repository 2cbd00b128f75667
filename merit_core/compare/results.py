"""Typed results of a comparison: what `run_compare` hands back, one dataclass per summary.json part.

Each record is a plain dataclass, built as such by the code that measures it (merit_core.compare.
summary builds runs, cells, best entries, curves and environment checks; measures fills in the
Hessian and zero-shot numbers), and `to_dict()` is the standard serializer, `dataclasses.asdict`:
summary.json holds every field of every record (the keys scripts read stay stable: additions are
fine, renames are not). `from_dict` is the reader of a summary.json, of this version or an earlier
one: a field the file does not hold keeps its default, a key no field names (written by a newer
version) is dropped, and `from_dict(d).to_dict()` gives `d` again for a summary.json this version
wrote.

A best entry is its winning cell with the grid it came from, and a cell is its first seed's run
with the means over its seeds: `BestResult` extends `CellResult`, which extends `RunResult`, so a
reader of cells reads best entries too (`extend` makes the larger record from the smaller one).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

R = TypeVar("R", bound="_Record")


@dataclass
class _Record:
    """A summary.json record: `to_dict` (dataclasses.asdict) and `from_dict` (the fields it names)."""

    # fields holding a record of their own, or a list of them
    _NESTED: ClassVar[dict[str, type[_Record]]] = {}

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls: type[R], data: dict[str, Any]) -> R:
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        known = {k: v for k, v in data.items() if k in names}
        for name, record in cls._NESTED.items():
            value = known.get(name)
            if isinstance(value, dict):
                known[name] = record.from_dict(value)
            elif isinstance(value, list):
                known[name] = [record.from_dict(v) if isinstance(v, dict) else v for v in value]
        return cls(**known)

    @classmethod
    def extend(cls: type[R], base: _Record, **more: Any) -> R:
        """A record of this class holding every field of `base` (a record of a class it extends),
        those `more` names set to its values instead; the rest at their defaults."""
        kept = {f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.init}
        return cls(**{**kept, **more})

    def value(self, key: str) -> Any:
        """The field `key` (None when the record has none): for readers whose key is a parameter
        (`<key>_std`, `<key>_values`); a reader of a named field reads the attribute."""
        return getattr(self, key, None)


class _Series:
    """A trajectory's values per step, read by the plots."""

    def series(self, key: str) -> list[float | None]:
        """The values of `key` (val_loss or max_attention_logit) at each step."""
        return list(getattr(self, key))


@dataclass
class Curve(_Record, _Series):
    """A run's validation trajectory for the plots: each eval's step, validation loss and max
    attention logit (max over layers), in step order."""

    step: list[int] = field(default_factory=list)
    val_loss: list[float | None] = field(default_factory=list)
    max_attention_logit: list[float | None] = field(default_factory=list)


@dataclass
class SeedCurve(_Record, _Series):
    """One seed's `Curve` of a best cell (summary.json `best[].seed_curves[]`)."""

    seed: int = 0
    step: list[int] = field(default_factory=list)
    val_loss: list[float | None] = field(default_factory=list)
    max_attention_logit: list[float | None] = field(default_factory=list)


@dataclass
class EnvironmentSample(_Record):
    """One environment re-run of a best cell's seed (summary.json `best[].environment.samples[]`):
    its perturbation, state, and per key the original seed's value, the re-run's and |difference|
    (None when either is missing or not finite)."""

    run: str = ""
    seed: int = 0
    perturbation: str | None = None
    threads: int | None = None
    cpu_capability: str | None = None
    status: str = ""
    final_val_loss_original: float | None = None
    final_val_loss_rerun: float | None = None
    final_val_loss_difference: float | None = None
    max_attention_logit_original: float | None = None
    max_attention_logit_rerun: float | None = None
    max_attention_logit_difference: float | None = None


@dataclass
class EnvironmentCheck(_Record):
    """A best cell's environment spread (summary.json `best[].environment`, see
    summary.environment_check): per key the largest |difference| of its seeds re-trained in a
    perturbed environment, floored (`<key>_spread`, None when no re-run finished), with both values
    of the sample that moved it most (`<key>_original`, `<key>_rerun`); `hessian`: the
    Hessian environment spread (--hessian; measures.hessian_environment); `samples`: each re-run
    with both values and |difference| per key; `<key>_floor`: the floor of the spread (environment.FLOORS)."""

    run: str = ""
    seed: int = 0
    threads: int | None = None
    status: str = ""
    final_val_loss_original: float | None = None
    final_val_loss_rerun: float | None = None
    final_val_loss_spread: float | None = None
    max_attention_logit_original: float | None = None
    max_attention_logit_rerun: float | None = None
    max_attention_logit_spread: float | None = None
    hessian: dict[str, Any] | None = None
    final_val_loss_floor: float | None = None
    max_attention_logit_floor: float | None = None
    samples: list[EnvironmentSample] = field(default_factory=list)

    _NESTED: ClassVar[dict[str, type[_Record]]] = {"samples": EnvironmentSample}


@dataclass
class RunResult(_Record):
    """One training run: its settings, state and final numbers (summary.json `runs[]`)."""

    name: str
    optimizer: str
    batch_size: int
    lr: float
    status: str  # 'finished' | 'unstable' | 'diverged' | 'missing' (see merit_core.compare.summary)
    final_val_loss: float | None = None
    max_attention_logit: float | None = None
    max_attention_logit_by_layer: list[float | None] | None = None
    seed: int = 0
    tokens: int = 0
    steps: int = 0
    run_dir: str = ""
    message: str | None = None
    threads: int | None = None  # set on an environment re-run only
    seq_len: int | None = None
    final_train_loss: float | None = None
    tokens_per_s: float | None = None
    qk_bound_by_layer: list[float] | None = None
    instability: dict[str, float | None] | None = None  # see merit_core.compare.precursor_table
    last_step: int = 0
    perturbation: str | None = None  # an environment re-run's change of environment (environment.py)
    cpu_capability: str | None = None  # the ISA torch dispatched to (the host's, or the one forced)

    @property
    def valued(self) -> bool:
        """Finished or unstable: it has its final numbers (an unstable one is shown, never a best)."""
        return self.status in ("finished", "unstable") and self.final_val_loss is not None

    @property
    def finished(self) -> bool:
        """Finished with a final validation loss (a diverged run or cell has none)."""
        return self.status == "finished" and self.final_val_loss is not None


@dataclass
class CellResult(RunResult):
    """One (optimizer, batch size, lr) over its seeds (summary.json `cells[]`): its first seed's run
    with the mean of each number, `<key>_std` (sample standard deviation, None for one seed) and
    `<key>_values` (each seed's, in seed order) beside it."""

    final_val_loss_std: float | None = None
    final_val_loss_values: list[float | None] | None = None
    max_attention_logit_std: float | None = None
    max_attention_logit_values: list[float | None] | None = None
    final_train_loss_std: float | None = None
    final_train_loss_values: list[float | None] | None = None
    tokens_per_s_std: float | None = None
    tokens_per_s_values: list[float | None] | None = None
    seeds: list[int] = field(default_factory=list)
    run_names: list[str] = field(default_factory=list)


@dataclass
class BestResult(CellResult):
    """The best lr of one (optimizer, batch size), as the mean over its seeds (summary.json `best[]`).

    `grid`: the lrs tried; `n_diverged`: its diverged runs; `lr_at_edge`: 'low' / 'high' when the
    best lr is the smallest / largest of a grid of several; `lr_extended` and `edge_reason`: see
    grid.annotate_extensions; `hessian` and `zero_shot` are set with --hessian / --eval (see
    merit_core.compare.measures); `environment`: the environment re-run of the first seed;
    `curve` and `seed_curves`: the validation trajectory (step, val loss, max logit) for the plots."""

    grid: list[float] = field(default_factory=list)
    n_diverged: int = 0
    n_unstable: int = 0
    lr_at_edge: str | None = None
    lr_extended: list[float] = field(default_factory=list)
    edge_reason: str | None = None
    hessian: dict[str, Any] | None = None
    zero_shot: list[dict[str, Any]] | None = None
    environment: EnvironmentCheck | None = None
    curve: Curve | None = None
    seed_curves: list[SeedCurve] | None = None

    _NESTED: ClassVar[dict[str, type[_Record]]] = {
        "environment": EnvironmentCheck,
        "curve": Curve,
        "seed_curves": SeedCurve,
    }


@dataclass
class CompareSettings(_Record):
    """summary.json `settings`: how the comparison was set up (see compare._settings); the report's
    Setup and Caveats read it. `environment`: the floating-point environment of the runs (train.
    hardware.float_environment) and the environment check's thread count."""

    model: str = ""
    n_params: int | None = None
    optimizers: list[str] = field(default_factory=list)
    batch_sizes: list[int] = field(default_factory=list)
    seq_len: int | None = None
    tokens: int | None = None
    tokens_per_run: int = 0
    steps: dict[str, int] = field(default_factory=dict)  # batch size (as text) -> optimizer steps
    data: str = ""
    lr_rule: str = ""
    lr_grids: list[dict[str, Any]] = field(default_factory=list)
    lr_grids_extended: list[dict[str, Any]] = field(default_factory=list)
    max_extensions: int = 0
    warmup_steps: dict[str, int] = field(default_factory=dict)
    min_lr_ratio: float = 0.0
    grad_clip: float = 0.0
    seed: int = 0
    seeds: list[int] = field(default_factory=list)
    best_seeds: int | None = None
    hessian: bool = False
    eval: dict[str, Any] | None = None  # tasks, include_path, limit
    preset: str | None = None
    paper: dict[str, Any] | None = None  # measures.PAPER
    command: str | None = None
    dtype: str | None = None
    eval_tokens: int = 0
    out: str | None = None
    quick: bool = False
    environment: dict[str, Any] | None = None
    provenance: dict[str, Any] | None = None  # see merit_core.compare.provenance


@dataclass
class Measured:
    """A record of numbers over seeds that is not a run: a Hessian cell or a zero-shot row as
    merit_core.compare.measures writes them, or a loss change between two batch sizes (verdicts):
    `values` holds `<key>`, `<key>_std` and `<key>_values`; `environment` its environment spreads
    (`<key>_spread`, another Measured), None when not measured."""

    values: dict[str, Any]
    environment: Measured | None = None

    def value(self, key: str) -> Any:
        return self.environment if key == "environment" else self.values.get(key)


@dataclass
class CompareSummary:
    """summary.json: the settings, every run, every (optimizer, batch, lr) cell and the best cells;
    `to_dict()` (dataclasses.asdict) is the file's content, `from_dict` reads one back."""

    settings: CompareSettings = field(default_factory=CompareSettings)
    runs: list[RunResult] = field(default_factory=list)
    cells: list[CellResult] = field(default_factory=list)
    best: list[BestResult] = field(default_factory=list)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CompareSummary:
        return cls(
            settings=CompareSettings.from_dict(data["settings"]),
            runs=[RunResult.from_dict(r) for r in data["runs"]],
            cells=[CellResult.from_dict(c) for c in data.get("cells", [])],
            best=[BestResult.from_dict(b) for b in data["best"]],
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def best_for(self, optimizer: str, batch_size: int) -> BestResult | None:
        return next((b for b in self.best if (b.optimizer, b.batch_size) == (optimizer, batch_size)), None)

    def best_table(self) -> dict[tuple[str, int], BestResult]:
        """(optimizer, batch size) -> its best entry."""
        return {(b.optimizer, b.batch_size): b for b in self.best}

    def grid_cells(self) -> list[CellResult]:
        """Every (optimizer, batch, lr) tried: the cells, or a summary without cells' runs (one seed each)."""
        return list(self.cells) or [CellResult.extend(r) for r in self.runs]
