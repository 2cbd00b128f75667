"""How well an early warning forecasts a divergence, scored over a grid of recorded runs.

A run's metrics.jsonl holds its logged steps (loss, grad norm) and its watch records; from them
this module labels the run (diverged, spiked and recovered, healthy), finds the steps each rule
fires at (the detector replayed at a cadence and settings, OLMo-core's and ZClip's spike rules of
merit_core.instability_rules), and tabulates lead time, recall and false alarms. A warning during
the steps a run was healthy by construction (all of a healthy run, the steps before a planted
fault) is a false alarm; the forecast of a divergence is the first warning after them. The grids under
results/ (watch-cpu, watch-train) make their tables with it, so every grid is scored alike.

Pure Python (no torch).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from merit_core.instability_rules import DIVERGENCE_NATS, WatchSettings, divergence_step, spike_steps, zclip_steps
from merit_core.metric_names import WATCH_LOSS, WATCH_WARNINGS
from merit_core.train.watch_detector import WatchWarning, replay

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

    def recorded_warnings(self) -> list[int]:
        """The steps of the warnings the run's own watcher wrote."""
        return sorted({int(w["step"]) for r in self.watch for w in r.get(WATCH_WARNINGS) or ()})

    def warnings(self, settings: WatchSettings | None = None, warmup: int = 0, every: int = 0) -> list[WatchWarning]:
        """The detector's warnings replayed over the watch records, keeping only the records of steps
        divisible by `every` (0: all): what a run probing every `every` steps would have seen, since
        the probe changes nothing in the run."""
        records = [r for r in self.watch if not every or int(r["step"]) % every == 0]
        return replay(records, warmup, settings)

    def detector(
        self, settings: WatchSettings | None = None, warmup: int = 0, every: int = 0
    ) -> tuple[int | None, str | None]:
        """(step, signal) of the detector's first warning (`warnings`); (None, None): silent."""
        found = self.warnings(settings, warmup, every)
        return (found[0].step, found[0].signal) if found else (None, None)

    def baselines(self) -> dict[str, list[int]]:
        """Every step each spike rule of the field fires at, on every logged step."""
        loss, grad = spike_steps(self.losses), spike_steps(self.grads)
        return {
            "OLMo-core spike: loss > mean+6sd (128)": loss,
            "OLMo-core spike: grad norm > mean+6sd (128)": grad,
            "OLMo-core spike: loss or grad norm": sorted(set(loss) | set(grad)),
            "ZClip: grad-norm EMA z > 2.5": zclip_steps(self.grads),
        }


@dataclass
class Scored:
    """One run's label and the steps each rule fired at.

    `at`: the divergence (or spike) step. `safe_until`: the last step of the run that was healthy by
    construction: every step of a healthy run, the steps before a planted fault (None: a run that
    diverged by itself). A warning at or before it is a false alarm; the forecast of a divergence is
    the first warning after it."""

    name: str
    status: str  # DIVERGED, SPIKED, HEALTHY, or a grid's own label (then only its safe steps count)
    at: int | None
    safe_until: int | None = None
    fires: dict[str, list[int]] = field(default_factory=dict)

    def false_alarm(self, rule: str) -> bool:
        return self.safe_until is not None and any(s <= self.safe_until for s in self.fires[rule])

    def forecast(self, rule: str) -> int | None:
        """The first warning after the safe steps, if it came by the divergence."""
        if self.status != DIVERGED or self.at is None:
            return None
        after = [s for s in self.fires[rule] if (self.safe_until is None or s > self.safe_until) and s <= self.at]
        return after[0] if after else None


def in_time(diverged_at: int, fired: int | None) -> bool:
    """Whether a warning at `fired` came far enough ahead of a divergence at `diverged_at`."""
    return fired is not None and diverged_at - fired >= min(GOAL_STEPS, GOAL_FRACTION * diverged_at)


def counts(runs: Sequence[Scored], rule: str) -> dict[str, Any]:
    """Recall, in time, leads and false alarms of one rule over scored runs. False alarms count the
    runs with a warning in their safe steps, out of the runs that have safe steps."""
    diverged = [r for r in runs if r.status == DIVERGED]
    forecasts = [(r.at, r.forecast(rule)) for r in diverged]
    leads = [at - f for at, f in forecasts if f is not None and at is not None]
    safe = [r for r in runs if r.safe_until is not None]
    spiked = [r for r in runs if r.status == SPIKED]
    return {
        "diverged": len(diverged),
        "recall": len(leads),
        "in_time": sum(in_time(at, f) for at, f in forecasts if at is not None),
        "leads": leads,
        "safe": len(safe),
        "false_alarms": sum(r.false_alarm(rule) for r in safe),
        "healthy": sum(r.status == HEALTHY for r in runs),
        "healthy_warned": sum(r.false_alarm(rule) for r in runs if r.status == HEALTHY),
        "spiked": len(spiked),
        "warned_spikes": sum(bool(r.fires[rule]) for r in spiked),
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
        head + (f", {other} neither (their safe steps count; see the labels)." if other else "."),
        "",
        f"| rule | recall (warned <= divergence) | in time (lead >= {GOAL_STEPS} steps or >= {GOAL_FRACTION:.0%}) "
        "| median lead, steps | median lead, tokens | min / max lead | false alarms (runs warned in safe steps) "
        "| of which healthy runs | warned on recovered spikes |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for rule in rules:
        c = counts(runs, rule)
        leads = c["leads"]
        span = f"{min(leads)} / {max(leads)}" if leads else "-"
        out.append(
            f"| {rule} | {c['recall']}/{c['diverged']} | {c['in_time']}/{c['diverged']} | {_median(leads)} "
            f"| {_median([x * tokens_per_step for x in leads])} | {span} | {c['false_alarms']}/{c['safe']} "
            f"| {c['healthy_warned']}/{c['healthy']} | {c['warned_spikes']}/{c['spiked']} |"
        )
    return out
