"""summary.json: one record per run, read back from its run folder; one cell per (optimizer,
batch size, lr) over its seeds; and the best cell per (optimizer, batch size) by mean final
validation loss.

A run whose training stopped on a non-finite loss, or whose final validation loss is not
finite, is 'diverged': it ranks below every finished run and is reported, never raised. A run
that finished with a finite loss but an attention logit past stability.LOGIT_LIMIT, or a cell
whose lr is above its grid's best and whose loss is far above the best's
(stability.LOSS_EXCESS), is 'unstable': its numbers are kept and shown, but it ranks below
every finished cell and is never a best lr. A run whose folder no longer holds its final
evaluation (removed after it finished) is 'missing' (the comparison trains it again first).
A cell is 'diverged' when any of its seeds diverged (an lr that fails on one seed is not a
safe best), else 'missing' or 'unstable' when any seed is. A cell's numbers are the mean over
its seeds, with `<key>_std` (sample standard deviation, None for one seed) and `<key>_values`
(each seed's value, in seed order) beside them.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from merit_core.checkpoint import runs
from merit_core.compare import stability
from merit_core.compare.environment import FLOORS, floored_spread
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


# The statuses whose run or cell keeps its numbers (an unstable one finished, with finite values).
VALUED = ("finished", "unstable")


def run_record(run: PlannedRun, state: str, host_isa: str | None = None) -> dict[str, Any]:
    """What one run gave: final validation loss, max attention logit (max over layers and per
    layer) at the end, and its trajectory (step, val loss, max logit) for the plots. `host_isa`:
    the ISA torch dispatches to on this host, recorded as the run's unless it forced another."""
    records = read_metrics(run.run_dir) if run.run_dir.is_dir() else []
    evals = eval_lines(records)
    logs = [r for r in records if r.get("loss") is not None]
    final = evals[-1] if evals and evals[-1].get("step") == run.steps else None
    by_layer = final.get(MAX_ATTENTION_LOGIT) if final else None
    logits = [v for v in (by_layer or []) if v is not None]
    val_loss = final.get(VAL_LOSS) if final else None
    status = state
    message = read_status(run.run_dir).get("message") if state == "diverged" else None
    if state == "finished" and not records:
        status, message = "missing", "its run folder holds no metrics (removed after the run finished)"
    elif state == "finished" and (val_loss is None or not math.isfinite(val_loss)):
        status, message = "diverged", "the final validation loss is not finite"
    elif state == "finished":
        why = stability.run_unstable(max(logits) if logits else None)
        if why is not None:
            status, message = "unstable", why
    kept = status in VALUED
    return {
        "name": run.name,
        "optimizer": run.optimizer,
        "batch_size": run.batch_size,
        "lr": run.lr,
        "seed": run.seed,
        "threads": run.threads,
        "perturbation": None if run.perturbation is None else run.perturbation.describe(),
        "cpu_capability": host_isa
        if run.perturbation is None or run.perturbation.kind != "isa"
        else run.perturbation.value.upper(),
        "tokens": run.tokens,
        "steps": run.steps,
        "seq_len": int(run.config.seq_len),
        "status": status,
        "message": message,
        "final_val_loss": val_loss if kept else None,
        MAX_ATTENTION_LOGIT: max(logits) if kept and logits else None,
        "max_attention_logit_by_layer": by_layer if kept else None,
        "final_train_loss": logs[-1]["loss"] if logs and kept else None,
        "tokens_per_s": _median([r.get("tokens_per_s") for r in logs]),
        "qk_bound_by_layer": _qk_bounds(run) if kept else None,
        INSTABILITY: instability_record(final) if kept else None,
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


def rank_key(record: dict[str, Any]) -> tuple[int, float, float]:
    """Sort key: finished before unstable before diverged and missing; then lower (mean) final
    validation loss; ties -> lower lr."""
    loss = record.get("final_val_loss")
    valued = record.get("status") in VALUED and loss is not None and math.isfinite(loss)
    rank = 0 if record.get("status") == "finished" and valued else 1 if valued else 2
    return (rank, float(loss) if valued and loss is not None else math.inf, float(record["lr"]))


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
    cell = {**first, **aggregate(group, CELL_KEYS)}
    cell["seeds"] = [r.get("seed", 0) for r in group]
    cell["run_names"] = [r["name"] for r in group]
    cell["seed_curves"] = [{"seed": r.get("seed", 0), **r["curve"]} for r in group if "curve" in r]
    for status in ("diverged", "missing", "unstable"):
        failed = [r for r in group if r["status"] == status]
        if failed:
            cell["status"] = status
            cell["message"] = "; ".join(f"seed {r.get('seed', 0)}: {r.get('message')}" for r in failed)
            break
    if cell["status"] not in VALUED:
        for key in CELL_KEYS:
            cell[key] = None
        cell["max_attention_logit_by_layer"] = None
    return cell


def cells(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per (optimizer, batch size, lr), in first-seen order (see `cell_record`), with the
    loss rule of stability applied within each (optimizer, batch size) grid (`judge_grid`)."""
    groups: dict[tuple[str, int, float], list[dict[str, Any]]] = {}
    for record in records:
        groups.setdefault((record["optimizer"], record["batch_size"], record["lr"]), []).append(record)
    table = [cell_record(group) for group in groups.values()]
    grids: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for cell in table:
        grids.setdefault((cell["optimizer"], cell["batch_size"]), []).append(cell)
    for grid in grids.values():
        judge_grid(grid)
    return table


def judge_grid(grid: list[dict[str, Any]]) -> None:
    """Mark 'unstable' (in place) each finished cell of one grid whose lr is above the best finished
    cell's and whose mean loss is far above it (stability.loss_unstable)."""
    finished = [c for c in grid if rank_key(c)[0] == 0]
    if not finished:
        return
    top = min(finished, key=rank_key)
    for cell in finished:
        why = stability.loss_unstable(cell["lr"], cell["final_val_loss"], top["lr"], top["final_val_loss"])
        if why is not None:
            cell["status"], cell["message"] = "unstable", why


def select_best(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The best cell per (optimizer, batch size) by mean final validation loss over its seeds, in
    first-seen order (an unstable, diverged or missing cell only when no cell finished), with the
    grid it came from: `grid` (the lrs tried), `n_diverged` and `n_unstable` (runs), and
    `lr_at_edge` ('low' / 'high' when the best lr is the smallest / largest of a grid of several,
    so the optimum may lie outside it; else None)."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for record in records:
        groups.setdefault((record["optimizer"], record["batch_size"]), []).append(record)
    best = []
    for group in groups.values():
        table = cells(group)
        winner = min(table, key=rank_key)
        lrs = sorted({r["lr"] for r in group})
        edge = None
        if len(lrs) > 1 and winner["status"] == "finished":
            edge = "low" if winner["lr"] == lrs[0] else "high" if winner["lr"] == lrs[-1] else None
        unstable = {c["lr"] for c in table if c["status"] == "unstable"}
        best.append(
            {
                **winner,
                "grid": lrs,
                "n_diverged": sum(r["status"] == "diverged" for r in group),
                "n_unstable": sum(r["status"] == "unstable" or r["lr"] in unstable for r in group),
                "lr_at_edge": edge,
            }
        )
    return best


ENV_KEYS = ("final_val_loss", MAX_ATTENTION_LOGIT)


def environment_check(entry: dict[str, Any], reruns: list[dict[str, Any]]) -> dict[str, Any]:
    """A best cell's environment spread from its environment re-runs (`reruns`: its seeds trained
    again under perturbations, environment.py): per sample both values and |difference|; per key
    `<key>_spread`, the largest difference over the samples and never below the key's floor
    (environment.floored_spread; None when no sample finished), with `<key>_original` and
    `<key>_rerun` of the sample that moved it most; `run` and `seed`: the first sample's; `threads`:
    the thread count of the thread-count sample (None without one)."""
    seeds = entry.get("seeds") or [entry.get("seed", 0)]
    samples = []
    for rerun in reruns:
        index = seeds.index(rerun["seed"]) if rerun["seed"] in seeds else 0
        sample: dict[str, Any] = {
            "run": rerun["name"],
            "seed": rerun["seed"],
            "perturbation": rerun.get("perturbation"),
            "threads": rerun.get("threads"),
            "cpu_capability": rerun.get("cpu_capability"),
            "status": rerun["status"],
        }
        for key in ENV_KEYS:
            original = ((entry.get(f"{key}_values") or [entry.get(key)]) + [None] * len(seeds))[index]
            again = rerun.get(key) if rerun["status"] in VALUED else None
            ok = original is not None and again is not None and math.isfinite(original) and math.isfinite(again)
            sample[f"{key}_original"], sample[f"{key}_rerun"] = original, again
            sample[f"{key}_difference"] = abs(again - original) if ok else None
        samples.append(sample)
    first = samples[0] if samples else {"run": "", "seed": 0, "threads": None, "status": "missing"}
    out: dict[str, Any] = {k: first[k] for k in ("run", "seed", "status")}
    out["threads"] = next((s["threads"] for s in samples if s["threads"] is not None), None)
    if any(s["status"] not in VALUED for s in samples):
        out["status"] = next(s["status"] for s in samples if s["status"] not in VALUED)
    for key in ENV_KEYS:
        measured = [s for s in samples if s[f"{key}_difference"] is not None]
        top = max(measured, key=lambda s: s[f"{key}_difference"]) if measured else first
        original = top.get(f"{key}_original")
        out[f"{key}_original"], out[f"{key}_rerun"] = original, top.get(f"{key}_rerun")
        out[f"{key}_spread"] = floored_spread(
            [s[f"{key}_difference"] for s in measured],
            float(original) if isinstance(original, (int, float)) else None,
            key,
        )
        out[f"{key}_floor"] = FLOORS[key]
    out["samples"] = samples
    return out


def build_summary(settings: CompareSettings | None, runs: list[PlannedRun], states: dict[str, str]) -> CompareSummary:
    """The typed summary (`to_dict()`: {"settings", "runs", "cells", "best"}) of the runs read back
    from their folders: `runs` and `cells` drop their curves (they stay on the best entries).
    Environment re-runs (a PlannedRun with a perturbation) stay out of the cells and the ranking:
    they are listed in `runs` and each best entry's `environment` weighs them against its seeds
    (`environment_check`; None without one). `settings` None: the defaults (a round's ranking)."""
    host_isa = ((settings.environment if settings else None) or {}).get("cpu_capability")
    records = [run_record(run, states[run.name], host_isa) for run in runs]
    grid = [r for r in records if r.get("perturbation") is None]
    reruns: dict[tuple[str, int, float], list[dict[str, Any]]] = {}
    for r in records:
        if r.get("perturbation") is not None:
            reruns.setdefault((r["optimizer"], r["batch_size"], r["lr"]), []).append(r)
    best = select_best(grid)
    for entry in best:
        found = reruns.get((entry["optimizer"], entry["batch_size"], entry["lr"]))
        entry["environment"] = None if not found else environment_check(entry, found)
    plain = [{k: v for k, v in r.items() if k != "curve"} for r in records]
    table = [{k: v for k, v in c.items() if k not in ("curve", "seed_curves")} for c in cells(grid)]
    return CompareSummary(
        settings=settings or CompareSettings(),
        runs=[RunResult.from_dict(r) for r in plain],
        best=[BestResult.from_dict(b) for b in best],
        cells=[CellResult.from_dict(c) for c in table],
    )


def write_json(path: Path, data: dict[str, Any]) -> Path:
    """Write `data` as JSON atomically (non-finite floats become null)."""
    return atomic_write_json(path, json_safe(data), indent=2, allow_nan=False)
