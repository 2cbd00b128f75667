"""The thresholds of `merit inspect`'s verdict (merit_core.diagnostics.verdict), against the grid.

    python results/watch-cpu/verdict_calibration.py

Each run's watch records (metrics/, a probe every 2 steps) are read as a run folder's checkpoints
and judged by the verdict's own code (trajectory_verdicts: level rules on each record, history
rules against the run's first and previous records). A diverged run (analyze.py's rule,
merit_core.instability_rules.divergence_step) is judged on its records before the divergence step D:
what a verdict could have said before the loss went; a healthy run on all its records.

Printed, and written to verdict.md: for each signal, the most extreme value each run reached and, per candidate threshold,
how many diverged and healthy runs reach it; then, with the chosen thresholds (Thresholds'
defaults), how the runs fall into healthy / watch / alarming per signal and overall, at the grid's
cadence and with a checkpoint every 10 steps only. Weight-based signals (the logit bound) need
weights, which the grid did not keep: they are not in these counts.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE))

from analyze import load_runs  # noqa: E402

from merit_core import instability_rules as rules  # noqa: E402
from merit_core.diagnostics import verdict as v  # noqa: E402
from merit_core.instability_rules import divergence_step  # noqa: E402
from merit_core.metric_names import WATCH_ACTIVATION, WATCH_ENTROPY, WATCH_LOG_Z, WATCH_LOGIT, WATCH_UPDATE  # noqa: E402
from merit_core.precursors import Precursors  # noqa: E402

# candidate thresholds per signal, fixed before the sweep (roughly geometric steps); the max logit's
# are fractions of LOGIT_LIMIT
CANDIDATES: dict[str, Sequence[float]] = {
    rules.MAX_LOGIT: (0.125, 0.25, 0.5, 1, 10, 1000),
    rules.LOGIT_GROWTH: (0.25, 0.5, 0.75, 1, 1.5, 2, 3),
    rules.ENTROPY: (0.5, 0.2, 0.05, 0.01, 1e-6),
    rules.LOG_Z: (0.25, 0.5, 1, 1.5, 2, 3),
    rules.ACTIVATION: (1.5, 2, 3, 5, 10, 20),
    rules.UPDATE: (0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5),
}
SCALE = {rules.MAX_LOGIT: rules.LOGIT_LIMIT}  # a candidate times this is the value compared
LOW = {rules.ENTROPY}  # signals where small is bad
# why a default is not the grid's pick (docs/DIAGNOSTICS.md)
FIXED = {
    rules.MAX_LOGIT: "float32 saturation, and a margin of one doubling below it",
    rules.ENTROPY: "about one key (0.05 of log n: 1.3 keys' worth in a row of 256)",
}
# Thresholds' field of each calibrated signal: (watch, alarming)
FIELDS = {
    rules.MAX_LOGIT: ("logit_watch", None),
    rules.LOGIT_GROWTH: ("growth_watch", "growth_alarming"),
    rules.ENTROPY: ("entropy_watch", None),
    rules.LOG_Z: ("log_z_watch", "log_z_alarming"),
    rules.ACTIVATION: ("activation_watch", None),
    rules.UPDATE: ("update_watch", "update_alarming"),
}
COARSE = 10  # the coarser checkpoint cadence (steps)


def _nan(x: Any) -> float:
    return float(x) if isinstance(x, (int, float)) and x is not None else math.nan


def precursors(record: dict[str, Any]) -> Precursors:
    """A watch record as the verdict reads a checkpoint (the grid has no weights: no logit bound)."""
    return Precursors(
        step=int(record["step"]),
        max_logit=record.get(WATCH_LOGIT) or (),
        entropy_min=record.get(WATCH_ENTROPY) or (),
        activation_ratio=record.get(WATCH_ACTIVATION) or (),
        log_z_mean=record.get(WATCH_LOG_Z),
        update_ratio=record.get(WATCH_UPDATE),
    )


def runs() -> list[dict[str, Any]]:
    out = []
    for run in load_runs():
        metrics = run["metrics"]
        losses = [(r["step"], _nan(r["loss"])) for r in metrics if "loss" in r]
        d = divergence_step(losses)
        records = [r for r in metrics if WATCH_LOGIT in r and (d is None or r["step"] < d)]
        out.append({"label": run["info"]["label"], "model": run["info"]["model"], "diverged_at": d, "records": records})
    return out


def judged(records: list[dict[str, Any]], every: int = 2, t: rules.Thresholds | None = None) -> list[v.Verdict]:
    points = [precursors(r) for r in records if r["step"] % every == 0]
    return v.trajectory_verdicts(points, t)


def extremes(verdicts: list[v.Verdict]) -> dict[str, float]:
    """The most extreme value each signal took over a run's checkpoints (a NaN counts as extreme)."""
    out: dict[str, float] = {}
    for verdict in verdicts:
        for s in verdict.signals:
            if s.value is None:
                continue
            value = s.value if not math.isnan(s.value) else (-math.inf if s.signal in LOW else math.inf)
            held = out.get(s.signal)
            if held is None or (value < held if s.signal in LOW else value > held):
                out[s.signal] = value
    return out


def _reaches(r: dict[str, Any], signal: str, threshold: float) -> bool:
    value = r["extreme"].get(signal)
    if value is None:
        return False
    return value < threshold if signal in LOW else value >= threshold


def sweep(results: list[dict[str, Any]]) -> tuple[list[str], dict[str, tuple[float | None, float | None]]]:
    """The sweep's lines, and per signal the thresholds the rule below picks from the candidates.

    watch: the first candidate (in order of severity) that a larger share of the diverged runs than
    of the healthy ones reaches: where the signal starts to tell them apart. If none does, the first
    that no healthy run reaches (beyond what every healthy run showed), else none.
    alarming: the first candidate that no healthy run reaches and at least one diverged run does."""
    lines, picked = [], {}
    for signal, candidates in CANDIDATES.items():
        diverged = [r for r in results if r["diverged_at"] is not None and signal in r["extreme"]]
        healthy = [r for r in results if r["diverged_at"] is None and signal in r["extreme"]]
        scale = SCALE.get(signal, 1.0)
        word = "below" if signal in LOW else "at least"
        lines.append(
            f"{signal} ({rules.RULE_OF[signal]} rule; judged on {len(diverged)} diverged, {len(healthy)} healthy runs):"
        )
        watch = alarming = beyond = None
        for t in candidates:
            nd = sum(_reaches(r, signal, t * scale) for r in diverged)
            nh = sum(_reaches(r, signal, t * scale) for r in healthy)
            shown = f"{t:g} x {scale:g}" if signal in SCALE else f"{t:g}"
            lines.append(f"  {word} {shown:<10} diverged {nd:2d}/{len(diverged)}  healthy {nh:2d}/{len(healthy)}")
            if watch is None and diverged and healthy and nd / len(diverged) > nh / len(healthy):
                watch = t
            if beyond is None and nh == 0:
                beyond = t
            if alarming is None and nh == 0 and nd > 0:
                alarming = t
        if watch is None:
            watch = beyond
        picked[signal] = (watch, alarming)
        lines.append(f"  picked: watch {_show(watch)}, alarming {_show(alarming)}")
    return lines, picked


def _show(t: float | None) -> str:
    return "none" if t is None else f"{t:g}"


def check(picked: dict[str, tuple[float | None, float | None]]) -> list[str]:
    """The picks beside the verdict's defaults: where the grid gives none, the default is a fixed
    float32 scale (docs/DIAGNOSTICS.md says which)."""
    t = rules.Thresholds()
    lines = []
    for signal, (watch, alarming) in picked.items():
        fields = FIELDS[signal]
        used = tuple(getattr(t, f) if f else None for f in fields)
        if signal == rules.MAX_LOGIT:
            used = (used[0], 1.0)  # alarming from LOGIT_LIMIT itself
        same = (watch, alarming) == used
        note = "the grid's pick" if same else f"not the grid's pick: {FIXED.get(signal, 'DIFFERS')}"
        unit = f" x {SCALE[signal]:g}" if signal in SCALE else ""
        lines.append(
            f"- {signal}: Thresholds uses watch {_show(used[0])}{unit}, alarming {_show(used[1])}{unit} ({note})"
        )
    return lines


def _level(verdict: v.Verdict, signal: str) -> str | None:
    if signal.startswith("overall"):
        return rules.worst(s.level for s in verdict.signals if not signal.endswith(s.signal))
    found = verdict.signal(signal)
    return found.level if found else None


def distribution(results: list[dict[str, Any]], key: str, signals: Sequence[str] | None = None) -> list[str]:
    """Per signal (and overall), how many diverged and healthy runs end up at each level."""
    lines = ["| signal | diverged: healthy / watch / alarming | healthy runs: healthy / watch / alarming |"]
    lines.append("|---|---:|---:|")
    for signal in signals or [*CANDIDATES, "overall", f"overall but {rules.MAX_LOGIT}"]:
        cells = []
        for group in (
            [r for r in results if r["diverged_at"] is not None],
            [r for r in results if r["diverged_at"] is None],
        ):
            levels = [_level(r[key], signal) for r in group]
            counts = [levels.count(level) for level in rules.LEVELS]
            cells.append(" / ".join(map(str, counts)) + f" (of {sum(counts)})")
        lines.append(f"| {signal} | {cells[0]} | {cells[1]} |")
    return lines


def picked_thresholds(picked: dict[str, tuple[float | None, float | None]]) -> rules.Thresholds:
    """Thresholds with the grid's picks where the defaults take them (not the fixed scales)."""
    fields: dict[str, Any] = {}
    for signal, (watch, alarming) in picked.items():
        if signal in FIXED:
            continue
        watch_field, alarming_field = FIELDS[signal]
        if watch is not None:
            fields[watch_field] = watch
        if alarming_field:
            fields[alarming_field] = alarming
    return dataclasses.replace(rules.Thresholds(), **fields)


def held_out(results: list[dict[str, Any]]) -> list[str]:
    """Thresholds picked on one model's runs, the verdict counted on the other model's runs."""
    signal = f"overall but {rules.MAX_LOGIT}"
    lines = [
        "| picked on | judged on | thresholds picked | diverged: healthy / watch / alarming | healthy: healthy / watch / alarming |",
        "|---|---|---|---:|---:|",
    ]
    models = sorted({r["model"] for r in results})
    for fit in models:
        for test in (m for m in models if m != fit):
            _, picked = sweep([r for r in results if r["model"] == fit])
            t = picked_thresholds(picked)
            shown = ", ".join(f"{s} {_show(w)}/{_show(a)}" for s, (w, a) in picked.items() if s not in FIXED)
            judged_runs = [
                dict(r, held=v.run_verdict(judged(r["records"], 2, t), [])) for r in results if r["model"] == test
            ]
            row = distribution(judged_runs, "held", [signal])[-1].split(" | ")[1:]
            lines.append(f"| {fit} | {test} | {shown} | {row[0]} | {row[1]}")
    return lines


def report(results: list[dict[str, Any]]) -> list[str]:
    """Everything the script prints (and writes to verdict.md)."""
    for r in results:
        verdicts = judged(r["records"])
        r["extreme"] = extremes(verdicts)
        r["run"] = v.run_verdict(verdicts, [p.step for p in map(precursors, r["records"])])
        r["coarse"] = v.run_verdict(judged(r["records"], COARSE), [])
    diverged = sum(r["diverged_at"] is not None for r in results)
    lines, picked = sweep(results)
    return [
        f"{len(results)} runs: {diverged} diverged (judged before the divergence step), {len(results) - diverged} healthy.",
        "",
        "    " + "\n    ".join(lines),  # a code block: the sweep is aligned text
        "",
        f"merit_core.diagnostics.verdict.{rules.Thresholds()}:",
        "",
        *check(picked),
        "",
        "Runs by their run verdict (the worst level over the run's records), a record every 2 steps:",
        "",
        *distribution(results, "run"),
        "",
        f"The same with a checkpoint every {COARSE} steps (diverged runs with no record before D are not judged):",
        "",
        *distribution(results, "coarse"),
        "",
        f"Held out by model (the rule above on one model's runs; overall but {rules.MAX_LOGIT} on the other's, every 2 steps):",
        "",
        *held_out(results),
    ]


def main() -> None:
    lines = report(runs())
    (HERE / "verdict.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
