"""The instability precursors as the rules read them, and the one place the probe's numbers are
reduced over heads and over layers.

The probe (merit_core.models.attention_probe) measures per layer and head: the max attention logit
and the attention entropy (mean and min over positions, plain and normalised); per layer the
residual stream's activations; once the output layer's log Z; a run adds the update / weight ratio.
`ProbeResult.precursors()` turns one pass into one `Precursors` record, per head and per layer,
which `merit inspect`'s layers, heads, summary, JSON and verdict all read. Every reader takes one
number per layer and one over the layers from here: a run's eval and watch records, `merit
inspect`'s layers and summary, compare's summary, eval's trajectories over steps, the verdict and
the CLI's log lines. Each precursor has one alarming end (`WORST`): the largest max
logit, activation ratio and weight norm; the smallest entropy.

Pure Python (no torch): the verdict and compare use it on records read back from JSON.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Final, TypeGuard

from merit_core.metric_names import (
    ACTIVATION_RATIO,
    ATTENTION_ENTROPY_MEAN,
    ATTENTION_ENTROPY_MIN,
    LOG_Z_MEAN,
    MAX_ATTENTION_LOGIT,
    NORMALIZED_ENTROPY_MEAN,
    NORMALIZED_ENTROPY_MIN,
    UPDATE_RATIO,
    WATCH_ACTIVATION,
    WATCH_ENTROPY,
    WATCH_LOG_Z,
    WATCH_LOGIT,
    WATCH_UPDATE,
)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


# Per precursor measured per head: how a layer's heads become the layer's number (an entropy's mean
# is the mean of the heads' means, its min their min).
OVER_HEADS: Final[Mapping[str, Callable[[Sequence[float]], float]]] = MappingProxyType(
    {
        MAX_ATTENTION_LOGIT: max,
        ATTENTION_ENTROPY_MEAN: _mean,
        ATTENTION_ENTROPY_MIN: min,
        NORMALIZED_ENTROPY_MEAN: _mean,
        NORMALIZED_ENTROPY_MIN: min,
    }
)
# Per precursor measured per layer: which end over the layers is the alarming one (the weight
# norms of inspect's summary are read the same way as the logit they bound).
WORST: Final[Mapping[str, Callable[..., Any]]] = MappingProxyType(
    {
        MAX_ATTENTION_LOGIT: max,
        NORMALIZED_ENTROPY_MIN: min,
        ACTIVATION_RATIO: max,
        "q_max_norm": max,
        "k_max_norm": max,
        "bound": max,
    }
)
# A run's per-layer precursors (eval records, in this order) and their keys in a watch record.
WATCH_KEYS: Final[Mapping[str, str]] = MappingProxyType(
    {
        MAX_ATTENTION_LOGIT: WATCH_LOGIT,
        NORMALIZED_ENTROPY_MIN: WATCH_ENTROPY,
        ACTIVATION_RATIO: WATCH_ACTIVATION,
        LOG_Z_MEAN: WATCH_LOG_Z,
        UPDATE_RATIO: WATCH_UPDATE,
    }
)


def is_number(x: Any) -> TypeGuard[float]:
    """A number (NaN and infinities included); None and bools are not."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def over_heads(name: str, heads: Sequence[float]) -> float:
    """One layer's `name` from its heads' values (OVER_HEADS)."""
    return OVER_HEADS[name](heads)


def peak(name: str, per_layer: Any, nan_worst: bool = False) -> tuple[Any, int] | None:
    """(value, layer) of the alarming end over the layers of a per-layer list (WORST[name]); None
    and non-numbers are skipped, and so are NaNs unless `nan_worst`, where the first NaN is the peak
    (a value that is not a number is the worst news). On a tie the last layer (max) or the first
    (min) is named. None when no layer has a value."""
    values = per_layer if isinstance(per_layer, (list, tuple)) else []
    present = [(v, i) for i, v in enumerate(values) if is_number(v)]
    nans = [(v, i) for v, i in present if math.isnan(v)]
    if nans and nan_worst:
        return nans[0]
    present = [(v, i) for v, i in present if not math.isnan(v)]
    return WORST[name](present) if present else None


def over_layers(name: str, value: Any) -> float | None:
    """A record's `name` as one number: the peak over the layers of a per-layer list (NaNs skipped),
    a single number (log Z, the update ratio) as it is; None when there is none."""
    if is_number(value):
        return float(value)
    top = peak(name, value) if name in WORST else None
    return float(top[0]) if top else None


def eval_record(p: Precursors) -> dict[str, Any]:
    """What a run's eval record holds of a probe pass (merit_core.metrics.MetricsRecord): per layer
    the max attention logit and, when measured, the smallest normalised entropy and the residual
    stream's max/median |h| ratio, and the output layer's mean log Z."""
    record: dict[str, Any] = {MAX_ATTENTION_LOGIT: list(p.max_logit)}
    if p.entropy:
        record[NORMALIZED_ENTROPY_MIN] = list(p.entropy_min)
    if p.activations:
        record[ACTIVATION_RATIO] = list(p.activation_ratio)
    if p.log_z_mean is not None:
        record[LOG_Z_MEAN] = p.log_z_mean
    return record


def watch_record(eval_record: Mapping[str, Any], update_ratio: float | None) -> dict[str, Any]:
    """A run's per-layer precursors (`eval_record`) under the watch record's keys, with
    the update / weight ratio where there is one."""
    record = {WATCH_KEYS[k]: v for k, v in eval_record.items() if k in WATCH_KEYS}
    if update_ratio is not None:
        record[WATCH_UPDATE] = update_ratio
    return record


@dataclass
class ActivationStats:
    """The residual stream after one layer: max |h| over all entries of all (unpadded) tokens,
    the median |h| (torch.median: the lower median), and where the max sits."""

    max_abs: float
    median_abs: float
    batch_index: int
    position: int
    dim: int

    @property
    def ratio(self) -> float:
        return self.max_abs / self.median_abs if self.median_abs > 0 else math.inf


@dataclass
class OutputLogitStats:
    """The output layer's logits over (unpadded) positions: max |logit| and log Z = logsumexp over
    the vocabulary, its mean, std (population) and max."""

    max_abs_logit: float
    log_z_mean: float
    log_z_std: float
    log_z_max: float


@dataclass(frozen=True)
class Precursors:
    """What one checkpoint (or watch record) measured, as the instability rules read it: per layer
    where the probe gives layers, reduced over heads (`over_heads`). A record made from a probe pass
    (`ProbeResult.precursors`) also holds the numbers per head, every entropy statistic, the
    activations and the output logits, which inspect's layers, heads and JSON read (`of_layer`,
    `of_head`); one read back from a run's records has the per-layer lists only."""

    step: int | None = None
    max_logit: Sequence[float | None] = ()  # per layer, max over heads
    max_logit_head: Sequence[int | None] = ()  # the head holding it, per layer (optional)
    entropy_min: Sequence[float | None] = ()  # per layer, min normalised entropy over heads and positions
    activation_ratio: Sequence[float | None] = ()  # per layer, max |h| / median |h|
    log_z_mean: float | None = None
    update_ratio: float | None = None  # the largest over weights
    update_weight: str | None = None  # the weight holding it
    logit_bound: Sequence[float | None] = ()  # per layer, the tightest valid upper bound on the logit
    bound_kind: Sequence[str | None] = ()  # per layer, which bound that is ('spectral' / 'max-norm')
    heads_max_logit: Sequence[Sequence[float]] = ()  # per layer and head
    entropy: Mapping[str, Sequence[float]] = field(default_factory=dict)  # per entropy statistic, per layer
    heads_entropy: Mapping[str, Sequence[Sequence[float]]] = field(default_factory=dict)  # ... per layer and head
    activations: Sequence[ActivationStats] = ()  # per layer
    output: OutputLogitStats | None = None

    def of_layer(self, name: str, layer: int) -> Any:
        """One layer's `name` (the max logit, an entropy statistic or an `ActivationStats`
        attribute), None when this record did not measure it."""
        if name == MAX_ATTENTION_LOGIT:
            return self.max_logit[layer] if layer < len(self.max_logit) else None
        if name in OVER_HEADS:  # an entropy statistic
            per_layer = self.entropy.get(name)
            return per_layer[layer] if per_layer is not None else None
        return getattr(self.activations[layer], name) if layer < len(self.activations) else None

    def of_head(self, name: str, layer: int, head: int) -> float | None:
        """One head's max logit or entropy statistic, None when this record did not measure it."""
        if name == MAX_ATTENTION_LOGIT:
            return self.heads_max_logit[layer][head] if layer < len(self.heads_max_logit) else None
        per_layer = self.heads_entropy.get(name)
        return per_layer[layer][head] if per_layer is not None else None


class Measured:
    """An attribute of a layer or head record that the probe measured: read from the checkpoint's
    one precursors record (the record's `probe`, merit_core.precursors.Precursors), None where no
    probe ran. `name` is the record's name for it (a metric name or an ActivationStats attribute)."""

    def __init__(self, name: str):
        self.name = name

    def __get__(self, record: Any, owner: Any = None) -> Any:
        return self if record is None else record.measured(self.name)


class ProbedAttention:
    """What the probe measured of a layer's or a head's attention, as attributes of inspect's layer
    and head records (merit_core.diagnostics.weights), read from the precursors record through
    `measured`, which each of those records defines."""

    max_attention_logit = Measured(MAX_ATTENTION_LOGIT)
    attention_entropy_mean = Measured(ATTENTION_ENTROPY_MEAN)
    attention_entropy_min = Measured(ATTENTION_ENTROPY_MIN)
    normalized_attention_entropy_mean = Measured(NORMALIZED_ENTROPY_MEAN)
    normalized_attention_entropy_min = Measured(NORMALIZED_ENTROPY_MIN)

    def measured(self, name: str) -> Any:
        raise NotImplementedError
