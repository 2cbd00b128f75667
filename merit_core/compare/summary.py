"""summary.json: one record per run, read back from its run folder, and the best run per
(optimizer, batch size) by final validation loss.

A run whose training stopped on a non-finite loss, or whose final validation loss is not
finite, is 'diverged': it ranks below every finished run and is reported, never raised.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from merit_core.compare.grid import PlannedRun
from merit_core.compare.runner import read_status

SUMMARY_FILE = "summary.json"


def run_record(run: PlannedRun, state: str) -> dict[str, Any]:
    """What one run gave: final validation loss, max attention logit (max over layers and per
    layer) at the end, and its trajectory (step, val loss, max logit) for the plots."""
    from merit_core.train.metrics import read_metrics

    records = read_metrics(run.run_dir) if run.run_dir.is_dir() else []
    evals = [r for r in records if "val_loss" in r]
    logs = [r for r in records if r.get("loss") is not None]
    final = evals[-1] if evals and evals[-1].get("step") == run.steps else None
    by_layer = final.get("max_attention_logit") if final else None
    logits = [v for v in (by_layer or []) if v is not None]
    val_loss = final.get("val_loss") if final else None
    status = state
    message = read_status(run.run_dir).get("message") if state == "diverged" else None
    if state == "finished" and (val_loss is None or not math.isfinite(val_loss)):
        status, message = "diverged", "the final validation loss is not finite"
    return {
        "name": run.name,
        "optimizer": run.optimizer,
        "batch_size": run.batch_size,
        "lr": run.lr,
        "tokens": run.tokens,
        "steps": run.steps,
        "seq_len": int(run.config.seq_len),
        "status": status,
        "message": message,
        "final_val_loss": val_loss if status == "finished" else None,
        "max_attention_logit": max(logits) if status == "finished" and logits else None,
        "max_attention_logit_by_layer": by_layer if status == "finished" else None,
        "final_train_loss": logs[-1]["loss"] if logs and status == "finished" else None,
        "qk_bound_by_layer": _qk_bounds(run) if status == "finished" else None,
        "last_step": records[-1]["step"] if records else 0,
        "run_dir": str(run.run_dir),
        "curve": {
            "step": [r["step"] for r in evals],
            "val_loss": [r.get("val_loss") for r in evals],
            "max_attention_logit": [_peak(r.get("max_attention_logit")) for r in evals],
        },
    }


def _qk_bounds(run: PlannedRun) -> list[float] | None:
    """||W_Q||_m * ||W_K||_m per layer at the final checkpoint (the paper's bound on the max logit,
    up to input-norm constants), via merit inspect's weight statistics; None if unreadable."""
    from merit_core.diagnostics.weights import weight_stats
    from merit_core.errors import MeritError
    from merit_core.train.checkpoint import latest_checkpoint

    ckpt = latest_checkpoint(run.run_dir)
    if ckpt is None:
        return None
    try:
        return [layer.bound for layer in weight_stats(ckpt, include_other=False).layers]
    except MeritError:
        return None


def _peak(values: list[float | None] | None) -> float | None:
    finite = [v for v in (values or []) if v is not None and math.isfinite(v)]
    return max(finite) if finite else None


def rank_key(record: dict[str, Any]) -> tuple[float, float]:
    """Sort key: lower final validation loss first; diverged and missing runs last; ties -> lower lr."""
    loss = record.get("final_val_loss")
    ok = record.get("status") == "finished" and loss is not None and math.isfinite(loss)
    return (loss if ok else math.inf, record["lr"])


def select_best(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The best run per (optimizer, batch size), in first-seen order, with the grid it came from:
    `grid` (the lrs tried), `n_diverged`, and `lr_at_edge` ('low' / 'high' when the best lr is
    the smallest / largest of a grid of several, so the optimum may lie outside it; else None)."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for record in records:
        groups.setdefault((record["optimizer"], record["batch_size"]), []).append(record)
    best = []
    for group in groups.values():
        winner = min(group, key=rank_key)
        lrs = sorted(r["lr"] for r in group)
        edge = None
        if len(lrs) > 1 and winner["status"] == "finished":
            edge = "low" if winner["lr"] == lrs[0] else "high" if winner["lr"] == lrs[-1] else None
        best.append(
            {**winner, "grid": lrs, "n_diverged": sum(r["status"] == "diverged" for r in group), "lr_at_edge": edge}
        )
    return best


def build_summary(settings: dict[str, Any], runs: list[PlannedRun], states: dict[str, str]) -> dict[str, Any]:
    """{"settings", "runs", "best"}: `runs` drop their curves (they stay on the best entries)."""
    records = [run_record(run, states[run.name]) for run in runs]
    best = select_best(records)
    plain = [{k: v for k, v in r.items() if k != "curve"} for r in records]
    return {"settings": settings, "runs": plain, "best": best}


def write_json(path: Path, data: dict[str, Any]) -> Path:
    """Write `data` as JSON atomically (non-finite floats become null)."""
    from merit_core.train.metrics import json_safe

    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(json_safe(data), indent=2, allow_nan=False) + "\n")
    os.replace(tmp, path)
    return path
