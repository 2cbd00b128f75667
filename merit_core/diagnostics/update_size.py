"""How far the next optimizer step would move each 2-D weight, relative to the weight.

The update is defined as the step the run's optimizer takes from a checkpoint with no new
gradient: the optimizer (built from the registry with the run's name and hyperparameters, its
state loaded from the checkpoint) steps once on a copy of the weights with every gradient zero,
at the learning rate the run's schedule gives the next update. Its moment update then runs with
g = 0 (first moment times beta1, second times beta2, step counter + 1), and the update is
computed from those moments and the saved weights by the optimizer's own step code, trust
ratios, clipping and weight decay included. The reported number per weight is
RMS(w_before - w_after) / RMS(w_before), computed in float64 (weights and moments converted, so the
difference of two nearby weights loses no digits) when weights, moments and a copy of the weights
fit in half the free host memory, else in float32 (about 1e-4 relative); the report says which.

For MERIT (and its ablations), the element-wise ratio s_ij of that same step is recomputed with
MERIT's reference step code (`merit_core.optim.merit.reference`: `direction`, `trust_ratios`) from
the optimizer's moments after the step: its distribution (percentiles), which ratio is the largest
for each element (row, column or weight-wise; a zero row / column norm forces s = 1), and the
fraction of elements whose scaled update |s_ij u_ij| the clip cuts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from merit_core.checkpoint import runs
from merit_core.checkpoint.run_config import read_optimizer_settings
from merit_core.checkpoint.tensors import check_optimizer_state, check_trainer_state, load_trainer_state
from merit_core.devices import available_host_memory
from merit_core.diagnostics.weights import record_fields
from merit_core.errors import CheckpointError, MeritError, first_line
from merit_core.file_reading import display
from merit_core.metric_names import UPDATE_RATIO
from merit_core.optim import build_optimizer
from merit_core.optim.merit import MERIT
from merit_core.optim.merit.common import Hyper
from merit_core.optim.merit.reference import direction, trust_ratios
from merit_core.schedule import lr_at

PERCENTILES = (0, 1, 10, 50, 90, 99, 100)


@dataclass
class MeritRatios:
    """MERIT's element-wise ratio s of one weight for the step measured."""

    percentiles: dict[int, float]  # percentile -> s
    share_row: float  # elements where the row ratio is the largest (ties: row, then column, then weight-wise)
    share_col: float
    share_weight: float
    share_forced_one: float  # a zero row / column norm: s = 1
    clipped: float  # fraction of elements with |s u| > clip (0 without a clip)

    def to_dict(self) -> dict[str, Any]:
        return {
            "s_percentiles": {str(k): v for k, v in self.percentiles.items()},
            **record_fields(self, "share_row", "share_col", "share_weight", "share_forced_one", "clipped"),
        }


@dataclass
class UpdateSize:
    """One 2-D weight: RMS of the next update, RMS of the weight, their ratio (and MERIT's ratios)."""

    name: str
    shape: list[int]
    update_rms: float
    weight_rms: float
    merit: MeritRatios | None = None

    @property
    def ratio(self) -> float:
        return self.update_rms / self.weight_rms if self.weight_rms > 0 else math.inf

    def to_dict(self) -> dict[str, Any]:
        out = {
            "name": self.name,
            "shape": list(self.shape),
            "update_rms": self.update_rms,
            "weight_rms": self.weight_rms,
            UPDATE_RATIO: self.ratio,
        }
        if self.merit is not None:
            out["merit"] = self.merit.to_dict()
        return out


@dataclass
class UpdateReport:
    """Update sizes of every 2-D weight, in parameter order, and the lr they were measured at."""

    step: int | None
    lr: float | None
    optimizer: str
    weights: list[UpdateSize] = field(default_factory=list)
    dtype: str = ""  # the precision the step was taken in

    @property
    def max_ratio(self) -> float | None:
        return max((w.ratio for w in self.weights), default=None)

    def to_dict(self) -> dict[str, Any]:
        return {
            **record_fields(self, "step", "lr", "optimizer", "dtype"),
            f"max_{UPDATE_RATIO}": self.max_ratio,
            "weights": [w.to_dict() for w in self.weights],
        }


def _rms(x: torch.Tensor) -> float:
    return float(x.double().pow(2).mean().sqrt())


def _percentiles(x: torch.Tensor) -> dict[int, float]:
    flat = x.detach().double().flatten().sort().values
    n = flat.numel()
    return {p: float(flat[min(n - 1, round(p / 100 * (n - 1)))]) for p in PERCENTILES}


def merit_ratios(w: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> MeritRatios:
    """MERIT's ratios of weight `w` (before the step) from its optimizer `state` after the step."""

    h = Hyper.of_group(group)
    m, v = state["exp_avg"], state["exp_avg_sq"]
    w = w.to(m.dtype)
    u = direction(w, m, v, state["step"], h)
    r = trust_ratios(w, u, h)
    s = r.s.expand(w.shape)
    n = w.numel()
    shares: tuple[float, float, float, float]
    if r.row is None or r.col is None or r.forced_one is None:  # one weight-wise ratio for the whole tensor
        shares = (0.0, 0.0, 1.0, 0.0)
    else:
        row, col = r.row.expand_as(w), r.col.expand_as(w)
        weight = r.weight if h.weight_bound else torch.tensor(-math.inf, dtype=w.dtype)
        forced = r.forced_one.expand_as(w)
        row_wins = ~forced & (row >= col) & (row >= weight)
        col_wins = ~forced & ~row_wins & (col >= weight)
        weight_wins = ~forced & ~row_wins & ~col_wins
        row_share, col_share, weight_share, forced_share = (
            float(x.sum()) / n for x in (row_wins, col_wins, weight_wins, forced)
        )
        shares = (row_share, col_share, weight_share, forced_share)
    clipped = float(((s * u).abs() > h.clip).sum()) / n if h.clip is not None else 0.0
    return MeritRatios(_percentiles(s), *shares, clipped)


def _is_merit(optimizer: torch.optim.Optimizer) -> bool:

    return isinstance(optimizer, MERIT)


@torch.no_grad()
def update_sizes(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int | None = None,
    name: str = "",
) -> UpdateReport:
    """Step `optimizer` once with every gradient zero and measure what moved, per 2-D weight.

    Changes the model's weights and the optimizer's state: call it on a throwaway copy (as
    `checkpoint_update_sizes` does). The param groups' lr must already be the one to measure at.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    before = {id(p): p.detach().clone() for p in params}
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}
    merit = _is_merit(optimizer)
    report = UpdateReport(step, float(optimizer.param_groups[0]["lr"]), name or type(optimizer).__name__)
    report.dtype = str(params[0].dtype).removeprefix("torch.") if params else ""
    seen = set()
    for pname, p in model.named_parameters():
        if p.ndim != 2 or id(p) in seen or id(p) not in before:
            continue
        seen.add(id(p))
        w = before[id(p)]
        size = UpdateSize(pname, list(p.shape), _rms(w - p.detach()), _rms(w))
        if merit and optimizer.state.get(p):
            size.merit = merit_ratios(w, optimizer.state[p], group_of[id(p)])
        report.weights.append(size)
    for p in params:
        p.grad = None
    return report


def _step_dtype(model: torch.nn.Module) -> torch.dtype:
    """float64 when weights, two moments and a copy of the weights (4 x 8 bytes a parameter) fit in
    half the free host memory, on the CPU; else float32."""

    n = sum(p.numel() for p in model.parameters())
    free = available_host_memory()
    on_cpu = all(p.device.type == "cpu" for p in model.parameters())
    return torch.float64 if on_cpu and free is not None and 32 * n < free / 2 else torch.float32


def checkpoint_update_sizes(checkpoint, model: torch.nn.Module) -> UpdateReport | None:
    """Update sizes from a `merit train` checkpoint folder with trainer_state.pt, None without one
    (a CheckpointError for optimizer state it cannot use: sharded, or not the run's optimizer's).

    `model` holds the checkpoint's weights (it is changed). The optimizer is built as the run
    built it (its config.toml: name, lr, weight decay, optimizer arguments), its state loaded, and
    the lr set to the schedule's value for the next update.
    """

    folder = checkpoint.folder
    run = checkpoint.run or folder.parent
    if not (folder / runs.STATE_PT).is_file():
        return None
    c = read_optimizer_settings(run)
    if c is None:
        return None
    state = load_trainer_state(folder)
    where = folder / runs.STATE_PT
    try:
        step = check_trainer_state(state, where)
    except CheckpointError as exc:  # said as what inspect does not measure, not as a resume refusal
        raise CheckpointError(str(exc).removesuffix("; this checkpoint cannot be resumed")) from None
    optimizer_state = state["optimizer"]
    if "param_groups" not in optimizer_state:
        raise CheckpointError(
            f"{display(folder)} keeps its optimizer state in shards (fsdp), which inspect does not read"
        )
    model = model.to(_step_dtype(model)).train()  # the moments load in the weights' dtype
    optimizer = build_optimizer(c.optimizer, model, lr=c.lr, weight_decay=c.weight_decay, **c.optimizer_args)
    scales = [group["lr"] / c.lr for group in optimizer.param_groups]
    check_optimizer_state(optimizer, optimizer_state, where)
    try:
        optimizer.load_state_dict(optimizer_state)
        lr = lr_at(step, **c.lr_kwargs())
        for group, scale in zip(optimizer.param_groups, scales):
            group["lr"] = lr * scale
        return update_sizes(model, optimizer, step, c.optimizer)
    except MeritError:
        raise
    except Exception as exc:  # noqa: BLE001 - a state that passed the checks and still fails the step: one line
        raise CheckpointError(
            f"{display(where)}: the optimizer state does not step ({first_line(exc)[:120]})"
        ) from None
