"""The instability rules: when a precursor, a loss or a run counts as unstable. One module, so
that every caller judges by the same constants and the same wording; each uses its own subset.

- `VERDICT_LEVEL_RULES` and `VERDICT_HISTORY_RULES` (merit_core.diagnostics.verdict, `merit
  inspect`): "healthy", "watch" or "alarming" per signal, with the reason in words. **Level rules**
  judge one checkpoint by itself, against a scale the signal has whatever the model: the max
  attention logit against float32 softmax saturation (LOGIT_LIMIT), the min normalised attention
  entropy (0 is one-hot, 1 uniform), the update / weight ratio (a fraction of the weight moved by
  one step), and the logit bound against LOGIT_LIMIT. **History rules** judge a checkpoint of a run
  against the run's earlier checkpoints: the growth rate of the max logit since the previous
  checkpoint, the drift of the output log Z and the growth of the activation ratio since the run's
  first checkpoint. Their scales differ by model (log Z starts at log(vocabulary), activation
  ratios of large pretrained models are 10^3-10^4), so only the change is judged. The rules and the
  grid's counts behind each threshold are in docs/DIAGNOSTICS.md.
- `WATCH_RULES` (merit_core.train.watch_detector, `merit train --watch`): each signal in log units
  (`WATCH_SIGNALS`) judged against the run's own history (`trend_rule`), and the divergence rule
  that says when a run diverged (`divergence_step`).
- `BASELINE_RULES`: the field's spike rules (OLMo-core's, ZClip's) that the watcher's forecasts are
  measured against (merit_core.train.watch_scoring, results/watch-train).
- `COMPARE_RULES` (merit_core.compare.stability, `merit compare`): when a run that finished with a
  finite loss still counts as failed, 'unstable'. A finite loss is not a healthy run. Two rules,
  each stated with its reason:

- **The attention logit saturated** (one run): its max attention logit at the end is at least
  LOGIT_LIMIT = 88. exp(-88) = 6e-39 is below float32's (and bfloat16's) smallest normal number,
  1.2e-38, so in a row where that logit leads the others by 88 (they sit near zero in a healthy
  model, as at initialisation) the softmax gives every other key a weight that underflows: the
  attention is exactly one-hot in the arithmetic the run computes in and passes no gradient to
  the other keys. That is the saturation the paper's max-logit claim is about, so it is a
  threshold on the value itself, not on its growth.
- **The loss collapsed** (one cell, against its grid): its lr is above the grid's best lr and its
  mean final validation loss is more than LOSS_EXCESS = 5% above the best's. Above the best lr a
  loss rises because the steps are too large, and a collapsed run sits near the loss of predicting
  token frequencies alone; 5% is 2.5 times the report's band of good lrs (report.GOOD_LR_TOLERANCE,
  2%). A cell below the best lr is slow, not unstable: it is not marked.

An unstable run or cell keeps its numbers (they are shown, marked), ranks below every finished
cell, is never a best lr, and is left out of the lrs the optimizer registry's caps are built from
(merit_core.optim.lr_table.STABLE_LRS).

Pure Python (no torch): the same rules judge inspect's reports, a run's recorded metrics.jsonl and
compare's summaries.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import median
from typing import Any

from merit_core.metric_names import (
    MAX_ATTENTION_LOGIT,
    NORMALIZED_ENTROPY_MIN,
    WATCH_ACTIVATION,
    WATCH_ENTROPY,
    WATCH_GRAD_NORM,
    WATCH_LOG_Z,
    WATCH_LOGIT,
    WATCH_LOSS,
    WATCH_UPDATE,
)
from merit_core.precursors import Precursors, is_number, peak

# Float32 softmax saturation: exp(-88) = 6e-39 is below float32's smallest normal number, so a row
# whose largest logit leads the others by 88 is one-hot in float32 arithmetic. Why this is the
# threshold of a saturated, unstable run: `run_unstable` below.
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
VERDICT_SIGNALS = (MAX_LOGIT, LOGIT_GROWTH, ENTROPY, LOG_Z, ACTIVATION, UPDATE, BOUND)
RULE_OF = {
    MAX_LOGIT: LEVEL_RULE,
    LOGIT_GROWTH: HISTORY_RULE,
    ENTROPY: LEVEL_RULE,
    LOG_Z: HISTORY_RULE,
    ACTIVATION: HISTORY_RULE,
    UPDATE: LEVEL_RULE,
    BOUND: LEVEL_RULE,
}


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


# -- verdict: level rules and history rules ----------------------------------------------------
def worst(levels) -> str | None:
    ranked = [LEVELS.index(x) for x in levels]
    return LEVELS[max(ranked)] if ranked else None


def _grade(value: float, watch: float | None, alarming: float | None) -> str:
    if not math.isfinite(value) or (alarming is not None and value >= alarming):
        return ALARMING
    return WATCH if watch is not None and value >= watch else HEALTHY


def _graded(value: float, watch: float, alarming: float | None, below: str = "below") -> tuple[str, str]:
    """The level of `value` against a watch and an alarming threshold (`_grade`), and the reason's
    ending that says which threshold it is under or past ("below 0.1", "at least 0.5")."""
    level = _grade(value, watch, alarming)
    if level == HEALTHY:
        return level, f"{below} {watch:g}"
    limit = alarming if level == ALARMING and alarming is not None else watch
    return level, f"at least {limit:g}"


def _g(x: float) -> str:
    return f"{x:.3g}"


def _where(layer: int | None, head: int | None = None) -> str:
    if layer is None:
        return ""
    return f" (layer {layer}, head {head})" if head is not None else f" (layer {layer})"


# -- level rules --------------------------------------------------------------------------------
def max_logit_rule(p: Precursors, t: Thresholds) -> SignalVerdict | None:
    top = peak(MAX_ATTENTION_LOGIT, p.max_logit, nan_worst=True)
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
    top = peak(NORMALIZED_ENTROPY_MIN, p.entropy_min, nan_worst=True)
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
    if not is_number(value):
        return None
    level, tail = _graded(value, t.update_watch, t.update_alarming)
    weight = f" ({p.update_weight})" if p.update_weight else ""
    if not math.isfinite(value):
        reason = f"update / weight ratio is not finite{weight}"
    else:
        by = "at most " if level == HEALTHY else ""
        reason = f"the next update moves a weight by {by}{_g(value)} of its RMS{weight}, {tail}"
    return SignalVerdict(UPDATE, level, value, reason, LEVEL_RULE)


def bound_rule(p: Precursors, t: Thresholds) -> SignalVerdict | None:
    top = peak(MAX_ATTENTION_LOGIT, p.logit_bound, nan_worst=True)  # a bound on the logit
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
    """log(1 + x) of the positive part (a non-finite x as it is): a max logit starts near 0 (even
    below it), where a plain log would turn noise into huge swings; above a few units it is the log."""
    return math.log1p(max(x, 0.0)) if math.isfinite(x) else x


def growth_rule(p: Precursors, previous: Precursors, t: Thresholds) -> SignalVerdict | None:
    """The fastest e-fold rate per step of (1 + max logit) of a layer since the previous checkpoint."""
    if p.step is None or previous.step is None or p.step <= previous.step:
        return None
    dt = p.step - previous.step
    rates = []
    for layer, (now, then) in enumerate(zip(p.max_logit, previous.max_logit)):
        if is_number(now) and is_number(then):
            rate = (_log1p(now) - _log1p(then)) / dt
            rates.append((rate if not math.isnan(rate) else math.inf, layer, then, now))
    if not rates:
        return None
    rate, layer, then, now = max(rates)
    level, tail = _graded(rate, t.growth_watch, t.growth_alarming)
    since = f"(layer {layer}: {_g(then)} at step {previous.step} -> {_g(now)} at step {p.step})"
    reason = f"the fastest growth of 1 + max attention logit is {_g(rate)} e-folds per step {since}, {tail}"
    if level == WATCH and t.growth_alarming is None:
        reason += " (not alarming by itself: healthy runs of the calibration grid grew as fast)"
    return SignalVerdict(LOGIT_GROWTH, level, rate, reason, HISTORY_RULE, layer)


def log_z_rule(p: Precursors, first: Precursors, t: Thresholds) -> SignalVerdict | None:
    if not (is_number(p.log_z_mean) and is_number(first.log_z_mean)):
        return None
    drift = abs(p.log_z_mean - first.log_z_mean)
    drift = drift if not math.isnan(drift) else math.inf
    level, tail = _graded(drift, t.log_z_watch, t.log_z_alarming, below="less than")
    since = f"{_g(first.log_z_mean)} at step {first.step} -> {_g(p.log_z_mean)}"
    reason = f"output log Z moved {_g(drift)} nats since the run's first checkpoint ({since}), {tail}"
    return SignalVerdict(LOG_Z, level, drift, reason, HISTORY_RULE)


def activation_rule(p: Precursors, first: Precursors, t: Thresholds) -> SignalVerdict | None:
    growths = []
    for layer, (now, then) in enumerate(zip(p.activation_ratio, first.activation_ratio)):
        if is_number(now) and is_number(then) and then:
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


VERDICT_LEVEL_RULES = {MAX_LOGIT: max_logit_rule, ENTROPY: entropy_rule, UPDATE: update_rule, BOUND: bound_rule}
# against the previous checkpoint (growth) or the run's first (drift, activation growth)
VERDICT_HISTORY_RULES = {LOGIT_GROWTH: growth_rule, LOG_Z: log_z_rule, ACTIVATION: activation_rule}


# -- watch: the detector's signals, its trend rule and the divergence rule ---------------------
_TINY = 1e-6  # the smallest value a log is taken of (an entropy of exactly 0, a zero grad norm)


def _log(value: float) -> float:
    return math.log(max(value, _TINY))


def _neg_log(value: float) -> float:
    return -math.log(max(value, _TINY))


def _same(value: float) -> float:
    return value


# signal name -> (record key, how the raw value becomes "up is bad" in log units)
WATCH_SIGNALS: dict[str, tuple[str, Any]] = {
    "max_logit": (WATCH_LOGIT, _log1p),
    "entropy_collapse": (WATCH_ENTROPY, _neg_log),
    "log_z_drift": (WATCH_LOG_Z, _same),  # judged both ways: see `Series`
    "activation_ratio": (WATCH_ACTIVATION, _log),
    "update_ratio": (WATCH_UPDATE, _log),
    "grad_norm": (WATCH_GRAD_NORM, _log),
    "loss": (WATCH_LOSS, _same),
}
TWO_SIDED = frozenset({"log_z_drift"})


@dataclass(frozen=True)
class WatchSettings:
    """The detector's constants (set on results/watch-cpu; kept by results/watch-train, whose tuned
    alternative did not hold out; docs/DIAGNOSTICS.md states them)."""

    span: int = 3  # records over which the current slope is taken
    history: int = 6  # slopes needed after warmup before a signal may warn
    window: int = 64  # most recent slopes kept as the history
    z: float = 4.0  # robust z-score of the slope that counts as "faster than ever"
    slope_floor: float = 0.01  # least spread of the slopes, in log units per step
    margin: float = 0.05  # how far above its earlier max (log units) a new high must be
    confirm: int = 2  # records in a row
    # what warns: every recorded signal but the entropy, whose fall is part of healthy training at
    # the grid's scale (15 of its 27 healthy runs warned on it, none of its diverged runs)
    signals: tuple[str, ...] = tuple(s for s in WATCH_SIGNALS if s != "entropy_collapse")


def trend_rule(value: float, slope: float, high: float, history: Sequence[float], s: WatchSettings) -> str | None:
    """The detector's rule on one signal of one layer: the reason when `value` (log units) sets a new
    high, `margin` above the earlier `high`, while its `slope` is `z` robust standard deviations
    above the earlier slopes `history` (after `history` of them); else None."""
    if len(history) < s.history:
        return None
    centre = median(history)
    spread = max(1.4826 * median(abs(x - centre) for x in history), s.slope_floor)
    zscore = (slope - centre) / spread
    if value > high + s.margin and slope > 0 and zscore > s.z:
        return f"rising {slope:.3g}/step ({zscore:.1f} robust sd above its history), new high {value:.3g}"
    return None


DIVERGENCE_NATS = 1.0  # how far above its lowest value the loss must go to count as diverged
DIVERGENCE_PERSIST = 5  # steps over which it must stay that high on average


def divergence_step(losses: Sequence[tuple[int, float]]) -> int | None:
    """The divergence rule: the first step D whose training loss is non-finite, or whose loss and
    the mean loss of steps D to D + DIVERGENCE_PERSIST - 1 both exceed the lowest loss before D by
    more than DIVERGENCE_NATS (a one-batch spike that recovers at once is not a divergence); None
    when there is none. `losses` are (step, loss) of consecutive logged steps."""
    low = math.inf
    for i, (step, loss) in enumerate(losses):
        if not math.isfinite(loss):
            return step
        ahead = [x for _, x in losses[i : i + DIVERGENCE_PERSIST]]
        if loss > low + DIVERGENCE_NATS and len(ahead) == DIVERGENCE_PERSIST:
            if not all(map(math.isfinite, ahead)) or sum(ahead) / len(ahead) > low + DIVERGENCE_NATS:
                return step
        low = min(low, loss)
    return None


WATCH_RULES = (trend_rule, divergence_step)


# -- the field's spike rules, the baselines the watcher is measured against --------------------
SPIKE_WINDOW, SPIKE_SIGMAS, SPIKE_MIN = 128, 6.0, 16  # OLMo-core's StabilityMonitor
ZCLIP_ALPHA, ZCLIP_Z, ZCLIP_WARMUP = 0.97, 2.5, 10  # ZClip (Kumar et al. 2025)


def spike_steps(values: Sequence[tuple[int, float]]) -> list[int]:
    """OLMo-core's rule on one logged series (loss or grad norm): every step whose value is not
    finite or above the mean + SPIKE_SIGMAS standard deviations of the previous (up to)
    SPIKE_WINDOW finite values, judged from SPIKE_MIN values on."""
    seen: list[float] = []
    fired = []
    for step, x in values:
        if len(seen) >= SPIKE_MIN:
            window = seen[-SPIKE_WINDOW:]
            mean = sum(window) / len(window)
            std = math.sqrt(sum((v - mean) ** 2 for v in window) / len(window))
            if not math.isfinite(x) or x > mean + SPIKE_SIGMAS * std:
                fired.append(step)
        if math.isfinite(x):
            seen.append(x)
    return fired


def zclip_steps(values: Sequence[tuple[int, float]]) -> list[int]:
    """ZClip's rule on the grad norm: every step whose z-score against an EMA (ZCLIP_ALPHA) of the
    mean and variance passes ZCLIP_Z, both started from the first ZCLIP_WARMUP steps and updated
    with the clipped norm as ZClip does (a non-finite norm fires and is skipped)."""
    first = [x for _, x in values[:ZCLIP_WARMUP] if math.isfinite(x)]
    if len(first) < 2:
        return []
    mean = sum(first) / len(first)
    var = sum((x - mean) ** 2 for x in first) / len(first)
    fired = []
    for step, x in values[ZCLIP_WARMUP:]:
        std = math.sqrt(max(var, 1e-12))
        if not math.isfinite(x):
            fired.append(step)
            continue
        if (x - mean) / std > ZCLIP_Z:
            fired.append(step)
        x = min(x, mean + ZCLIP_Z * std)
        mean = ZCLIP_ALPHA * mean + (1 - ZCLIP_ALPHA) * x
        var = ZCLIP_ALPHA * var + (1 - ZCLIP_ALPHA) * (x - mean) ** 2
    return fired


def spike_step(values: Sequence[tuple[int, float]]) -> int | None:
    """The first step of `spike_steps`, None when it never fires."""
    return next(iter(spike_steps(values)), None)


def zclip_step(values: Sequence[tuple[int, float]]) -> int | None:
    """The first step of `zclip_steps`, None when it never fires."""
    return next(iter(zclip_steps(values)), None)


BASELINE_RULES = (spike_steps, zclip_steps)


# -- compare: a finished run or cell -----------------------------------------------------------
LOSS_EXCESS = 0.05


def run_unstable(max_logit: float | None) -> str | None:
    """Why a finished run is unstable by its max attention logit at the end, or None."""
    if max_logit is None or max_logit < LOGIT_LIMIT:
        return None
    return f"max attention logit {max_logit:.4g} >= {LOGIT_LIMIT:g} (softmax saturated in float32)"


def loss_unstable(lr: float, loss: float | None, best_lr: float, best_loss: float | None) -> str | None:
    """Why a finished cell at `lr` is unstable against its grid's best cell, or None."""
    if loss is None or best_loss is None or lr <= best_lr or best_loss <= 0:
        return None
    excess = loss / best_loss - 1
    if excess <= LOSS_EXCESS:
        return None
    return (
        f"final validation loss {100 * excess:.1f}% above the best lr's ({best_lr:.3g}), "
        f"more than {100 * LOSS_EXCESS:g}% at a larger lr"
    )


COMPARE_RULES = (run_unstable, loss_unstable)
