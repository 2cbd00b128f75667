"""How well an early warning forecasts a divergence, scored over a grid of recorded runs.

A run's metrics.jsonl holds its logged steps (loss, grad norm) and its watch records; from them
this module labels the run (diverged, spiked and recovered, healthy), finds the first step each
rule fires (the detector replayed at a cadence and settings, OLMo-core's and ZClip's spike rules
of merit_core.instability_rules), and tabulates lead time, recall and false alarms. The grids under
results/ (watch-cpu, watch-train) make their tables with it, so every grid is scored alike.

Pure Python (no torch).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from merit_core.instability_rules import DIVERGENCE_NATS, WatchSettings, divergence_step, spike_step, zclip_step
from merit_core.metric_names import WATCH_LOSS, WATCH_WARNINGS
from merit_core.train.watch_detector import replay

DIVERGED, SPIKED, HEALTHY = "diverged", "spiked", "healthy"
GOAL_STEPS, GOAL_FRACTION = 20, 0.1  # a warning in time: this many steps ahead, or this share of the steps before


def _number(x: Any) -> float:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else math.nan


@dataclass
class RunSeries:
    """One recorded run: its logged (step, loss) and (step, grad norm), and its watch records."""

    losses: list[tuple[int, float]]
    grads: list[tuple[int, float]]
    watch: list[Mapping[str, Any]]

    @classmethod
    def of(cls, metrics: Iterable[Mapping[str, Any]]) -> RunSeries:
        records = list(metrics)
        logs = [r for r in records if "loss" in r and "step" in r]
        return cls(
            [(int(r["step"]), _number(r["loss"])) for r in logs],
            [(int(r["step"]), _number(r.get("grad_norm"))) for r in logs],
            [r for r in records if WATCH_LOSS in r],
        )

    @property
    def last_step(self) -> int:
        return self.losses[-1][0] if self.losses else 0

    def label(self) -> tuple[str, int | None]:
        """(DIVERGED, the divergence step) by merit_core.instability_rules.divergence_step; else (SPIKED,
        the first step whose loss rose DIVERGENCE_NATS above its lowest before it and came back);
        else (HEALTHY, None)."""
        diverged = divergence_step(self.losses)
        if diverged is not None:
            return DIVERGED, diverged
        low = math.inf
        for step, loss in self.losses:
            if loss > low + DIVERGENCE_NATS:
                return SPIKED, step
            low = min(low, loss)
        return HEALTHY, None

    def recorded_warning(self) -> int | None:
        """The step of the first warning the run's own watcher wrote, if any."""
        steps = [int(w["step"]) for r in self.watch for w in r.get(WATCH_WARNINGS) or ()]
        return min(steps) if steps else None

    def detector(
        self, settings: WatchSettings | None = None, warmup: int = 0, every: int = 0
    ) -> tuple[int | None, str | None]:
        """(step, signal) of the detector's first warning replayed over the watch records, keeping
        only the records of steps divisible by `every` (0: all): what a run probing every `every`
        steps would have seen, since the probe changes nothing in the run. (None, None): silent."""
        records = [r for r in self.watch if not every or int(r["step"]) % every == 0]
        found = replay(records, warmup, settings)
        return (found[0].step, found[0].signal) if found else (None, None)

    def baselines(self) -> dict[str, int | None]:
        """The first step of each spike rule of the field, on every logged step."""
        loss, grad = spike_step(self.losses), spike_step(self.grads)
        either = [s for s in (loss, grad) if s is not None]
        return {
            "OLMo-core spike: loss > mean+6sd (128)": loss,
            "OLMo-core spike: grad norm > mean+6sd (128)": grad,
            "OLMo-core spike: loss or grad norm": min(either) if either else None,
            "ZClip: grad-norm EMA z > 2.5": zclip_step(self.grads),
        }


@dataclass
class Scored:
    """One run's label and the first step each rule fired (None: silent)."""

    name: str
    status: str  # DIVERGED, SPIKED, HEALTHY, or a grid's own label (left out of the table's counts)
    at: int | None  # the divergence (or spike) step
    fires: dict[str, int | None] = field(default_factory=dict)


def in_time(diverged_at: int, fired: int | None) -> bool:
    """Whether a warning at `fired` came far enough ahead of a divergence at `diverged_at`."""
    return fired is not None and diverged_at - fired >= min(GOAL_STEPS, GOAL_FRACTION * diverged_at)


def counts(runs: Sequence[Scored], rule: str) -> dict[str, Any]:
    """Recall, goal met, leads and false alarms of one rule over scored runs."""
    diverged = [r for r in runs if r.status == DIVERGED]
    healthy = [r for r in runs if r.status == HEALTHY]
    spiked = [r for r in runs if r.status == SPIKED]
    leads = [r.at - r.fires[rule] for r in diverged if r.fires[rule] is not None and r.fires[rule] <= r.at]  # type: ignore[operator]
    return {
        "diverged": len(diverged),
        "recall": len(leads),
        "in_time": sum(in_time(r.at, r.fires[rule]) for r in diverged if r.at is not None),
        "leads": leads,
        "healthy": len(healthy),
        "false_alarms": sum(r.fires[rule] is not None for r in healthy),
        "spiked": len(spiked),
        "warned_spikes": sum(r.fires[rule] is not None for r in spiked),
    }


def _median(xs: list[int]) -> str:
    return f"{statistics.median(xs):g}" if xs else "-"


def lead_table(runs: Sequence[Scored], tokens_per_step: int) -> list[str]:
    """The markdown table, one row per rule, in the order of the first run's `fires`."""
    rules = list(runs[0].fires) if runs else []
    by = {s: sum(r.status == s for r in runs) for s in (DIVERGED, SPIKED, HEALTHY)}
    other = len(runs) - sum(by.values())
    head = f"{len(runs)} runs: {by[DIVERGED]} diverged, {by[SPIKED]} spiked and recovered, {by[HEALTHY]} healthy"
    out = [
        head + (f", {other} left out (see the labels)." if other else "."),
        "",
        f"| rule | recall (warned <= divergence) | in time (lead >= {GOAL_STEPS} steps or >= {GOAL_FRACTION:.0%}) "
        "| median lead, steps | median lead, tokens | min / max lead | false alarms on healthy runs "
        "| warned on recovered spikes |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for rule in rules:
        c = counts(runs, rule)
        leads = c["leads"]
        span = f"{min(leads)} / {max(leads)}" if leads else "-"
        out.append(
            f"| {rule} | {c['recall']}/{c['diverged']} | {c['in_time']}/{c['diverged']} | {_median(leads)} "
            f"| {_median([x * tokens_per_step for x in leads])} | {span} | {c['false_alarms']}/{c['healthy']} "
            f"| {c['warned_spikes']}/{c['spiked']} |"
        )
    return out
