"""The rules a comparison's verdicts follow, computed from the comparison's typed records alone
(merit_core.compare.results).

A difference between two cells is *resolved* only when their seeds' ranges do not overlap and the
gap exceeds both cells' measured environment spreads (the same run in another floating-point
environment); a paper claim holds only when resolved against every other optimizer. A smoke run
(one lr per cell) gives no verdict at all. compare/markdown_report.py writes these into REPORT.md, the
terminal and compare.png read the same functions.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any, Protocol, TypeGuard, TypeVar

from merit_core.compare.results import BestResult, CompareSummary, Measured, RunResult
from merit_core.metric_names import MAX_ATTENTION_LOGIT


class Figures(Protocol):
    """What `mean_std`, `resolution` and the claims read `<key>`, `<key>_std`, `<key>_values` and
    `environment.<key>_spread` of: a cell or best entry (results.CellResult), or a record of the
    same shape that measures or a claim computes (results.Measured: a Hessian cell, a zero-shot row,
    a loss change between batch sizes)."""

    def value(self, key: str) -> Any: ...


def lookup(entry: Figures, key: str) -> Any:
    """`entry`'s `key` (None when it has none)."""
    return entry.value(key)


def num(value: float | None) -> float:
    """A number a finished record holds (a finished cell's loss, its max logit once checked)."""
    if value is None:
        raise ValueError("a finished record without its number")
    return value


C = TypeVar("C", bound=RunResult)


def fmt(value: float | None, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:.{digits}f}" if abs(value) < 1000 else f"{value:.0f}"


def fmt_lr(value: float) -> str:
    return f"{value:.3g}"


def is_finished(entry: C | None) -> TypeGuard[C]:
    return entry is not None and entry.finished


def mean_std(entry: Figures, key: str, digits: int = 4) -> str:
    """'mean' or 'mean ± std' (std over seeds, when there are several)."""
    std = lookup(entry, f"{key}_std")
    text = fmt(lookup(entry, key), digits)
    return text if std is None else f"{text} ± {fmt(std, digits)}"


def seed_values(entry: Figures, key: str) -> list[float]:
    values = lookup(entry, f"{key}_values")
    if values is None:
        values = [lookup(entry, key)]
    return [v for v in values if v is not None and math.isfinite(v)]


def env_spread(entry: Figures, key: str) -> float | None:
    """How far the floating-point environment alone moved this cell's `key`: |re-run - original| of
    its first seed under another thread count (summary.environment_check), None when not measured."""
    env = lookup(entry, "environment")
    value = None if env is None else lookup(env, f"{key}_spread")
    return value if value is not None and math.isfinite(value) else None


@dataclass(frozen=True)
class Resolution:
    """Whether a difference between two cells is resolved, and why (the text the report prints)."""

    resolved: bool | None  # None: one seed, the spread was not measured
    text: str


def resolution(a: Figures, b: Figures, key: str = "final_val_loss") -> Resolution:
    """A difference is resolved only when (1) the seeds resolve it: every seed value of one cell lies
    below every seed value of the other, and (2) the gap between the means exceeds the environment
    spread: the sum of both cells' environment spreads (`env_spread`; each cell may move that far
    under a change of thread count, in opposite directions). Without a measured environment spread
    (no environment check, or a key it does not cover) nothing is resolved."""
    va, vb = seed_values(a, key), seed_values(b, key)
    if len(va) < 2 or len(vb) < 2:
        return Resolution(None, "not resolved: one seed, spread not measured")
    n = min(len(va), len(vb))
    if not (max(va) < min(vb) or max(vb) < min(va)):
        return Resolution(False, f"not resolved: within the spread of {n} seeds")
    ea, eb = env_spread(a, key), env_spread(b, key)
    if ea is None or eb is None:
        return Resolution(False, f"not resolved: apart over {n} seeds, but the environment spread was not measured")
    gap = abs(sum(va) / len(va) - sum(vb) / len(vb))
    digits = 2 if key == MAX_ATTENTION_LOGIT else 4
    if gap <= ea + eb:
        return Resolution(
            False,
            f"not resolved: apart over {n} seeds, but the gap {fmt(gap, digits)} is within the environment "
            f"spread {fmt(ea + eb, digits)}",
        )
    return Resolution(True, f"resolved by {n} seeds and beyond the environment spread {fmt(ea + eb, digits)}")


def resolved(a: Figures, b: Figures, key: str = "final_val_loss") -> bool | None:
    """`resolution(a, b, key).resolved`: True, False, or None with one seed each."""
    return resolution(a, b, key).resolved


def resolution_text(a: Figures, b: Figures, key: str = "final_val_loss") -> str:
    return resolution(a, b, key).text


def findings(summary: CompareSummary) -> list[str]:
    """The bullet points of 'What the numbers show'."""
    best = summary.best_table()
    optimizers = summary.settings.optimizers
    batches = summary.settings.batch_sizes
    reason = no_verdict(summary)
    if reason:
        return [f"**no verdict**: {reason}", *_smoke_lines(best, optimizers, batches)]
    lines = []
    for batch in batches:
        lines.append(_loss_line(batch, [best.get((o, batch)) for o in optimizers]))
    if len(batches) > 1:
        lines.extend(_degradation_lines(best, optimizers, batches[0], batches[-1]))
    for batch in (batches[-1], batches[0]) if len(batches) > 1 else (batches[0],):
        line = _logit_line(batch, [best.get((o, batch)) for o in optimizers])
        if line:
            lines.append(line)
    bound = _bound_line(batches[-1], [best.get((o, batches[-1])) for o in optimizers])
    if bound:
        lines.append(bound)
    lines.extend(_claim_lines(best, optimizers, batches))
    return lines


# What a comparison without lr grids says instead of a verdict, in REPORT.md and on the terminal.
SMOKE = "no verdict: smoke run"


def _smoke_lines(best: Best, optimizers: list[str], batches: list[int]) -> list[str]:
    """A smoke run's numbers, in the optimizers' order: no ranking, no best lr, no ratios."""
    lines = []
    for batch in batches:
        parts = []
        for name in optimizers:
            e = best.get((name, batch))
            if e is None:
                continue
            value = (
                f"loss {mean_std(e, 'final_val_loss')}, max logit {mean_std(e, MAX_ATTENTION_LOGIT, 2)}"
                if is_finished(e)
                else "diverged"
            )
            parts.append(f"{name} at lr {fmt_lr(e.lr)}: {value}")
        lines.append(f"Batch {batch} (one lr each, in the order given): " + "; ".join(parts) + ".")
    return lines


def no_verdict(summary: CompareSummary) -> str | None:
    """Why the paper's claims get no verdict from this comparison, or None when they may.

    A verdict compares optimizers at their best lr, which needs an lr grid: a smoke run (--quick)
    or a cell with a single lr says nothing about any optimizer at its best."""
    if summary.settings.quick:
        return (
            "this is a smoke run (--quick: one lr per optimizer and batch, half the tokens); no optimizer "
            "was tuned, so nothing here bears on the paper's claims. Run `merit compare` without "
            "--quick for them."
        )
    single = [f"{b.optimizer} b{b.batch_size}" for b in summary.best if len(b.grid or []) < 2]
    if single:
        return (
            f"one lr only for {', '.join(single)}: a cell without an lr grid is not tuned, so the "
            "claims are not checked (give several lrs, or lrs = 'auto')."
        )
    return None


def _loss_line(batch: int, entries: list[BestResult | None]) -> str:
    ranked = sorted((e for e in entries if is_finished(e)), key=lambda e: num(e.final_val_loss))
    failed = [e.optimizer for e in entries if e is not None and not is_finished(e)]
    tail = f" Diverged at every learning rate tried: {', '.join(failed)}." if failed else ""
    if not ranked:
        return f"**Batch {batch}:** no optimizer finished with a finite validation loss.{tail}"
    top = ranked[0]
    text = (
        f"**Batch {batch}:** {top.optimizer} had the lowest final validation loss, "
        f"{mean_std(top, 'final_val_loss')} (lr {fmt_lr(top.lr)})"
    )
    if len(ranked) == 1:
        return text + "." + tail
    gaps = [
        f"{e.optimizer} {mean_std(e, 'final_val_loss')} (+{fmt(num(e.final_val_loss) - num(top.final_val_loss))}, "
        f"{100 * (num(e.final_val_loss) / num(top.final_val_loss) - 1):+.1f}%"
        + ("" if resolved(top, e) is None else f"; {resolution_text(top, e)}")
        + ")"
        for e in ranked[1:]
    ]
    return f"{text}; then {', '.join(gaps)}.{tail}"


Best = dict[tuple[str, int], BestResult]


def _degradation_lines(best: Best, optimizers: list[str], small: int, large: int) -> list[str]:
    rows = []
    for name in optimizers:
        a, b = best.get((name, small)), best.get((name, large))
        if is_finished(a) and is_finished(b):
            rows.append((name, num(b.final_val_loss) - num(a.final_val_loss), a, b))
    if not rows:
        return []
    rows.sort(key=lambda r: r[1])
    parts = [f"{name} {fmt(a.final_val_loss)} -> {fmt(b.final_val_loss)} ({delta:+.4f})" for name, delta, a, b in rows]
    line = (
        f"**Batch {small} -> {large}** (same tokens, {large / small:.3g}x fewer steps), best-lr validation loss: "
        + "; ".join(parts)
        + "."
    )
    if len(rows) > 1:
        line += (
            f" The smallest change: {rows[0][0]} ({rows[0][1]:+.4f}); the largest: {rows[-1][0]} ({rows[-1][1]:+.4f})"
        )
        first, last = _seed_deltas(rows[0][2], rows[0][3]), _seed_deltas(rows[-1][2], rows[-1][3])
        line += f" ({resolution_text(first, last, 'change')})." if len(first.value("change_values")) > 1 else "."
    return [line]


def _seed_deltas(small: BestResult, large: BestResult) -> Measured:
    """The loss change from the small to the large batch, seed by seed (same seeds, paired), with the
    environment spread of a change: the sum of both cells' (None when either is not measured); a
    record of `Figures`' shape for `resolution`."""
    a, b = seed_values(small, "final_val_loss"), seed_values(large, "final_val_loss")
    values = [y - x for x, y in zip(a, b)] if len(a) == len(b) else []
    ea, eb = env_spread(small, "final_val_loss"), env_spread(large, "final_val_loss")
    env = None if ea is None or eb is None else Measured({"change_spread": ea + eb})  # each end may move that far
    return Measured({"change": None, "change_values": values}, environment=env)


def _logit_line(batch: int, entries: list[BestResult | None]) -> str | None:
    ranked = sorted(
        (e for e in entries if is_finished(e) and e.max_attention_logit is not None),
        key=lambda e: num(e.max_attention_logit),
    )
    if not ranked:
        return None
    several = any(len(e.seeds or []) > 1 for e in ranked)
    where = "layer {layer} in seed {seed}" if several else "layer {layer}"
    parts = [
        f"{e.optimizer} {mean_std(e, MAX_ATTENTION_LOGIT, 2)} "
        f"({where.format(layer=_argmax(e), seed=(e.seeds or [e.seed])[0])})"
        for e in ranked
    ]
    line = f"**Max attention logit at the end, batch {batch}** (best-lr runs, max over layers): {', '.join(parts)}."
    lo, hi = num(ranked[0].max_attention_logit), num(ranked[-1].max_attention_logit)
    if len(ranked) > 1 and lo > 0:
        line += f" The largest is {hi / lo:.2f}x the smallest."
    return line


def _bound_line(batch: int, entries: list[BestResult | None]) -> str | None:
    """The max-norm bound term ||W_Q||_m * ||W_K||_m at the end (max over layers), lowest first."""
    done = [e for e in entries if is_finished(e)]
    rows = sorted((max(e.qk_bound_by_layer), e.optimizer) for e in done if e.qk_bound_by_layer)
    if not rows:
        return None
    seeds = next((e.seeds for e in done if e.seeds), None) or []
    which = f"; seed {seeds[0]}'s run of each" if len(seeds) > 1 else ""
    return (
        f"**||W_Q||_m x ||W_K||_m at the end, batch {batch}** (the max-norm product that bounds the logit; "
        f"max over layers{which}): " + ", ".join(f"{name} {value:.3g}" for value, name in rows) + "."
    )


def _argmax(entry: BestResult) -> str:
    layers = entry.max_attention_logit_by_layer or []
    values = [(v, i) for i, v in enumerate(layers) if v is not None]
    return str(max(values)[1]) if values else "-"  # layers count from 0, as in merit train and inspect


def _claim_lines(best: Best, optimizers: list[str], batches: list[int]) -> list[str]:
    """The paper's claims, checked against these numbers (only when MERIT and a baseline ran), at
    every batch size, largest first: each holds only when MERIT is better than every other
    optimizer *and* each difference is resolved (`resolution`), does not hold when another
    optimizer is better by a resolved difference, and is otherwise not resolved (the means are
    given). Then claim 4, larger batches without loss of quality (`_batch_claim`)."""
    if "merit" not in optimizers or len(optimizers) < 2:
        return []
    lines = []
    for batch in sorted(batches, reverse=True):
        lines.extend(_batch_claims(best, optimizers, batch))
    if len(batches) > 1:
        line = _batch_claim(best, optimizers, batches[0], batches[-1])
        if line:
            lines.append(line)
    return lines


def _batch_claims(best: Best, optimizers: list[str], batch: int) -> list[str]:
    """Claims 1-3 at one batch size (see `_claim_lines`)."""
    merit = best.get(("merit", batch))
    others: dict[str, BestResult] = {}
    for o in optimizers:
        e = best.get((o, batch))
        if o != "merit" and is_finished(e):
            others[o] = e
    if not is_finished(merit) or not others:
        return []
    largest = " at large batch" if batch == max(b for _, b in best) else ""
    losses: dict[str, Figures] = dict(others)
    lines = [_claim(f"1 (MERIT has the lowest loss{largest})", f"at batch {batch}", merit, losses, "final_val_loss", 4)]
    with_logit: dict[str, Figures] = {o: e for o, e in others.items() if e.max_attention_logit is not None}
    if merit.max_attention_logit is not None and with_logit:
        lines.append(
            _claim(
                "2 (MERIT keeps the max attention logit lower)",
                f"at batch {batch}",
                merit,
                with_logit,
                MAX_ATTENTION_LOGIT,
                2,
            )
        )
    sharp: dict[str, Figures] = {
        o: _hessian_entry(e) for o, e in others.items() if (e.hessian or {}).get(SHARPNESS) is not None
    }
    mh = _hessian_entry(merit)
    if mh.value(SHARPNESS) is not None and sharp:
        for key, what in ((SHARPNESS, "largest algebraic"), (PAPER_SHARPNESS, "largest-magnitude")):
            claim = f"3 (MERIT finds a flatter minimum: a lower {what} Hessian eigenvalue)"
            paper = " (paper, GPT-2 Small, top eigenvalue by power iteration: MERIT 12.3 vs AdamW 37.2)"
            lines.append(_claim(claim, f"at batch {batch}", mh, sharp, key, 3, paper if key == PAPER_SHARPNESS else ""))
    return lines


BATCH_CLAIM = "4 (MERIT trains with larger batches without loss of quality)"


def _batch_claim(best: Best, optimizers: list[str], small: int, large: int) -> str | None:
    """Claim 4: MERIT's best-lr loss rises less than every other optimizer's from the smallest to
    the largest batch (same tokens). Each optimizer's change is paired seed by seed and its
    environment spread is the sum of both ends' (`_seed_deltas`); the changes are then judged by
    the same rule as a claim at one batch (`_claim`)."""
    changes: dict[str, Figures] = {}
    for name in optimizers:
        a, b = best.get((name, small)), best.get((name, large))
        if is_finished(a) and is_finished(b):
            delta = _seed_deltas(a, b)
            values = delta.value("change_values")
            whole = num(b.final_val_loss) - num(a.final_val_loss)
            delta.values["change"] = sum(values) / len(values) if values else whole
            delta.values["change_std"] = statistics.stdev(values) if len(values) > 1 else None
            changes[name] = delta
    if "merit" not in changes or len(changes) < 2:
        return None
    merit = changes.pop("merit")
    where = f"from batch {small} to {large} (best-lr validation loss change, same tokens)"
    return _claim(BATCH_CLAIM, where, merit, changes, "change", 4)


# Claim 3 is judged on the largest algebraic eigenvalue (the most positive curvature) and, as the
# paper's PyHessian reports "top", on the largest-magnitude one (merit_core.diagnostics.hessian).
SHARPNESS = "largest_algebraic_eigenvalue"
PAPER_SHARPNESS = "largest_magnitude_eigenvalue"


def _hessian_entry(entry: BestResult) -> Measured:
    """A best cell's Hessian numbers with its environment check's Hessian spreads beside them."""
    env = (entry.environment.hessian if entry.environment else None) or {}
    return Measured(dict(entry.hessian or {}), environment=Measured(env))


def _claim(
    claim: str,
    where: str,
    merit: Figures,
    others: dict[str, Figures],
    key: str,
    digits: int,
    note: str = "",
) -> str:
    """'Paper claim N (...): at batch B, **holds here**: MERIT x vs adamw y (resolution), ...' for a
    claim that MERIT's `key` is below every other optimizer's (see `_claim_lines` for the rule);
    `where` says at which batch size(s)."""
    checks = {o: (lookup(merit, key) < lookup(e, key), resolution(merit, e, key).resolved) for o, e in others.items()}
    if all(better and ok for better, ok in checks.values()):
        verdict = "**holds here**"
    elif any(not better and ok for better, ok in checks.values()):
        verdict = "**does not hold here**"
    else:
        verdict = "**not resolved**"
    return (
        f"Paper claim {claim}: {where}, "
        + verdict
        + f": MERIT {mean_std(merit, key, digits)} vs "
        + ", ".join(f"{o} {mean_std(e, key, digits)} ({resolution_text(merit, e, key)})" for o, e in others.items())
        + note
        + "."
    )
