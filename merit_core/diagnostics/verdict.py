"""A health verdict on the precursors `merit inspect` measures: "healthy", "watch" or "alarming" per
signal, with the reason in words, for one checkpoint and for a run's trajectory of checkpoints.

Pure Python (no torch): the same rules judge inspect's reports and, in
results/watch-cpu/verdict_calibration.py, the watch records of the CPU grid they were calibrated
on. The rules and the grid's counts behind each threshold are in docs/DIAGNOSTICS.md.

Two kinds of rule:

- **level rules** judge one checkpoint by itself, against a scale the signal has whatever the
  model: the max attention logit against float32 softmax saturation (LOGIT_LIMIT), the min
  normalised attention entropy (0 is one-hot, 1 uniform), the update / weight ratio (a fraction
  of the weight moved by one step), and the logit bound against LOGIT_LIMIT;
- **history rules** judge a checkpoint of a run against the run's earlier checkpoints: the growth
  rate of the max logit since the previous checkpoint, the drift of the output log Z and the
  growth of the activation ratio since the run's first checkpoint. Their scales differ by model
  (log Z starts at log(vocabulary), activation ratios of large pretrained models are 10^3-10^4), so
  only the change is judged. A checkpoint without history gets the level rules only, and the
  verdict says so.

A run's verdict is, per signal, the worst level any of its checkpoints reached (the first step it
did), with that checkpoint's reason.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeGuard

# Float32 softmax saturation: exp(-88) = 6e-39 is below float32's smallest normal number, so a row
# whose largest logit leads the others by 88 is one-hot in float32 arithmetic. Why this is the
# threshold of a saturated, unstable run: merit_core/compare/stability.py, which uses it too.
LOGIT_LIMIT = 88.0

HEALTHY, WATCH, ALARMING = "healthy", "watch", "alarming"
LEVELS = (HEALTHY, WATCH, ALARMING)  # in order of severity

LEVEL_RULE, HISTORY_RULE = "level", "history"
# signal names, in the order a verdict lists them
MAX_LOGIT = "max_logit"
LOGIT_GROWTH = "max_logit_growth"
ENTROPY = "entropy_collapse"
LOG_Z = "log_z_drift"
ACTIVATION = "activation_growth"
UPDATE = "update_ratio"
BOUND = "logit_bound"
SIGNALS = (MAX_LOGIT, LOGIT_GROWTH, ENTROPY, LOG_Z, ACTIVATION, UPDATE, BOUND)
RULE_OF = {
    MAX_LOGIT: LEVEL_RULE,
    LOGIT_GROWTH: HISTORY_RULE,
    ENTROPY: LEVEL_RULE,
    LOG_Z: HISTORY_RULE,
    ACTIVATION: HISTORY_RULE,
    UPDATE: LEVEL_RULE,
    BOUND: LEVEL_RULE,
}

NO_HISTORY_NOTE = (
    "one checkpoint without history: level rules only (max logit, entropy, update ratio, logit bound); "
    "the growth and drift rules need a run folder with several checkpoints"
)
NOTHING_NOTE = "nothing to judge: no probe statistics (max logit, entropy, log Z, bounds) and no update ratio"
FIRST_NOTE = "the run's first inspected checkpoint: the reference of the growth and drift rules, not judged by them"


@dataclass(frozen=True)
class Thresholds:
    """Where each signal turns from healthy to watch and from watch to alarming (None: never).

    The growth, drift, activation and update thresholds are what results/watch-cpu/verdict_calibration.py
    picks on the grid (watch: where a larger share of diverged than of healthy runs reaches the
    value; alarming: a value no healthy run reached). The max logit and the entropy separated
    nothing there: their thresholds are fixed scales (float32 saturation; about one key).
    docs/DIAGNOSTICS.md gives the counts."""

    logit_watch: float = 0.5  # max attention logit, as a fraction of LOGIT_LIMIT; alarming from LOGIT_LIMIT
    growth_watch: float = 0.75  # e-folds of (1 + max logit) per step since the previous checkpoint
    growth_alarming: float | None = None
    entropy_watch: float = 0.05  # min normalised attention entropy, below which a head sees about one key
    log_z_watch: float = 0.5  # |log Z - log Z at the run's first checkpoint|, nats
    log_z_alarming: float | None = 2.0
    activation_watch: float = 20.0  # activation ratio / its value at the run's first checkpoint
    update_watch: float = 0.15  # RMS(next update) / RMS(weight), the largest over weights
    update_alarming: float | None = 0.3


@dataclass(frozen=True)
class Precursors:
    """What one checkpoint measured, as the rules read it: per layer where the probe gives layers."""

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


@dataclass(frozen=True)
class SignalVerdict:
    """One signal's level, the value judged, where it is (layer; step for a run) and why."""

    signal: str
    level: str
    value: float | None
    reason: str
    rule: str  # LEVEL_RULE | HISTORY_RULE
    layer: int | None = None
    step: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "signal": self.signal,
            "level": self.level,
            "value": self.value,
            "layer": self.layer,
            "step": self.step,
            "rule": self.rule,
            "reason": self.reason,
        }


@dataclass
class Verdict:
    """The verdict on a checkpoint or a run: the worst level over its signals, and each signal's."""

    signals: list[SignalVerdict] = field(default_factory=list)
    history: bool = False  # whether the history rules could judge
    notes: list[str] = field(default_factory=list)
    steps: list[int | None] = field(default_factory=list)  # for a run: the steps of the checkpoints judged

    @property
    def level(self) -> str | None:
        """The worst level of any signal; None when nothing could be judged (no probe, no weights)."""
        return worst(s.level for s in self.signals)

    def signal(self, name: str) -> SignalVerdict | None:
        return next((s for s in self.signals if s.signal == name), None)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "level": self.level,
            "history": self.history,
            "signals": [s.to_dict() for s in self.signals],
            "notes": list(self.notes),
        }
        if self.steps:
            out["steps"] = list(self.steps)
        return out


def worst(levels) -> str | None:
    ranked = [LEVELS.index(x) for x in levels]
    return LEVELS[max(ranked)] if ranked else None


def _grade(value: float, watch: float | None, alarming: float | None) -> str:
    if not math.isfinite(value) or (alarming is not None and value >= alarming):
        return ALARMING
    return WATCH if watch is not None and value >= watch else HEALTHY


def _is_number(x: Any) -> TypeGuard[float]:
    """A number (NaN and infinities included): what a rule can judge; None and bools are not."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _top(values: Sequence[float | None], low: bool = False) -> tuple[float, int] | None:
    """(value, layer) of the largest (with `low`, the smallest) value; a NaN counts as the worst."""
    present = [(float(v), i) for i, v in enumerate(values) if _is_number(v)]
    if not present:
        return None
    nan = [(v, i) for v, i in present if math.isnan(v)]
    if nan:
        return nan[0]
    return min(present) if low else max(present)


def _g(x: float) -> str:
    return f"{x:.3g}"


def _where(layer: int | None, head: int | None = None) -> str:
    if layer is None:
        return ""
    return f" (layer {layer}, head {head})" if head is not None else f" (layer {layer})"


# -- level rules --------------------------------------------------------------------------------
def max_logit_rule(p: Precursors, t: Thresholds) -> SignalVerdict | None:
    top = _top(p.max_logit)
    if top is None:
        return None
    value, layer = top
    head = p.max_logit_head[layer] if layer < len(p.max_logit_head) else None
    watch = t.logit_watch * LOGIT_LIMIT
    level = _grade(value, watch, LOGIT_LIMIT)
    where = _where(layer, head)
    if not math.isfinite(value):
        reason = f"max attention logit is not finite{where}"
    elif level == ALARMING:
        reason = (
            f"max attention logit {_g(value)}{where} is at least {LOGIT_LIMIT:g}: exp(-{LOGIT_LIMIT:g}) "
            "underflows float32, so that softmax row is one-hot and passes no gradient to the other keys"
        )
    elif level == WATCH:
        reason = f"max attention logit {_g(value)}{where} is past {_g(watch)}, on the way to float32 saturation at {LOGIT_LIMIT:g}"
    else:
        reason = f"max attention logit {_g(value)}{where} is below {_g(watch)} ({t.logit_watch:g} of the saturation {LOGIT_LIMIT:g})"
    return SignalVerdict(MAX_LOGIT, level, value, reason, LEVEL_RULE, layer)


def entropy_rule(p: Precursors, t: Thresholds) -> SignalVerdict | None:
    top = _top(p.entropy_min, low=True)
    if top is None:
        return None
    value, layer = top
    if math.isnan(value):
        return SignalVerdict(
            ENTROPY, ALARMING, value, f"attention entropy is not finite{_where(layer)}", LEVEL_RULE, layer
        )
    if value < t.entropy_watch:
        level = WATCH
        reason = (
            f"min normalised attention entropy {_g(value)}{_where(layer)} is below {t.entropy_watch:g}: a head attends "
            "to about one key (not alarming by itself: every healthy run of the calibration grid got there)"
        )
    else:
        level = HEALTHY
        reason = f"min normalised attention entropy {_g(value)}{_where(layer)} is above {t.entropy_watch:g}"
    return SignalVerdict(ENTROPY, level, value, reason, LEVEL_RULE, layer)


def update_rule(p: Precursors, t: Thresholds) -> SignalVerdict | None:
    value = p.update_ratio
    if not _is_number(value):
        return None
    level = _grade(value, t.update_watch, t.update_alarming)
    weight = f" ({p.update_weight})" if p.update_weight else ""
    if not math.isfinite(value):
        reason = f"update / weight ratio is not finite{weight}"
    elif level == HEALTHY:
        reason = f"the next update moves a weight by at most {_g(value)} of its RMS{weight}, below {t.update_watch:g}"
    else:
        limit = t.update_alarming if level == ALARMING else t.update_watch
        reason = f"the next update moves a weight by {_g(value)} of its RMS{weight}, at least {limit:g}"
    return SignalVerdict(UPDATE, level, value, reason, LEVEL_RULE)


def bound_rule(p: Precursors, t: Thresholds) -> SignalVerdict | None:
    top = _top(p.logit_bound)
    if top is None:
        return None
    value, layer = top
    kind = p.bound_kind[layer] if layer < len(p.bound_kind) and p.bound_kind[layer] else "logit"
    if math.isfinite(value) and value < LOGIT_LIMIT:
        level = HEALTHY
        reason = (
            f"the {kind} bound {_g(value)}{_where(layer)} is below {LOGIT_LIMIT:g}: no input as large as the probe's "
            "can saturate the softmax"
        )
    else:  # an upper bound above the limit proves nothing: watch, never alarming (the measured logit is)
        level = WATCH
        reason = (
            f"the {kind} bound {_g(value)}{_where(layer)} is at least {LOGIT_LIMIT:g}: these weights allow a saturated "
            "softmax on inputs as large as the probe's"
        )
    return SignalVerdict(BOUND, level, value, reason, LEVEL_RULE, layer)


# -- history rules ------------------------------------------------------------------------------
def _log1p(x: float) -> float:
    return math.log1p(max(x, 0.0)) if math.isfinite(x) else x


def growth_rule(p: Precursors, previous: Precursors, t: Thresholds) -> SignalVerdict | None:
    """The fastest e-fold rate per step of (1 + max logit) of a layer since the previous checkpoint."""
    if p.step is None or previous.step is None or p.step <= previous.step:
        return None
    dt = p.step - previous.step
    rates = []
    for layer, (now, then) in enumerate(zip(p.max_logit, previous.max_logit)):
        if _is_number(now) and _is_number(then):
            rate = (_log1p(now) - _log1p(then)) / dt
            rates.append((rate if not math.isnan(rate) else math.inf, layer, then, now))
    if not rates:
        return None
    rate, layer, then, now = max(rates)
    level = _grade(rate, t.growth_watch, t.growth_alarming)
    lead = f"the fastest growth of 1 + max attention logit is {_g(rate)} e-folds per step"
    since = f"(layer {layer}: {_g(then)} at step {previous.step} -> {_g(now)} at step {p.step})"
    if level == HEALTHY:
        reason = f"{lead} {since}, below {t.growth_watch:g}"
    else:
        limit = t.growth_alarming if level == ALARMING else t.growth_watch
        reason = f"{lead} {since}, at least {limit:g}"
        if level == WATCH and t.growth_alarming is None:
            reason += " (not alarming by itself: healthy runs of the calibration grid grew as fast)"
    return SignalVerdict(LOGIT_GROWTH, level, rate, reason, HISTORY_RULE, layer)


def log_z_rule(p: Precursors, first: Precursors, t: Thresholds) -> SignalVerdict | None:
    if not (_is_number(p.log_z_mean) and _is_number(first.log_z_mean)):
        return None
    drift = abs(p.log_z_mean - first.log_z_mean)
    drift = drift if not math.isnan(drift) else math.inf
    level = _grade(drift, t.log_z_watch, t.log_z_alarming)
    since = f"{_g(first.log_z_mean)} at step {first.step} -> {_g(p.log_z_mean)}"
    if level == HEALTHY:
        reason = f"output log Z moved {_g(drift)} nats since the run's first checkpoint ({since}), less than {t.log_z_watch:g}"
    else:
        limit = t.log_z_alarming if level == ALARMING else t.log_z_watch
        reason = f"output log Z moved {_g(drift)} nats since the run's first checkpoint ({since}), at least {limit:g}"
    return SignalVerdict(LOG_Z, level, drift, reason, HISTORY_RULE)


def activation_rule(p: Precursors, first: Precursors, t: Thresholds) -> SignalVerdict | None:
    growths = []
    for layer, (now, then) in enumerate(zip(p.activation_ratio, first.activation_ratio)):
        if _is_number(now) and _is_number(then) and then:
            g = now / then
            growths.append((g if not math.isnan(g) else math.inf, layer, then, now))
    if not growths:
        return None
    growth, layer, then, now = max(growths)
    level = WATCH if growth >= t.activation_watch or not math.isfinite(growth) else HEALTHY
    since = f"(layer {layer}: {_g(then)} at step {first.step} -> {_g(now)})"
    word = "at least" if level == WATCH else "below"
    reason = (
        f"activation max/median is {_g(growth)}x its value at the run's first checkpoint {since}, "
        f"{word} {t.activation_watch:g}x"
    )
    if level == WATCH:
        reason += " (not alarming by itself: no diverged run of the calibration grid raised it)"
    return SignalVerdict(ACTIVATION, level, growth, reason, HISTORY_RULE, layer)


# -- verdicts -----------------------------------------------------------------------------------
def checkpoint_verdict(
    p: Precursors,
    first: Precursors | None = None,
    previous: Precursors | None = None,
    thresholds: Thresholds | None = None,
) -> Verdict:
    """The verdict on one checkpoint: the level rules, and with the run's `first` and `previous`
    checkpoints (None: no history) the history rules."""
    t = thresholds or Thresholds()
    found: dict[str, SignalVerdict | None] = {
        MAX_LOGIT: max_logit_rule(p, t),
        ENTROPY: entropy_rule(p, t),
        UPDATE: update_rule(p, t),
        BOUND: bound_rule(p, t),
    }
    notes = []
    history = first is not None and first is not p
    if history:
        assert first is not None
        found[LOGIT_GROWTH] = growth_rule(p, previous or first, t)
        found[LOG_Z] = log_z_rule(p, first, t)
        found[ACTIVATION] = activation_rule(p, first, t)
    else:
        notes.append(FIRST_NOTE if first is p else NO_HISTORY_NOTE)
    signals = [s for name in SIGNALS if (s := found.get(name)) is not None]
    if not signals:
        notes.append(NOTHING_NOTE)
    signals = [dataclasses.replace(s, step=p.step) for s in signals]
    return Verdict(signals, history, notes)


def trajectory_verdicts(points: Sequence[Precursors], thresholds: Thresholds | None = None) -> list[Verdict]:
    """The verdict on each checkpoint of a run (in step order): the first has the level rules only
    (it is the reference), each later one the history rules against the first and the previous."""
    return [
        checkpoint_verdict(p, points[0] if len(points) > 1 else None, points[i - 1] if i else None, thresholds)
        for i, p in enumerate(points)
    ]


def run_verdict(verdicts: Sequence[Verdict], steps: Sequence[int | None]) -> Verdict:
    """A run's verdict from its checkpoints' (trajectory_verdicts): per signal the worst level any
    checkpoint reached, at the first step it did (a signal healthy throughout: its latest reading)."""
    by_signal: dict[str, SignalVerdict] = {}
    for v in verdicts:
        for s in v.signals:
            held = by_signal.get(s.signal)
            rank, held_rank = LEVELS.index(s.level), LEVELS.index(held.level) if held else -1
            if rank > held_rank or (rank == held_rank == 0):
                by_signal[s.signal] = s
    history = any(v.history for v in verdicts)
    notes = [] if history else [NO_HISTORY_NOTE]
    signals = [by_signal[name] for name in SIGNALS if name in by_signal]
    return Verdict(signals, history, notes, list(steps))
