"""summary.json: one record per run, read back from its run folder; one cell per (optimizer,
batch size, lr) over its seeds; and the best cell per (optimizer, batch size) by mean final
validation loss.

A run whose training stopped on a non-finite loss, or whose final validation loss is not
finite, is 'diverged': it ranks below every finished run and is reported, never raised. A cell
is 'diverged' when any of its seeds diverged (an lr that fails on one seed is not a safe best).
A cell's numbers are the mean over its seeds, with `<key>_std` (sample standard deviation,
None for one seed) and `<key>_values` (each seed's value, in seed order) beside them.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from merit_core.checkpoint import runs
from merit_core.compare.grid import PlannedRun
from merit_core.compare.instability import KEY as INSTABILITY
from merit_core.compare.instability import instability_record
from merit_core.compare.results import BestResult, CellResult, CompareSettings, CompareSummary, RunResult
from merit_core.compare.runner import read_status
from merit_core.diagnostics.weights import weight_stats
from merit_core.errors import MeritError
from merit_core.fileio import atomic_write_json
from merit_core.metric_names import MAX_ATTENTION_LOGIT, VAL_LOSS
from merit_core.metrics import eval_lines, json_safe, read_metrics

SUMMARY_FILE = "summary.json"
CELL_KEYS = ("final_val_loss", MAX_ATTENTION_LOGIT, "final_train_loss", "tokens_per_s")


def run_record(run: PlannedRun, state: str) -> dict[str, Any]:
    """What one run gave: final validation loss, max attention logit (max over layers and per
    layer) at the end, and its trajectory (step, val loss, max logit) for the plots."""
    records = read_metrics(run.run_dir) if run.run_dir.is_dir() else []
    evals = eval_lines(records)
    logs = [r for r in records if r.get("loss") is not None]
    final = evals[-1] if evals and evals[-1].get("step") == run.steps else None
    by_layer = final.get(MAX_ATTENTION_LOGIT) if final else None
    logits = [v for v in (by_layer or []) if v is not None]
    val_loss = final.get(VAL_LOSS) if final else None
    status = state
    message = read_status(run.run_dir).get("message") if state == "diverged" else None
    if state == "finished" and (val_loss is None or not math.isfinite(val_loss)):
        status, message = "diverged", "the final validation loss is not finite"
    return {
        "name": run.name,
        "optimizer": run.optimizer,
        "batch_size": run.batch_size,
        "lr": run.lr,
        "seed": run.seed,
        "threads": run.threads,
        "tokens": run.tokens,
        "steps": run.steps,
        "seq_len": int(run.config.seq_len),
        "status": status,
        "message": message,
        "final_val_loss": val_loss if status == "finished" else None,
        MAX_ATTENTION_LOGIT: max(logits) if status == "finished" and logits else None,
        "max_attention_logit_by_layer": by_layer if status == "finished" else None,
        "final_train_loss": logs[-1]["loss"] if logs and status == "finished" else None,
        "tokens_per_s": _median([r.get("tokens_per_s") for r in logs]),
        "qk_bound_by_layer": _qk_bounds(run) if status == "finished" else None,
        INSTABILITY: instability_record(final) if status == "finished" else None,
        "last_step": records[-1]["step"] if records else 0,
        "run_dir": str(run.run_dir),
        "curve": {
            "step": [r["step"] for r in evals],
            VAL_LOSS: [r.get(VAL_LOSS) for r in evals],
            MAX_ATTENTION_LOGIT: [_peak(r.get(MAX_ATTENTION_LOGIT)) for r in evals],
        },
    }


def _qk_bounds(run: PlannedRun) -> list[float] | None:
    """||W_Q||_m * ||W_K||_m per layer at the final checkpoint (the paper's bound on the max logit,
    up to input-norm constants), via merit inspect's weight statistics; None if unreadable."""
    ckpt = runs.latest(run.run_dir)
    if ckpt is None:
        return None
    try:
        return [layer.bound for layer in weight_stats(ckpt, include_other=False).layers]
    except MeritError:
        return None


def _median(values: list[float | None]) -> float | None:
    """The median of the finite values (a run's training speed over its log lines), None without any."""
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.median(finite) if finite else None


def _peak(values: list[float | None] | None) -> float | None:
    finite = [v for v in (values or []) if v is not None and math.isfinite(v)]
    return max(finite) if finite else None


def rank_key(record: dict[str, Any]) -> tuple[float, float]:
    """Sort key: lower (mean) final validation loss first; diverged and missing last; ties -> lower lr."""
    loss = record.get("final_val_loss")
    ok = record.get("status") == "finished" and loss is not None and math.isfinite(loss)
    return (loss if ok else math.inf, record["lr"])


def spread(values: list[float | None]) -> tuple[float | None, float | None]:
    """(mean, sample standard deviation) of the finite values; std None below two values."""
    finite = [v for v in values if v is not None and math.isfinite(v)]
    if not finite or len(finite) < len(values):
        return None, None
    return statistics.fmean(finite), statistics.stdev(finite) if len(finite) > 1 else None


def aggregate(group: list[dict[str, Any]], keys: tuple[str, ...]) -> dict[str, Any]:
    """`key`, `key_std` and `key_values` for each key over the records of one cell (seed order)."""
    out: dict[str, Any] = {}
    for key in keys:
        values = [r.get(key) for r in group]
        out[key], out[f"{key}_std"] = spread(values)
        out[f"{key}_values"] = values
    return out


def cell_record(group: list[dict[str, Any]]) -> dict[str, Any]:
    """One (optimizer, batch, lr) cell: its first seed's record with the seed means, spreads and values."""
    group = sorted(group, key=lambda r: r.get("seed", 0))
    first = group[0]
    failed = [r for r in group if r["status"] != "finished"]
    cell = {**first, **aggregate(group, CELL_KEYS)}
    cell["seeds"] = [r.get("seed", 0) for r in group]
    cell["run_names"] = [r["name"] for r in group]
    cell["seed_curves"] = [{"seed": r.get("seed", 0), **r["curve"]} for r in group if "curve" in r]
    if failed:
        cell["status"] = "diverged"
        cell["message"] = "; ".join(f"seed {r.get('seed', 0)}: {r.get('message')}" for r in failed)
        for key in CELL_KEYS:
            cell[key] = None
        cell["max_attention_logit_by_layer"] = None
    return cell


def cells(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per (optimizer, batch size, lr), in first-seen order (see `cell_record`)."""
    groups: dict[tuple[str, int, float], list[dict[str, Any]]] = {}
    for record in records:
        groups.setdefault((record["optimizer"], record["batch_size"], record["lr"]), []).append(record)
    return [cell_record(group) for group in groups.values()]


def select_best(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The best cell per (optimizer, batch size) by mean final validation loss over its seeds, in
    first-seen order, with the grid it came from: `grid` (the lrs tried), `n_diverged` (runs),
    and `lr_at_edge` ('low' / 'high' when the best lr is the smallest / largest of a grid of
    several, so the optimum may lie outside it; else None)."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for record in records:
        groups.setdefault((record["optimizer"], record["batch_size"]), []).append(record)
    best = []
    for group in groups.values():
        winner = min(cells(group), key=rank_key)
        lrs = sorted({r["lr"] for r in group})
        edge = None
        if len(lrs) > 1 and winner["status"] == "finished":
            edge = "low" if winner["lr"] == lrs[0] else "high" if winner["lr"] == lrs[-1] else None
        best.append(
            {**winner, "grid": lrs, "n_diverged": sum(r["status"] == "diverged" for r in group), "lr_at_edge": edge}
        )
    return best


ENV_KEYS = ("final_val_loss", MAX_ATTENTION_LOGIT)


def environment_check(entry: dict[str, Any], rerun: dict[str, Any]) -> dict[str, Any]:
    """A best cell's environment spread: its first seed's run against the same run re-trained
    under another thread count (`rerun`), per key: both values and |difference| (`<key>_spread`;
    None when either did not finish)."""
    out: dict[str, Any] = {"run": rerun["name"], "seed": rerun["seed"], "threads": rerun["threads"]}
    out["status"] = rerun["status"]
    for key in ENV_KEYS:
        original = (entry.get(f"{key}_values") or [entry.get(key)])[0]
        again = rerun.get(key) if rerun["status"] == "finished" else None
        out[f"{key}_original"], out[f"{key}_rerun"] = original, again
        ok = original is not None and again is not None and math.isfinite(original) and math.isfinite(again)
        out[f"{key}_spread"] = abs(again - original) if ok else None
    return out


def build_summary(settings: CompareSettings | None, runs: list[PlannedRun], states: dict[str, str]) -> CompareSummary:
    """The typed summary (`to_dict()`: {"settings", "runs", "cells", "best"}) of the runs read back
    from their folders: `runs` and `cells` drop their curves (they stay on the best entries).
    Environment re-runs (a PlannedRun with `threads`) stay out of the cells and the ranking: they
    are listed in `runs` and each best entry's `environment` compares one with its original
    (`environment_check`; None without one). `settings` None: the defaults (a round's ranking)."""
    records = [run_record(run, states[run.name]) for run in runs]
    grid = [r for r in records if r.get("threads") is None]
    reruns = {(r["optimizer"], r["batch_size"], r["lr"]): r for r in records if r.get("threads") is not None}
    best = select_best(grid)
    for entry in best:
        rerun = reruns.get((entry["optimizer"], entry["batch_size"], entry["lr"]))
        entry["environment"] = None if rerun is None else environment_check(entry, rerun)
    plain = [{k: v for k, v in r.items() if k != "curve"} for r in records]
    table = [{k: v for k, v in c.items() if k not in ("curve", "seed_curves")} for c in cells(grid)]
    return CompareSummary(
        settings=settings or CompareSettings(),
        runs=[RunResult.from_dict(r, built=True) for r in plain],
        best=[BestResult.from_dict(b, built=True) for b in best],
        cells=[CellResult.from_dict(c, built=True) for c in table],
    )


def write_json(path: Path, data: dict[str, Any]) -> Path:
    """Write `data` as JSON atomically (non-finite floats become null)."""
    return atomic_write_json(path, json_safe(data), indent=2, allow_nan=False)
