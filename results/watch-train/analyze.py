"""Labels, the detector's tuning and the held-out table of the watch-train grid (see grid.py).

    python results/watch-train/analyze.py GRID_DIR     # copies the runs' metrics to metrics/, writes the tables
    python results/watch-train/analyze.py              # the tables again from the copies in metrics/

Labels (merit_core.train.watch_scoring): a run **diverged** at the first step D of the divergence
rule (merit_core.instability_rules.divergence_step: the loss non-finite, or it and the mean of
the 5 steps from D both more than 1 nat above the lowest loss before D); else it **spiked** if a
loss rose more than 1 nat above the lowest before it and came back; else it is **healthy**. A
planted run that did not diverge by its last step is labelled as such (its fault was
still under way): only its steps before the fault count, as for every planted run.

Safe steps: every step of a healthy run and the steps of a planted run before its fault; a
warning there is a **false alarm**. The forecast of a divergence is the first warning after the
safe steps (a planted run's warning before its fault cannot foretell it).

Parts: the detector's settings are chosen on the **tuning** part (gpt2-tiny, seeds 0 and 1) and
reported on the **held-out** part (gpt2-tiny seed 2 and every llama-tiny run), which the choice
never saw. A warning is **in time** when it comes >= 20 steps (or >= 10% of the steps) before the
divergence. The goal: in time in >= 90% of the held-out diverged runs, false alarms on <= 5% of
the held-out healthy runs.

Rows: the detector as each run's own `merit train --watch` warned (probing every 2 steps, the
settings of the commit the grid ran at); the same detector replayed at `merit train`'s default
cadence (every 20 steps); each signal alone; the tuned detector; OLMo-core's and ZClip's spike
rules on every step's loss and grad norm (merit_core.instability_rules.BASELINE_RULES). One row
more, for reference and not the tuning's choice: today's settings judging only after 2x the warmup.
"""

from __future__ import annotations

import csv
import dataclasses
import itertools
import json
import math
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from merit_core.instability_rules import WATCH_SIGNALS, WatchSettings  # noqa: E402
from merit_core.metrics import read_metrics  # noqa: E402
from merit_core.train.watch_scoring import (  # noqa: E402
    DIVERGED,
    GOAL_FRACTION,
    HEALTHY,
    RunSeries,
    Scored,
    counts,
    lead_table,
)

RUNS = HERE / "metrics"
TOKENS_PER_STEP = 8 * 128
DEFAULT_EVERY = 20  # merit train's watch_every
LEFT_OUT = "planted, not diverged by the end"
GOAL_RECALL, GOAL_FALSE = 0.9, 0.05
# the tuning search: every combination of these, each replayed over the tuning part
SEARCH = {
    "span": (3, 5),
    "z": (3.0, 4.0, 6.0),
    "margin": (0.05, 0.2),
    "confirm": (1, 2, 3),
    "signals": (
        WatchSettings().signals,
        ("max_logit",),
        ("update_ratio",),
        ("max_logit", "update_ratio"),
        ("max_logit", "update_ratio", "grad_norm"),
        ("max_logit", "log_z_drift", "update_ratio"),
    ),
}
WARMUPS = (0, 13, 26, 39)  # steps not judged: none (merit train today), the warmup, 2x and 3x it
CADENCES = (2, 4, 10)


# -- the runs ----------------------------------------------------------------------------------
def _round(value: Any) -> Any:
    if isinstance(value, float):
        return float(f"{value:.5g}") if math.isfinite(value) else None
    if isinstance(value, list):
        return [_round(v) for v in value]
    if isinstance(value, dict):
        return {k: _round(v) for k, v in value.items()}
    return value


def copy_runs(grid: Path, dest: Path) -> None:
    """Each finished run's settings (done.json) and metrics, rounded to 5 digits, into dest/<label>.jsonl."""
    dest.mkdir(exist_ok=True)
    for done in sorted(grid.glob("*/done.json")):
        info = json.loads(done.read_text())
        lines = [json.dumps({"run": info})]
        for read in read_metrics(done.parent):
            record = dict(read)
            record.pop("tokens_per_s", None)
            lines.append(json.dumps(_round(record)))
        (dest / f"{info['label']}.jsonl").write_text("\n".join(lines) + "\n")


def load_runs(source: Path) -> list[tuple[dict[str, Any], RunSeries]]:
    """(settings, series) of every copied run, by label."""
    runs = []
    for path in sorted(source.glob("*.jsonl")):
        records = [json.loads(line) for line in path.read_text().splitlines()]
        runs.append((records[0]["run"], RunSeries.of(records[1:])))
    return runs


def tuning(info: dict[str, Any]) -> bool:
    return info["model"] == "gpt2-tiny" and info["seed"] in (0, 1)


def label(info: dict[str, Any], run: RunSeries) -> tuple[str, int | None, int | None]:
    """(status, divergence or spike step, last safe step): a planted run is safe before its fault."""
    status, at = run.label()
    plant = info.get("plant_at")
    if plant is not None:
        return (status if status == DIVERGED else LEFT_OUT), at, plant - 1
    return status, at, (run.last_step if status == HEALTHY else None)


# -- the detector's settings -------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Choice:
    settings: WatchSettings
    warmup: int
    every: int

    def changes(self) -> int:
        """How many settings differ from today's watcher (its WatchSettings, no steps skipped, every 2)."""
        d = WatchSettings()
        moved = sum(getattr(self.settings, f.name) != getattr(d, f.name) for f in dataclasses.fields(d))
        return moved + (self.warmup != 0) + (self.every != 2)

    def describe(self) -> str:
        s, d = self.settings, WatchSettings()
        changed = [
            f"{f.name}={getattr(s, f.name)!r}"
            for f in dataclasses.fields(s)
            if getattr(s, f.name) != getattr(d, f.name)
        ]
        return ", ".join(changed + [f"warmup skipped={self.warmup}", f"every={self.every}"])


def fires_of(run: RunSeries, choice: Choice) -> list[int]:
    return sorted({w.step for w in run.warnings(choice.settings, choice.warmup, choice.every)})


Labelled = list[tuple[tuple[str, int | None, int | None], RunSeries]]


def score(runs: Labelled, choice: Choice) -> tuple[int, int, int, float]:
    """(in time, false alarms, diverged, median lead) of one choice over labelled runs."""
    scored = [Scored("", *lab, fires={"x": fires_of(run, choice)}) for lab, run in runs]
    c = counts(scored, "x")
    leads = sorted(c["leads"])
    return c["in_time"], c["false_alarms"], c["diverged"], (leads[len(leads) // 2] if leads else -1)


def tune(runs: Labelled) -> tuple[Choice, list[str]]:
    """The choice with the most runs warned in time on `runs` among those with false alarms (a
    warning in a run's safe steps) on at most GOAL_FALSE of the runs with safe steps; ties go to
    fewer false alarms, then to fewer settings changed from today's watcher, then to the longer
    median lead, then to the search's order."""
    healthy = sum(lab[2] is not None for lab, _ in runs)
    allowed = math.floor(GOAL_FALSE * healthy)
    best: tuple[Any, ...] | None = None
    tried = 0
    keys = list(SEARCH)
    for values in itertools.product(*(SEARCH[k] for k in keys)):
        for warmup, every in itertools.product(WARMUPS, CADENCES):
            choice = Choice(WatchSettings(**dict(zip(keys, values))), warmup, every)
            hit, false, diverged, lead = score(runs, choice)
            tried += 1
            key = (hit, -false, -choice.changes(), lead)
            if false <= allowed and (best is None or key > best[0]):
                best = (key, false, diverged, choice)
    assert best is not None
    (hit, _, _, lead), false, diverged, choice = best
    note = [
        f"Tuning: {tried} settings tried on the tuning part ({diverged} diverged, {healthy} runs with safe steps; at most "
        f"{allowed} false alarms allowed); chosen: {choice.describe()}; in time {hit}/{diverged}, "
        f"false alarms {false}/{healthy}, median lead {lead} steps."
    ]
    return choice, note


# -- the tables --------------------------------------------------------------------------------
def scored(info: dict[str, Any], run: RunSeries, tuned: Choice) -> Scored:
    fires: dict[str, list[int]] = {"detector (as run, every 2 steps)": run.recorded_warnings()}
    fires[f"detector (replayed, every {DEFAULT_EVERY} steps)"] = fires_of(
        run, Choice(WatchSettings(), 0, DEFAULT_EVERY)
    )
    fires[f"detector (tuned: {tuned.describe()})"] = fires_of(run, tuned)
    fires["detector (today's settings, the first 2x warmup steps not judged)"] = fires_of(
        run, Choice(WatchSettings(), 26, 2)
    )
    for name in WATCH_SIGNALS:
        fires[f"signal: {name}"] = fires_of(run, Choice(WatchSettings(signals=(name,)), 0, 0))
    fires.update(run.baselines())
    return Scored(info["label"], *label(info, run), fires=fires)


def goal_line(part: list[Scored], rule: str) -> str:
    c = counts(part, rule)
    recall = c["in_time"] / c["diverged"] if c["diverged"] else math.nan
    false = c["false_alarms"] / c["safe"] if c["safe"] else math.nan
    met = recall >= GOAL_RECALL and false <= GOAL_FALSE
    return (
        f"Goal (in time >= {GOAL_RECALL:.0%}, false alarms <= {GOAL_FALSE:.0%}) for `{rule}`: in time "
        f"{recall:.0%}, false alarms {false:.0%}: {'met' if met else 'not met'}."
    )


def write(results: list[tuple[dict[str, Any], Scored]], note: list[str]) -> list[str]:
    rules = list(results[0][1].fires)
    with open(HERE / "labels.csv", "w", newline="") as fh:
        writer = csv.writer(fh)
        head = ["label", "part", "model", "optimizer", "kind", "lr", "seed", "status", "at", "safe_until"]
        writer.writerow(head + [f"first after safe steps: {k}" for k in rules])
        for info, s in results:
            part = "tuning" if tuning(info) else "held-out"
            row = [s.name, part, info["model"], info["optimizer"], info["kind"], info["lr"], info["seed"], s.status]
            after = [[x for x in s.fires[k] if s.safe_until is None or x > s.safe_until][:1] for k in rules]
            writer.writerow(row + [s.at, s.safe_until] + [a[0] if a else None for a in after])
    tuned_rule = rules[2]
    lines = [*note, ""]
    for title, part in (
        ("Held-out part (gpt2-tiny seed 2, llama-tiny seeds 0-2)", [s for i, s in results if not tuning(i)]),
        ("Tuning part (gpt2-tiny seeds 0-1)", [s for i, s in results if tuning(i)]),
    ):
        lines += [f"## {title}", "", *lead_table(part, TOKENS_PER_STEP), ""]
        lines += [goal_line(part, rules[0]), goal_line(part, tuned_rule), ""]
    lines.append(f"(in time: lead >= 20 steps, or >= {GOAL_FRACTION:.0%} of the steps before the divergence)")
    (HERE / "table.md").write_text("\n".join(lines) + "\n")
    return lines


def main(argv: list[str]) -> None:
    if argv:
        copy_runs(Path(argv[0]), RUNS)
    runs = load_runs(RUNS)
    tune_on = [(label(info, run), run) for info, run in runs if tuning(info)]
    tuned, note = tune(tune_on)
    results = [(info, scored(info, run, tuned)) for info, run in runs]
    print("\n".join(write(results, note)))


if __name__ == "__main__":
    main(sys.argv[1:])
