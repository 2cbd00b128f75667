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

Every record is typed from the line that builds it (merit_core.compare.results): a run is a
`RunResult` with its validation `Curve` beside it (`RunRead`), a cell a `CellResult`, a best entry a
`BestResult`; `CompareSummary.to_dict()` is summary.json.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from merit_core.checkpoint.resolve import latest_checkpoint
from merit_core.compare import stability
from merit_core.compare.environment import FLOORS, floored_spread
from merit_core.compare.grid import PlannedRun
from merit_core.compare.precursor_table import instability_record
from merit_core.compare.results import (
    BestResult,
    CellResult,
    CompareSettings,
    CompareSummary,
    Curve,
    EnvironmentCheck,
    EnvironmentSample,
    RunResult,
    SeedCurve,
)
from merit_core.compare.runner import read_status, replaced, state_now
from merit_core.diagnostics.weights import weight_stats
from merit_core.durable_writes import atomic_write_json
from merit_core.errors import MeritError
from merit_core.metric_names import MAX_ATTENTION_LOGIT, STEP, VAL_LOSS
from merit_core.metrics import METRICS_FILE, eval_lines, json_safe, read_metrics
from merit_core.precursors import over_layers

SUMMARY_FILE = "summary.json"
CELL_KEYS = ("final_val_loss", MAX_ATTENTION_LOGIT, "final_train_loss", "tokens_per_s")


# The statuses whose run or cell keeps its numbers (an unstable one finished, with finite values).
VALUED = ("finished", "unstable")


class RunRead(NamedTuple):
    """One run read back from its folder: its record and its validation trajectory (the plots'
    curve, kept on the best entries only)."""

    result: RunResult
    curve: Curve


def run_record(run: PlannedRun, state: str, host_isa: str | None = None) -> RunRead:
    """What one run gave: final validation loss, max attention logit (max over layers and per
    layer) at the end, and its trajectory (step, val loss, max logit) for the plots. `host_isa`:
    the ISA torch dispatches to on this host, recorded as the run's unless it forced another."""
    if state == "missing":
        gone: str | None = state_now(run)[1] or "its run folder no longer holds the run"
    else:
        gone = replaced(run.run_dir)
    unread = None
    try:
        records = read_metrics(run.run_dir) if gone is None and run.run_dir.is_dir() else []
    except (ValueError, MeritError) as exc:  # lines or a file merit never wrote
        records, unread = [], f"its {METRICS_FILE} is not one merit wrote ({exc})"
    evals = eval_lines(records)
    logs = [r for r in records if r.get("loss") is not None]
    final = evals[-1] if evals and evals[-1].get("step") == run.steps else None
    by_layer = final.get(MAX_ATTENTION_LOGIT) if final else None
    peak_logit = over_layers(MAX_ATTENTION_LOGIT, by_layer)  # max over layers
    val_loss = final.get(VAL_LOSS) if final else None
    status = state
    message = read_status(run.run_dir).get("message") if state == "diverged" and gone is None else None
    if gone is not None or unread is not None:
        status, message = "missing", gone or unread
    elif state == "finished" and not records:
        status, message = "missing", "its run folder holds no metrics (removed after the run finished)"
    elif state == "finished" and final is None:
        status, message = (
            "missing",
            f"its {METRICS_FILE} holds no evaluation at its last step (changed after the run finished)",
        )
    elif state == "finished" and (val_loss is None or not math.isfinite(val_loss)):
        status, message = "diverged", "the final validation loss is not finite"
    elif state == "finished":
        why = stability.run_unstable(peak_logit)
        if why is not None:
            status, message = "unstable", why
    kept = status in VALUED
    result = RunResult(
        name=run.name,
        optimizer=run.optimizer,
        batch_size=run.batch_size,
        lr=run.lr,
        seed=run.seed,
        threads=run.threads,
        perturbation=None if run.perturbation is None else run.perturbation.describe(),
        cpu_capability=host_isa
        if run.perturbation is None or run.perturbation.kind != "isa"
        else run.perturbation.value.upper(),
        tokens=run.tokens,
        steps=run.steps,
        seq_len=int(run.config.seq_len),
        status=status,
        message=message,
        final_val_loss=val_loss if kept else None,
        max_attention_logit=peak_logit if kept else None,
        max_attention_logit_by_layer=by_layer if kept else None,
        final_train_loss=logs[-1]["loss"] if logs and kept else None,
        tokens_per_s=_median([r.get("tokens_per_s") for r in logs]),
        qk_bound_by_layer=_qk_bounds(run) if kept else None,
        instability=instability_record(final) if kept else None,
        last_step=records[-1].get(STEP, 0) if records else 0,
        run_dir=str(run.run_dir),
    )
    curve = Curve(
        step=[r.get(STEP, 0) for r in evals],
        val_loss=[r.get(VAL_LOSS) for r in evals],
        max_attention_logit=[_peak(r.get(MAX_ATTENTION_LOGIT)) for r in evals],
    )
    return RunRead(result, curve)


def _qk_bounds(run: PlannedRun) -> list[float] | None:
    """||W_Q||_m * ||W_K||_m per layer at the final checkpoint (the paper's bound on the max logit,
    up to input-norm constants), via merit inspect's weight statistics; None if unreadable."""
    latest = latest_checkpoint(run.run_dir)
    if latest is None:
        return None
    try:
        return [layer.bound for layer in weight_stats(latest[1], include_other=False).layers]
    except MeritError:
        return None


def _median(values: list[float | None]) -> float | None:
    """The median of the finite values (a run's training speed over its log lines), None without any."""
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.median(finite) if finite else None


def _peak(values: list[float | None] | None) -> float | None:
    finite = [v for v in (values or []) if v is not None and math.isfinite(v)]
    return max(finite) if finite else None


def rank_key(record: RunResult) -> tuple[int, float, float]:
    """Sort key of a run or cell: finished before unstable before diverged and missing; then lower
    (mean) final validation loss; ties -> lower lr."""
    loss = record.final_val_loss
    valued = record.status in VALUED and loss is not None and math.isfinite(loss)
    rank = 0 if record.status == "finished" and valued else 1 if valued else 2
    return (rank, float(loss) if valued and loss is not None else math.inf, float(record.lr))


def spread(values: list[float | None]) -> tuple[float | None, float | None]:
    """(mean, sample standard deviation) of the finite values; std None below two values."""
    finite = [v for v in values if v is not None and math.isfinite(v)]
    if not finite or len(finite) < len(values):
        return None, None
    return statistics.fmean(finite), statistics.stdev(finite) if len(finite) > 1 else None


def aggregate(group: list[RunResult], keys: tuple[str, ...]) -> dict[str, Any]:
    """`key`, `key_std` and `key_values` for each key over the runs of one cell (seed order): the
    CellResult fields of those names."""
    out: dict[str, Any] = {}
    for key in keys:
        values = [r.value(key) for r in group]
        out[key], out[f"{key}_std"] = spread(values)
        out[f"{key}_values"] = values
    return out


def cell_record(group: list[RunResult]) -> CellResult:
    """One (optimizer, batch, lr) cell: its first seed's record with the seed means, spreads and values."""
    group = sorted(group, key=lambda r: r.seed)
    cell = CellResult.extend(
        group[0],
        **aggregate(group, CELL_KEYS),
        seeds=[r.seed for r in group],
        run_names=[r.name for r in group],
    )
    for status in ("diverged", "missing", "unstable"):
        failed = [r for r in group if r.status == status]
        if failed:
            cell.status = status
            cell.message = "; ".join(f"seed {r.seed}: {r.message}" for r in failed)
            break
    if cell.status not in VALUED:
        cell.final_val_loss = cell.max_attention_logit = cell.final_train_loss = cell.tokens_per_s = None
        cell.max_attention_logit_by_layer = None
    return cell


def cells(records: list[RunResult]) -> list[CellResult]:
    """One record per (optimizer, batch size, lr), in first-seen order (see `cell_record`), with the
    loss rule of stability applied within each (optimizer, batch size) grid (`judge_grid`)."""
    groups: dict[tuple[str, int, float], list[RunResult]] = {}
    for record in records:
        groups.setdefault((record.optimizer, record.batch_size, record.lr), []).append(record)
    table = [cell_record(group) for group in groups.values()]
    grids: dict[tuple[str, int], list[CellResult]] = {}
    for cell in table:
        grids.setdefault((cell.optimizer, cell.batch_size), []).append(cell)
    for grid in grids.values():
        judge_grid(grid)
    return table


def judge_grid(grid: list[CellResult]) -> None:
    """Mark 'unstable' (in place) each finished cell of one grid whose lr is above the best finished
    cell's and whose mean loss is far above it (stability.loss_unstable)."""
    finished = [c for c in grid if rank_key(c)[0] == 0]
    if not finished:
        return
    top = min(finished, key=rank_key)
    for cell in finished:
        why = stability.loss_unstable(cell.lr, cell.final_val_loss, top.lr, top.final_val_loss)
        if why is not None:
            cell.status, cell.message = "unstable", why


def select_best(records: list[RunResult], curves: Mapping[str, Curve] | None = None) -> list[BestResult]:
    """The best cell per (optimizer, batch size) by mean final validation loss over its seeds, in
    first-seen order (an unstable, diverged or missing cell only when no cell finished), with the
    grid it came from: `grid` (the lrs tried), `n_diverged` and `n_unstable` (runs), and
    `lr_at_edge` ('low' / 'high' when the best lr is the smallest / largest of a grid of several,
    so the optimum may lie outside it; else None). `curves` (run name -> its Curve): the best
    entry's `curve` (its first seed's) and `seed_curves` (each seed's that `curves` holds)."""
    curves = curves or {}
    groups: dict[tuple[str, int], list[RunResult]] = {}
    for record in records:
        groups.setdefault((record.optimizer, record.batch_size), []).append(record)
    best = []
    for group in groups.values():
        table = cells(group)
        winner = min(table, key=rank_key)
        lrs = sorted({r.lr for r in group})
        edge = None
        if len(lrs) > 1 and winner.status == "finished":
            edge = "low" if winner.lr == lrs[0] else "high" if winner.lr == lrs[-1] else None
        unstable = {c.lr for c in table if c.status == "unstable"}
        seeds = zip(winner.seeds, winner.run_names)
        best.append(
            BestResult.extend(
                winner,
                grid=lrs,
                n_diverged=sum(r.status == "diverged" for r in group),
                n_unstable=sum(r.status == "unstable" or r.lr in unstable for r in group),
                lr_at_edge=edge,
                curve=curves.get(winner.run_names[0]),
                seed_curves=[SeedCurve(seed, **vars(curves[name])) for seed, name in seeds if name in curves],
            )
        )
    return best


ENV_KEYS = ("final_val_loss", MAX_ATTENTION_LOGIT)


def environment_check(entry: CellResult, reruns: list[RunResult]) -> EnvironmentCheck:
    """A best cell's environment spread from its environment re-runs (`reruns`: its seeds trained
    again under perturbations, environment.py): per sample both values and |difference|; per key
    `<key>_spread`, the largest difference over the samples and never below the key's floor
    (environment.floored_spread; None when no sample finished), with `<key>_original` and
    `<key>_rerun` of the sample that moved it most; `run` and `seed`: the first sample's; `threads`:
    the thread count of the thread-count sample (None without one)."""
    seeds = entry.seeds or [entry.seed]
    samples = []
    for rerun in reruns:
        index = seeds.index(rerun.seed) if rerun.seed in seeds else 0
        figures: dict[str, float | None] = {}
        for key in ENV_KEYS:
            original = ((entry.value(f"{key}_values") or [entry.value(key)]) + [None] * len(seeds))[index]
            again = rerun.value(key) if rerun.status in VALUED else None
            ok = original is not None and again is not None and math.isfinite(original) and math.isfinite(again)
            figures[f"{key}_original"], figures[f"{key}_rerun"] = original, again
            figures[f"{key}_difference"] = abs(again - original) if ok and again is not None else None
        samples.append(
            EnvironmentSample(
                run=rerun.name,
                seed=rerun.seed,
                perturbation=rerun.perturbation,
                threads=rerun.threads,
                cpu_capability=rerun.cpu_capability,
                status=rerun.status,
                **figures,
            )
        )
    first = samples[0] if samples else EnvironmentSample(status="missing")
    spreads: dict[str, Any] = {}  # EnvironmentCheck fields: <key>_original, _rerun, _spread, _floor
    for key in ENV_KEYS:
        measured = [s for s in samples if s.value(f"{key}_difference") is not None]
        top = max(measured, key=lambda s: s.value(f"{key}_difference")) if measured else first
        original = top.value(f"{key}_original")
        spreads[f"{key}_original"], spreads[f"{key}_rerun"] = original, top.value(f"{key}_rerun")
        spreads[f"{key}_spread"] = floored_spread(
            [s.value(f"{key}_difference") for s in measured],
            float(original) if isinstance(original, (int, float)) else None,
            key,
        )
        spreads[f"{key}_floor"] = FLOORS[key]
    return EnvironmentCheck(
        run=first.run,
        seed=first.seed,
        threads=next((s.threads for s in samples if s.threads is not None), None),
        status=next((s.status for s in samples if s.status not in VALUED), first.status),
        samples=samples,
        **spreads,
    )


def build_summary(settings: CompareSettings | None, runs: list[PlannedRun], states: dict[str, str]) -> CompareSummary:
    """The typed summary (`to_dict()`: {"settings", "runs", "cells", "best"}) of the runs read back
    from their folders: the curves stay on the best entries. Environment re-runs (a PlannedRun with
    a perturbation) stay out of the cells and the ranking: they are listed in `runs` and each best
    entry's `environment` weighs them against its seeds (`environment_check`; None without one).
    `settings` None: the defaults (a round's ranking)."""
    host_isa = ((settings.environment if settings else None) or {}).get("cpu_capability")
    read = [run_record(run, states[run.name], host_isa) for run in runs]
    records = [r.result for r in read]
    curves = {r.result.name: r.curve for r in read}
    grid = [r for r in records if r.perturbation is None]
    reruns: dict[tuple[str, int, float], list[RunResult]] = {}
    for r in records:
        if r.perturbation is not None:
            reruns.setdefault((r.optimizer, r.batch_size, r.lr), []).append(r)
    best = select_best(grid, curves)
    for entry in best:
        found = reruns.get((entry.optimizer, entry.batch_size, entry.lr))
        entry.environment = None if not found else environment_check(entry, found)
    return CompareSummary(settings=settings or CompareSettings(), runs=records, cells=cells(grid), best=best)


def write_json(path: Path, data: dict[str, Any]) -> Path:
    """Write `data` as JSON atomically (non-finite floats become null)."""
    return atomic_write_json(path, json_safe(data), indent=2, allow_nan=False)
