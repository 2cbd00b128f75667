"""A health verdict on the precursors `merit inspect` measures: "healthy", "watch" or "alarming" per
signal, with the reason in words, for one checkpoint and for a run's trajectory of checkpoints.

The rules are the verdict's subset of merit_core.instability_rules (`VERDICT_LEVEL_RULES` judge a
checkpoint by itself, `VERDICT_HISTORY_RULES` against its run's earlier checkpoints); this module
assembles their findings. A checkpoint without history gets the level rules only, and the verdict
says so. Pure Python (no torch): the same rules judge inspect's reports and, in
results/watch-cpu/verdict_calibration.py, the watch records of the CPU grid they were calibrated on.

A run's verdict is, per signal, the worst level any of its checkpoints reached (the first step it
did), with that checkpoint's reason.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from merit_core.instability_rules import (
    LEVELS,
    LOGIT_GROWTH,
    VERDICT_HISTORY_RULES,
    VERDICT_LEVEL_RULES,
    VERDICT_SIGNALS,
    SignalVerdict,
    Thresholds,
    worst,
)
from merit_core.precursors import Precursors

NO_HISTORY_NOTE = (
    "one checkpoint without history: level rules only (max logit, entropy, update ratio, logit bound); "
    "the growth and drift rules need a run folder with several checkpoints"
)
NOTHING_NOTE = "nothing to judge: no probe statistics (max logit, entropy, log Z, bounds) and no update ratio"
FIRST_NOTE = "the run's first inspected checkpoint: the reference of the growth and drift rules, not judged by them"


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
    found: dict[str, SignalVerdict | None] = {name: rule(p, t) for name, rule in VERDICT_LEVEL_RULES.items()}
    notes = []
    if first is not None and first is not p:
        for name, rule in VERDICT_HISTORY_RULES.items():  # growth since the previous, drift since the first
            found[name] = rule(p, (previous or first) if name == LOGIT_GROWTH else first, t)
    else:
        notes.append(FIRST_NOTE if first is p else NO_HISTORY_NOTE)
    history = first is not None and first is not p
    signals = [s for name in VERDICT_SIGNALS if (s := found.get(name)) is not None]
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
    signals = [by_signal[name] for name in VERDICT_SIGNALS if name in by_signal]
    return Verdict(signals, history, notes, list(steps))
