"""Labels and the lead-time table of the watch-cpu grid (see grid.py).

    python results/watch-cpu/analyze.py GRID_DIR     # the grid's run folders: copies their metrics, writes the table
    python results/watch-cpu/analyze.py              # the table again from the copies in metrics/

The divergence rule (merit_core.instability_rules.divergence_step): a run diverged at the first step D whose training loss is
non-finite, or whose loss and the mean loss of the 5 steps D..D+4 are both more than 1 nat above the
lowest loss of the steps before D; a run with no such step is healthy. A rule fires at the first step it warns; on a diverged run its lead is the
divergence step minus that step (a warning after the divergence is a miss), in steps and in tokens
(steps x 512 tokens). Rows:

- detector (as run): the first warning written by `merit train --watch` in the run's metrics.jsonl;
- detector (replayed): merit_core.train.watch_detector.replay over the run's recorded watch records with the
  detector's current settings: what `merit train --watch` gives now. The row above is what it gave
  when the grid ran; the two differ only if the detector changed after the grid;
- one row per signal: the detector restricted to that signal (replayed, entropy included);
- the two spike rules (merit_core.instability_rules.BASELINE_RULES), on every step's loss and grad norm: OLMo-core's StabilityMonitor (a value
  above mean + 6 std of the previous 128, from 16 values on), and ZClip's (Kumar et al. 2025) grad
  norm z-score above 2.5 against an EMA (alpha 0.97) of the mean and variance, started from the
  mean and variance of the first 10 steps, updated with the clipped norm as ZClip does.

Recall: diverged runs warned at or before the divergence step. Goal: the lead is >= 20 steps or
>= 10% of the steps before the divergence. False alarms: healthy runs with any warning.
"""

from __future__ import annotations

import csv
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from merit_core.instability_rules import divergence_step, spike_step, zclip_step  # noqa: E402

sys.path.insert(0, str(HERE.parent / "watch-train"))
import analyze as watch_train  # noqa: E402  (results/watch-train/analyze.py: the runs' copies)

RUNS = HERE / "metrics"
TOKENS_PER_STEP = 16 * 32


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def copy_runs(grid: Path) -> None:
    """Each finished run's config (done.json) and metrics, rounded to 5 digits, into metrics/<label>.jsonl."""
    watch_train.copy_runs(grid, RUNS)


def load_runs() -> list[dict[str, Any]]:
    runs = []
    for path in sorted(RUNS.glob("*.jsonl")):
        records = [json.loads(line) for line in path.read_text().splitlines()]
        runs.append({"info": records[0]["run"], "metrics": records[1:]})
    return runs


def _nan(x: Any) -> float:
    return float(x) if _finite(x) else math.nan


def evaluate(run: dict[str, Any]) -> dict[str, Any]:
    """Divergence step and the first firing step of every rule, for one run."""
    from merit_core.instability_rules import WATCH_SIGNALS as SIGNALS
    from merit_core.instability_rules import WatchSettings
    from merit_core.metric_names import WATCH_LOSS, WATCH_WARNINGS
    from merit_core.train.watch_detector import replay

    info, metrics = run["info"], run["metrics"]
    logs = [r for r in metrics if "loss" in r]
    watch = [r for r in metrics if WATCH_LOSS in r]
    losses = [(r["step"], _nan(r["loss"])) for r in logs]
    grads = [(r["step"], _nan(r["grad_norm"])) for r in logs]
    recorded = [w for r in watch for w in r.get(WATCH_WARNINGS) or ()]
    warmup = 0  # as merit train's watcher runs it: the warmup steps are judged too
    fires: dict[str, int | None] = {
        "detector (as run)": recorded[0]["step"] if recorded else None,
    }
    found = replay(watch, warmup)
    fires["detector (replayed)"] = found[0].step if found else None
    first_signal = found[0].signal if found else None
    for name in SIGNALS:
        hits = replay(watch, warmup, WatchSettings(signals=(name,)))
        fires[f"signal: {name}"] = hits[0].step if hits else None
    spikes = [s for s in (spike_step(losses), spike_step(grads)) if s is not None]
    fires["spike: loss > mean+6sd (128)"] = spike_step(losses)
    fires["spike: grad norm > mean+6sd (128)"] = spike_step(grads)
    fires["spike: loss or grad norm"] = min(spikes) if spikes else None
    fires["ZClip: grad-norm EMA z > 2.5"] = zclip_step(grads)
    return {
        "label": info["label"],
        "model": info["model"],
        "optimizer": info["optimizer"],
        "lr": info["lr"],
        "seed": info["seed"],
        "steps_run": logs[-1]["step"] if logs else 0,
        "diverged_at": divergence_step(losses),
        "first_signal": first_signal,
        "fires": fires,
    }


def _median(xs: list[float]) -> str:
    return f"{statistics.median(xs):g}" if xs else "-"


def table(results: list[dict[str, Any]]) -> list[str]:
    diverged = [r for r in results if r["diverged_at"] is not None]
    healthy = [r for r in results if r["diverged_at"] is None]
    rows = list(results[0]["fires"]) if results else []
    out = [
        f"{len(results)} runs: {len(diverged)} diverged, {len(healthy)} healthy.",
        "",
        "| rule | recall (warned <= divergence) | goal met (lead >= 20 steps or >= 10%) | median lead, steps "
        "| median lead, tokens | min / max lead | false alarms on healthy runs |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for rule in rows:
        leads = [r["diverged_at"] - r["fires"][rule] for r in diverged if _fired_before(r, rule)]
        goal = [r for r in diverged if _fired_before(r, rule) and _lead(r, rule) >= min(20, 0.1 * r["diverged_at"])]
        false = [r for r in healthy if r["fires"][rule] is not None]
        span = f"{min(leads)} / {max(leads)}" if leads else "-"
        tokens = [lead * TOKENS_PER_STEP for lead in leads]
        out.append(
            f"| {rule} | {len(leads)}/{len(diverged)} | {len(goal)}/{len(diverged)} | {_median(leads)} "
            f"| {_median(tokens)} | {span} | {len(false)}/{len(healthy)} |"
        )
    return out


def _fired_before(r: dict[str, Any], rule: str) -> bool:
    return r["fires"][rule] is not None and r["fires"][rule] <= r["diverged_at"]


def _lead(r: dict[str, Any], rule: str) -> int:
    return r["diverged_at"] - r["fires"][rule]


def halving_table(results: list[dict[str, Any]]) -> list[str]:
    """For each diverged run: did the run at half its lr (same model, optimizer, seed) stay healthy?"""
    by_key = {(r["model"], r["optimizer"], r["seed"], round(r["lr"], 8)): r for r in results}
    pairs, healthy = 0, 0
    for r in results:
        if r["diverged_at"] is None:
            continue
        half = by_key.get((r["model"], r["optimizer"], r["seed"], round(r["lr"] / 2, 8)))
        if half is not None:
            pairs += 1
            healthy += half["diverged_at"] is None
    return [f"Diverged runs whose half-lr twin (same model, optimizer, seed) stayed healthy: {healthy}/{pairs}."]


def write(results: list[dict[str, Any]]) -> list[str]:
    with open(HERE / "labels.csv", "w", newline="") as fh:
        rules = list(results[0]["fires"]) if results else []
        writer = csv.writer(fh)
        writer.writerow(
            ["label", "model", "optimizer", "lr", "seed", "steps_run", "diverged_at", "first_signal", *rules]
        )
        for r in results:
            writer.writerow(
                [
                    r[k]
                    for k in ("label", "model", "optimizer", "lr", "seed", "steps_run", "diverged_at", "first_signal")
                ]
                + [r["fires"][k] for k in rules]
            )
    lines = table(results) + [""] + halving_table(results)
    (HERE / "table.md").write_text("\n".join(lines) + "\n")
    return lines


def main(argv: list[str]) -> None:
    if argv:
        copy_runs(Path(argv[0]))
    results = [evaluate(run) for run in load_runs()]
    print("\n".join(write(results)))


if __name__ == "__main__":
    main(sys.argv[1:])
