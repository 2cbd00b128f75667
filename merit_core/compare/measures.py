"""What a comparison measures on each best run's final checkpoint after training: the loss
landscape's sharpness (`--hessian`) and zero-shot task scores (`--eval`).

- Sharpness: the largest and smallest algebraic and the largest-magnitude Hessian eigenvalue (Lanczos) and Hutchinson trace of the validation
  loss, with `merit inspect`'s estimators (merit_core.diagnostics.hessian), on one fixed batch:
  the first HESSIAN_SEQUENCES windows of the training's first validation batch (the batch the
  max attention logit is measured on, built with the run's eval_batches and eval_batch_size so
  the windows are the training's own; the same windows for every run, since validation batches
  do not depend on the seed).
- Zero-shot: `merit eval`'s harness (merit_core.evaluation.evaluate_checkpoints) on the given
  lm-eval tasks, local task YAMLs included through `include_path`.

Each result is kept in the run folder (HESSIAN_FILE, EVAL_FILE) with the settings that made it,
so re-running the comparison measures only what is new. Every seed of a best cell is measured,
and the cell reports mean, spread and each value (as for the loss).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from merit_core.checkpoint.resolve import SafetensorsReader, find_checkpoints, latest_checkpoint
from merit_core.checkpoint.run_config import read_run_config
from merit_core.compare.environment import floored_spread
from merit_core.compare.spec import EvalRequest
from merit_core.compare.summary import spread
from merit_core.data import open_tokens
from merit_core.diagnostics.checkpoint_model import load_model
from merit_core.diagnostics.hessian import model_hessian
from merit_core.durable_writes import atomic_write_json
from merit_core.errors import CheckpointError
from merit_core.evaluation import EvalSettings, evaluate_checkpoints
from merit_core.evaluation.results import CheckpointResult, metric_rows
from merit_core.metrics import json_safe
from merit_core.train.batches import val_batches

HESSIAN_FILE = "compare_hessian.json"
EVAL_FILE = "compare_eval.json"
# What the cached numbers mean: a result saved under another method is measured again.
HESSIAN_METHOD = "largest and smallest algebraic eigenvalue (Lanczos, full reorthogonalisation); the training's first validation batch"
HESSIAN_ITERS = 20  # Lanczos steps (at least 10; stops earlier once the top Ritz pair's residual is < 0.1%)
HUTCHINSON_SAMPLES = 10
HESSIAN_SEED = 0
# Sequences of the fixed batch: the first HESSIAN_SEQUENCES windows of the first validation batch.
# Each Hessian-vector product is a double backward through eager attention, several times the cost
# of a training step on the same tokens, and a comparison measures every seed of every best cell.
HESSIAN_SEQUENCES = 4
# The paper's figures for GPT-2 Small at batch 1k (docs/MERIT.md, "Paper results"), shown beside ours.
PAPER = {
    "hessian": {
        "model": "GPT-2 Small",
        # "top eigenvalue" as the paper reports it (PyHessian's power iteration: the largest magnitude)
        "top_eigenvalue": {"adamw": 37.2, "merit": 12.3},
        "trace": {"adamw": 12995.0, "merit": 3445.0},
    },
    "zero_shot": {"model": "GPT-2", "average": {"adamw": 43.56, "merit": 43.87}},
}


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _write(path: Path, data: dict[str, Any]) -> None:
    atomic_write_json(path, json_safe(data), indent=2, allow_nan=False)


def _final_checkpoint(run_dir: Path) -> tuple[int, Path]:
    latest = latest_checkpoint(run_dir)
    if latest is None:
        raise CheckpointError(f"{run_dir} has no checkpoint to measure")
    return latest


# -- sharpness --------------------------------------------------------------------------------
def run_hessian(run_dir: str | Path, data_dir: str | Path, device: str = "cpu") -> dict[str, Any]:
    """Extreme Hessian eigenvalues and Hutchinson trace of the run's final checkpoint on its first
    validation batch: {"largest_algebraic_eigenvalue", "smallest_algebraic_eigenvalue",
    "largest_magnitude_eigenvalue", "eigen_iters", "eigen_converged",
    "trace", "trace_stderr", "trace_samples", "step", "sequences", "seq_len", "seed"} (read back
    when already measured)."""
    import torch

    run_dir = Path(run_dir)
    step, ckpt_dir = _final_checkpoint(run_dir)
    config = read_run_config(run_dir)
    if config is None:
        raise CheckpointError(f"{run_dir} has no run configuration to measure with")
    sequences, seq_len = min(int(config.get("eval_batch_size", 16)), HESSIAN_SEQUENCES), int(config["seq_len"])
    settings = {
        "step": step,
        "sequences": sequences,
        "seq_len": seq_len,
        "seed": HESSIAN_SEED,
        "iters": HESSIAN_ITERS,
        "samples": HUTCHINSON_SAMPLES,
        "method": HESSIAN_METHOD,
    }
    cached = _read(run_dir / HESSIAN_FILE)
    if cached and all(cached.get(k) == v for k, v in settings.items()):
        return cached
    (ckpt,) = find_checkpoints(ckpt_dir)
    model = load_model(ckpt, SafetensorsReader(ckpt), device)
    batches, batch_size = int(config.get("eval_batches", 4)), int(config.get("eval_batch_size", 16))
    first = val_batches(open_tokens(data_dir, "val"), batches, batch_size, seq_len)[0][0]
    ids = first[:sequences].to(device)
    torch.manual_seed(HESSIAN_SEED)
    estimate = model_hessian(model, ids, HESSIAN_ITERS, HUTCHINSON_SAMPLES, HESSIAN_SEED)
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    result = {**settings, **estimate.to_dict(), "device": device}
    _write(run_dir / HESSIAN_FILE, result)
    return result


HESSIAN_KEYS = (
    "largest_algebraic_eigenvalue",
    "smallest_algebraic_eigenvalue",
    "largest_magnitude_eigenvalue",
    "trace",
)


def hessian_cell(measured: list[dict[str, Any]]) -> dict[str, Any]:
    """A best cell's sharpness over its seeds: mean, std and values of the eigenvalue and trace."""
    out: dict[str, Any] = {}
    for key in HESSIAN_KEYS:
        values = [m.get(key) for m in measured]
        out[key], out[f"{key}_std"] = spread(values)
        out[f"{key}_values"] = values
    out["eigen_converged"] = [bool(m.get("eigen_converged")) for m in measured]
    out["trace_stderr_values"] = [m.get("trace_stderr") for m in measured]
    first = measured[0] if measured else {}
    out["batch"] = {k: first.get(k) for k in ("sequences", "seq_len", "step")}
    out["estimator"] = {k: first.get(k) for k in ("iters", "samples", "seed")}
    return out


def hessian_spread(original: dict[str, Any], rerun: dict[str, Any]) -> dict[str, Any]:
    """The environment spread of a cell's Hessian numbers: its first seed's values against its
    environment re-run's, per key `<key>_original`, `<key>_rerun` and `<key>_spread` (|difference|)."""
    out: dict[str, Any] = {}
    for key in HESSIAN_KEYS:
        a, b = original.get(key), rerun.get(key)
        out[f"{key}_original"], out[f"{key}_rerun"] = a, b
        out[f"{key}_spread"] = abs(b - a) if a is not None and b is not None else None
    return out


def hessian_environment(spreads: list[dict[str, Any]]) -> dict[str, Any]:
    """A best cell's Hessian environment spread over its environment samples (`hessian_spread` each):
    per key the sample that moved it most (`<key>_original`, `<key>_rerun`) and `<key>_spread`, the
    largest |difference|, never below the key's floor (environment.floored_spread)."""
    out: dict[str, Any] = {}
    for key in HESSIAN_KEYS:
        measured = [s for s in spreads if s.get(f"{key}_spread") is not None]
        top = max(measured, key=lambda s: s[f"{key}_spread"]) if measured else {}
        out[f"{key}_original"], out[f"{key}_rerun"] = top.get(f"{key}_original"), top.get(f"{key}_rerun")
        out[f"{key}_spread"] = floored_spread([s[f"{key}_spread"] for s in measured], top.get(f"{key}_original"), key)
    out["samples"] = len(spreads)
    return out


# -- zero-shot --------------------------------------------------------------------------------
def run_eval(run_dirs: list[Path], request: EvalRequest, device: str = "auto") -> list[dict[str, Any]]:
    """lm-eval results of each run's final checkpoint ({"step", "tasks", ..., "results", "meta"}),
    evaluating in one harness call only the runs without a matching result in their folder."""
    wanted = {"tasks": list(request.tasks), "include_path": request.include_path, "limit": request.limit}
    results: dict[Path, dict[str, Any]] = {}
    todo: list[tuple[Path, int, Path]] = []
    for run_dir in run_dirs:
        step, ckpt = _final_checkpoint(run_dir)
        cached = _read(run_dir / EVAL_FILE)
        if cached.get("step") == step and all(cached.get(k) == v for k, v in wanted.items()):
            results[run_dir] = cached
        else:
            todo.append((run_dir, step, ckpt))
    if todo:
        settings = EvalSettings(
            tasks=list(request.tasks), include_path=request.include_path, device=device, limit=request.limit
        )
        records = evaluate_checkpoints([str(ckpt) for _, _, ckpt in todo], settings)
        for (run_dir, step, _), record in zip(todo, records):
            entry = {"step": step, **wanted, "results": record.results, "meta": record.meta}
            _write(run_dir / EVAL_FILE, entry)
            results[run_dir] = _read(run_dir / EVAL_FILE)
    return [results[run_dir] for run_dir in run_dirs]


def eval_cell(measured: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A best cell's zero-shot scores over its seeds: one row per (task, metric) with the mean,
    std and each seed's value, and whether higher is better (as lm-eval says)."""
    records = [CheckpointResult(path="", label="", results=m["results"], meta=m.get("meta", {})) for m in measured]
    rows = []
    for row in metric_rows(records):
        mean, std = spread(list(row.values))
        rows.append(
            {
                "task": row.task,
                "metric": row.metric,
                "higher_is_better": row.higher_is_better,
                "value": mean,
                "std": std,
                "values": list(row.values),
                "stderr_values": list(row.stderrs),
            }
        )
    return rows
