"""The instability watcher's detector: fed one record of precursors per probe step, it returns warnings.

Pure Python (no torch), so that it runs the same inside `merit train --watch` and on a run's
recorded metrics.jsonl afterwards (results/watch-cpu replays the grid through this class).

Every signal is a quantity whose growth precedes a divergence (docs/DIAGNOSTICS.md), taken in
log units so that one rule fits every model and scale: the max attention logit per layer, minus
the log of the min normalised attention entropy per layer (entropy collapse), the drift of the
output log Z, the log of the residual stream's activation ratio per layer, the log of the update
/ weight ratio, the log of the gradient norm and the loss. A signal is judged against the run's
own history, not against a fixed threshold: it warns when, on `confirm` records in a row, its
value both sets a new high of the run (by `margin` above every earlier value after warmup) and
rises faster than it ever did after warmup: its slope over the last `span` records is above
`z` robust standard deviations (1.4826 MAD) of the earlier slopes, with a floor on that spread
so that a near-constant history does not make noise look like a trend. A growing signal during
healthy training passes the first test but not the second (its growth slows); a spike that is
already falling passes neither. The first `history` slopes of a signal form its history and never
warn. The minimum normalised entropy is recorded but does not warn by default (WatchSettings).
The signals, the settings and the rule itself (`trend_rule`) are the watcher's subset of
merit_core.instability_rules (WATCH_RULES); this module keeps each signal's history and says when
to warn. How well this forecasts, measured: results/watch-train/README.md.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from statistics import median
from typing import Any

from merit_core.instability_rules import TWO_SIDED, WATCH_SIGNALS, WatchSettings, trend_rule


@dataclass(frozen=True)
class WatchWarning:
    """One warning: which signal, in which layer (None: a whole-model signal), at which step, and why."""

    signal: str
    layer: int | None
    step: int
    value: float
    reason: str

    def line(self) -> str:
        where = f" in layer {self.layer}" if self.layer is not None else ""
        return f"instability warning at step {self.step}: {self.signal}{where} {self.reason}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "signal": self.signal,
            "layer": self.layer,
            "step": self.step,
            "value": self.value,
            "reason": self.reason,
        }


@dataclass
class Series:
    """One signal of one layer: its values in log units, its slopes, and how many records in a row
    it has looked unstable."""

    two_sided: bool = False
    steps: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)
    slopes: list[float] = field(default_factory=list)
    high: float = -math.inf
    streak: int = 0

    def add(self, step: int, value: float, s: WatchSettings) -> str | None:
        """Record `value` at `step`; the reason when it now counts as unstable, else None."""
        reason = None
        if len(self.values) >= s.span:
            dt = step - self.steps[-s.span]
            slope = (value - self.values[-s.span]) / max(dt, 1)
            reason = self._judge(value, slope, s)
            self.slopes.append(slope)
            del self.slopes[: -s.window]
        self.steps.append(step)
        self.values.append(value)
        del self.steps[: -s.window], self.values[: -s.window]
        self.streak = self.streak + 1 if reason else 0
        return reason if self.streak >= s.confirm else None

    def _judge(self, value: float, slope: float, s: WatchSettings) -> str | None:
        history = self.slopes
        if self.two_sided:
            base = median(self.values) if self.values else value
            value, slope, history = abs(value - base), abs(slope), [abs(x) for x in history]
        high, self.high = self.high, max(self.high, value)
        return trend_rule(value, slope, high, history, s)


def _layers(value: Any) -> list[tuple[int | None, float]]:
    if isinstance(value, (list, tuple)):
        return [(i, float(v)) for i, v in enumerate(value) if _finite(v)]
    return [(None, float(value))] if _finite(value) else []


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


class Watcher:
    """The detector. `observe(record)` takes one watch record (keys of metric_names.WATCH_*, and
    `step`) and returns the warnings it raises; records of steps up to `warmup_steps` are skipped
    (`merit train` passes 2x its lr warmup: merit_core.train.run_watch.SKIP_WARMUPS). Each
    (signal, layer) warns once; `forget_after(step)` drops what came after a step (a rewind)."""

    def __init__(self, warmup_steps: int = 0, settings: WatchSettings | None = None):
        self.settings = settings or WatchSettings()
        self.warmup_steps = warmup_steps
        self.series: dict[tuple[str, int | None], Series] = {}
        self.records: list[Mapping[str, Any]] = []
        self.warned: dict[tuple[str, int | None], int] = {}

    def observe(self, record: Mapping[str, Any]) -> list[WatchWarning]:
        step = int(record["step"])
        self.records.append(record)
        if step <= self.warmup_steps:
            return []
        out = []
        for name in self.settings.signals:
            key, transform = WATCH_SIGNALS[name]
            for layer, raw in _layers(record.get(key)):
                series = self.series.setdefault((name, layer), Series(two_sided=name in TWO_SIDED))
                reason = series.add(step, transform(raw), self.settings)
                if reason and (name, layer) not in self.warned:
                    self.warned[(name, layer)] = step
                    out.append(WatchWarning(name, layer, step, raw, reason))
        return out

    def forget_after(self, step: int) -> None:
        """Replay the records up to `step` into a fresh detector state (what a rewind keeps)."""
        kept = [r for r in self.records if int(r["step"]) <= step]
        self.series, self.records, self.warned = {}, [], {}
        for record in kept:
            self.observe(record)


def replay(records: Iterable[Mapping[str, Any]], warmup_steps: int, settings: WatchSettings | None = None):
    """The warnings a Watcher raises over recorded watch records, in order."""
    watcher = Watcher(warmup_steps, settings)
    found: list[WatchWarning] = []
    for record in records:
        found.extend(watcher.observe(record))
    return found
