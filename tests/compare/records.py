"""Typed records for the compare tests, built as merit_core.compare.summary builds them from run folders
(nothing is trained): a run's `RunResult` with its `Curve`, a cell's seeds, best entries with a measured
environment spread, and a small two-optimizer summary."""

from __future__ import annotations

from merit_core.compare.grid import run_name
from merit_core.compare.results import BestResult, CompareSettings, CompareSummary, Curve, EnvironmentCheck, RunResult
from merit_core.compare.summary import select_best


def record(optimizer: str, batch: int, lr: float, loss: float | None, status: str = "finished", logit: float = 5.0):
    """One run at 1024 tokens: `loss` its final validation loss, `logit` its max attention logit (kept
    only when it finished, with the per-layer values logit / 2 and logit)."""
    finished = status == "finished"
    return RunResult(
        name=run_name(optimizer, batch, lr),
        optimizer=optimizer,
        batch_size=batch,
        lr=lr,
        tokens=1024,
        steps=1024 // batch,
        status=status,
        final_val_loss=loss,
        max_attention_logit=logit if finished else None,
        max_attention_logit_by_layer=[logit / 2, logit] if finished else None,
        message=None if finished else "non-finite",
        run_dir="x",
    )


def curve(run: RunResult) -> Curve:
    """A run's validation trajectory: 8.0 at step 0, its final loss and max logit at step 10."""
    return Curve(step=[0, 10], val_loss=[8.0, run.final_val_loss], max_attention_logit=[1.0, run.max_attention_logit])


def seeded(optimizer, batch, lr, losses, logits=None, statuses=None) -> list[RunResult]:
    """One run per seed (0, 1, ...) of a cell, with the given final losses, logits and statuses."""
    out = []
    for seed, loss in enumerate(losses):
        status = (statuses or ["finished"] * len(losses))[seed]
        r = record(optimizer, batch, lr, loss, status, logit=(logits or [5.0] * len(losses))[seed])
        r.seed = seed
        r.name += f"-s{seed}" if seed else ""
        out.append(r)
    return out


def best_of(records: list[RunResult]) -> list[BestResult]:
    """The best entries of the runs, with each run's curve (as build_summary passes them)."""
    return select_best(records, {r.name: curve(r) for r in records})


def with_env(entries: list[BestResult], loss_spread=0.01, logit_spread=0.5) -> list[BestResult]:
    """Give best entries a measured environment spread (as summary.environment_check writes it)."""
    for e in entries:
        e.environment = EnvironmentCheck(final_val_loss_spread=loss_spread, max_attention_logit_spread=logit_spread)
    return entries


def settings(**changes) -> CompareSettings:
    """gpt2-tiny, adamw and merit at batches 8 and 64, 1024 tokens per run, one seed; `changes` set on top."""
    base = CompareSettings(
        model="gpt2-tiny",
        n_params=1_350_400,
        optimizers=["adamw", "merit"],
        batch_sizes=[8, 64],
        seq_len=128,
        tokens=1024,
        tokens_per_run=1024,
        steps={"8": 128, "64": 16},
        data="built-in",
        lr_rule="given lists",
        lr_grids=[],
        warmup_steps={"8": 12, "64": 1},
        min_lr_ratio=0.1,
        grad_clip=1.0,
        seed=0,
        dtype="auto",
        eval_tokens=8192,
    )
    for key, value in changes.items():
        setattr(base, key, value)
    return base


def synthetic_summary() -> CompareSummary:
    """adamw and merit at batches 8 and 64, two lrs each, one seed; merit lower at both batches, its
    lr 1e-2 at batch 64 diverged."""
    records = [
        record("adamw", 8, 1e-3, 3.50, logit=20.0),
        record("adamw", 8, 3e-3, 3.80, logit=30.0),
        record("merit", 8, 1e-3, 3.40, logit=4.0),
        record("merit", 8, 3e-3, 3.45, logit=6.0),
        record("adamw", 64, 3e-3, 3.90, logit=40.0),
        record("adamw", 64, 1e-2, 4.00, logit=50.0),
        record("merit", 64, 3e-3, 3.60, logit=5.0),
        record("merit", 64, 1e-2, None, "diverged"),
    ]
    return CompareSummary(settings=settings(), runs=records, best=best_of(records))
