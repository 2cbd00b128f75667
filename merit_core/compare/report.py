"""REPORT.md: what a comparison's numbers show, written from summary.json alone.

Every sentence is computed from the records (which optimizer had the lowest loss at each
batch size and by how much, how much each optimizer's loss rose from the smallest to the
largest batch, how the max attention logits compare), so the report reads the same way
whichever way the numbers fall. It ends with the grids, the setup and the caveats of scale.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from merit_core.compare.instability import instability_lines
from merit_core.compare.results import CompareSummary
from merit_core.metric_names import MAX_ATTENTION_LOGIT


def _f(value: float | None, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:.{digits}f}" if abs(value) < 1000 else f"{value:.0f}"


def _lr(value: float) -> str:
    return f"{value:.3g}"


def _ok(entry: dict[str, Any] | None) -> bool:
    return bool(entry) and entry["status"] == "finished" and entry["final_val_loss"] is not None


def _ms(entry: dict[str, Any], key: str, digits: int = 4) -> str:
    """'mean' or 'mean ± std' (std over seeds, when there are several)."""
    std = entry.get(f"{key}_std")
    text = _f(entry.get(key), digits)
    return text if std is None else f"{text} ± {_f(std, digits)}"


def _values(entry: dict[str, Any], key: str) -> list[float]:
    values = entry.get(f"{key}_values")
    if values is None:
        values = [entry.get(key)]
    return [v for v in values if v is not None and math.isfinite(v)]


def env_spread(entry: dict[str, Any], key: str) -> float | None:
    """How far the floating-point environment alone moved this cell's `key`: |re-run - original| of
    its first seed under another thread count (summary.environment_check), None when not measured."""
    env = entry.get("environment") or {}
    value = env.get(f"{key}_spread")
    return value if value is not None and math.isfinite(value) else None


@dataclass(frozen=True)
class Resolution:
    """Whether a difference between two cells is resolved, and why (the text the report prints)."""

    resolved: bool | None  # None: one seed, the spread was not measured
    text: str


def resolution(a: dict[str, Any], b: dict[str, Any], key: str = "final_val_loss") -> Resolution:
    """A difference is resolved only when (1) the seeds resolve it: every seed value of one cell lies
    below every seed value of the other, and (2) the gap between the means exceeds the environment
    spread: the sum of both cells' environment spreads (`env_spread`; each cell may move that far
    under a change of thread count, in opposite directions). Without a measured environment spread
    (no environment check, or a key it does not cover) nothing is resolved."""
    va, vb = _values(a, key), _values(b, key)
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
            f"not resolved: apart over {n} seeds, but the gap {_f(gap, digits)} is within the environment "
            f"spread {_f(ea + eb, digits)}",
        )
    return Resolution(True, f"resolved by {n} seeds and beyond the environment spread {_f(ea + eb, digits)}")


def resolved(a: dict[str, Any], b: dict[str, Any], key: str = "final_val_loss") -> bool | None:
    """`resolution(a, b, key).resolved`: True, False, or None with one seed each."""
    return resolution(a, b, key).resolved


def _resolution(a: dict[str, Any], b: dict[str, Any], key: str = "final_val_loss") -> str:
    return resolution(a, b, key).text


def best_table(summary: dict[str, Any]) -> dict[tuple[str, int], dict[str, Any]]:
    return {(b["optimizer"], b["batch_size"]): b for b in summary["best"]}


def findings(summary: dict[str, Any]) -> list[str]:
    """The bullet points of 'What the numbers show'."""
    best = best_table(summary)
    optimizers = summary["settings"]["optimizers"]
    batches = summary["settings"]["batch_sizes"]
    reason = no_verdict(summary)
    if reason:
        return [f"**{SMOKE}**: {reason}", *_smoke_lines(best, optimizers, batches)]
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


def _smoke_lines(best, optimizers, batches) -> list[str]:
    """A smoke run's numbers, in the optimizers' order: no ranking, no best lr, no ratios."""
    lines = []
    for batch in batches:
        parts = []
        for name in optimizers:
            e = best.get((name, batch))
            if e is None:
                continue
            value = (
                f"loss {_ms(e, 'final_val_loss')}, max logit {_ms(e, MAX_ATTENTION_LOGIT, 2)}" if _ok(e) else "diverged"
            )
            parts.append(f"{name} at lr {_lr(e['lr'])}: {value}")
        lines.append(f"Batch {batch} (one lr each, in the order given): " + "; ".join(parts) + ".")
    return lines


def no_verdict(summary: dict[str, Any]) -> str | None:
    """Why the paper's claims get no verdict from this comparison, or None when they may.

    A verdict compares optimizers at their best lr, which needs an lr grid: a smoke run (--quick)
    or a cell with a single lr says nothing about any optimizer at its best."""
    if summary["settings"].get("quick"):
        return (
            "this is a smoke run (--quick: one lr per optimizer and batch, half the tokens); no optimizer "
            "was tuned, so nothing here bears on the paper's claims. Run `merit compare` without "
            "--quick for them."
        )
    single = [f"{b['optimizer']} b{b['batch_size']}" for b in summary["best"] if len(b.get("grid") or []) < 2]
    if single:
        return (
            f"one lr only for {', '.join(single)}: a cell without an lr grid is not tuned, so the "
            "claims are not checked (give several lrs, or lrs = 'auto')."
        )
    return None


def _loss_line(batch: int, entries: list[dict[str, Any] | None]) -> str:
    ranked = sorted((e for e in entries if _ok(e)), key=lambda e: e["final_val_loss"])
    failed = [e["optimizer"] for e in entries if e is not None and not _ok(e)]
    tail = f" Diverged at every learning rate tried: {', '.join(failed)}." if failed else ""
    if not ranked:
        return f"**Batch {batch}:** no optimizer finished with a finite validation loss.{tail}"
    top = ranked[0]
    text = (
        f"**Batch {batch}:** {top['optimizer']} had the lowest final validation loss, "
        f"{_ms(top, 'final_val_loss')} (lr {_lr(top['lr'])})"
    )
    if len(ranked) == 1:
        return text + "." + tail
    gaps = [
        f"{e['optimizer']} {_ms(e, 'final_val_loss')} (+{_f(e['final_val_loss'] - top['final_val_loss'])}, "
        f"{100 * (e['final_val_loss'] / top['final_val_loss'] - 1):+.1f}%"
        + ("" if resolved(top, e) is None else f"; {_resolution(top, e)}")
        + ")"
        for e in ranked[1:]
    ]
    return f"{text}; then {', '.join(gaps)}.{tail}"


def _degradation_lines(best, optimizers, small: int, large: int) -> list[str]:
    rows = []
    for name in optimizers:
        a, b = best.get((name, small)), best.get((name, large))
        if _ok(a) and _ok(b):
            rows.append((name, b["final_val_loss"] - a["final_val_loss"], a, b))
    if not rows:
        return []
    rows.sort(key=lambda r: r[1])
    parts = [
        f"{name} {_f(a['final_val_loss'])} -> {_f(b['final_val_loss'])} ({delta:+.4f})" for name, delta, a, b in rows
    ]
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
        line += f" ({_resolution(first, last, 'change')})." if len(first["change_values"]) > 1 else "."
    return [line]


def _seed_deltas(small: dict[str, Any], large: dict[str, Any]) -> dict[str, Any]:
    """The loss change from the small to the large batch, seed by seed (same seeds, paired), with the
    environment spread of a change: the sum of both cells' (None when either is not measured)."""
    a, b = _values(small, "final_val_loss"), _values(large, "final_val_loss")
    values = [y - x for x, y in zip(a, b)] if len(a) == len(b) else []
    ea, eb = env_spread(small, "final_val_loss"), env_spread(large, "final_val_loss")
    env = None if ea is None or eb is None else {"change_spread": ea + eb}  # each end may move that far
    return {"change": None, "change_values": values, "environment": env}


def _logit_line(batch: int, entries: list[dict[str, Any] | None]) -> str | None:
    ranked = sorted(
        (e for e in entries if _ok(e) and e.get(MAX_ATTENTION_LOGIT) is not None),
        key=lambda e: e[MAX_ATTENTION_LOGIT],
    )
    if not ranked:
        return None
    several = any(len(e.get("seeds") or []) > 1 for e in ranked)
    where = "layer {layer} in seed {seed}" if several else "layer {layer}"
    parts = [
        f"{e['optimizer']} {_ms(e, MAX_ATTENTION_LOGIT, 2)} "
        f"({where.format(layer=_argmax(e), seed=(e.get('seeds') or [e.get('seed')])[0])})"
        for e in ranked
    ]
    line = f"**Max attention logit at the end, batch {batch}** (best-lr runs, max over layers): {', '.join(parts)}."
    lo, hi = ranked[0][MAX_ATTENTION_LOGIT], ranked[-1][MAX_ATTENTION_LOGIT]
    if len(ranked) > 1 and lo > 0:
        line += f" The largest is {hi / lo:.2f}x the smallest."
    return line


def _bound_line(batch: int, entries: list[dict[str, Any] | None]) -> str | None:
    """The max-norm bound term ||W_Q||_m * ||W_K||_m at the end (max over layers), lowest first."""
    rows = sorted(
        (max(e["qk_bound_by_layer"]), e["optimizer"]) for e in entries if _ok(e) and e.get("qk_bound_by_layer")
    )
    if not rows:
        return None
    seeds = next((e.get("seeds") for e in entries if _ok(e) and e.get("seeds")), None) or []
    which = f"; seed {seeds[0]}'s run of each" if len(seeds) > 1 else ""
    return (
        f"**||W_Q||_m x ||W_K||_m at the end, batch {batch}** (the max-norm product that bounds the logit; "
        f"max over layers{which}): " + ", ".join(f"{name} {value:.3g}" for value, name in rows) + "."
    )


def _argmax(entry: dict[str, Any]) -> str:
    layers = entry.get("max_attention_logit_by_layer") or []
    values = [(v, i) for i, v in enumerate(layers) if v is not None]
    return str(max(values)[1]) if values else "-"  # layers count from 0, as in merit train and inspect


def _claim_lines(best, optimizers, batches) -> list[str]:
    """The paper's claims, checked against these numbers (only when MERIT and a baseline ran): each
    holds only when MERIT is better than every other optimizer *and* each difference is resolved
    (`resolution`), does not hold when another optimizer is better by a resolved difference, and is
    otherwise not resolved (the means are given)."""
    if "merit" not in optimizers or len(optimizers) < 2:
        return []
    large = batches[-1]
    entries = {o: best.get((o, large)) for o in optimizers}
    merit = entries["merit"]
    others = {o: e for o, e in entries.items() if o != "merit" and _ok(e)}
    if not _ok(merit) or not others:
        return []
    lines = [_claim("1 (MERIT has the lowest loss at large batch)", large, merit, others, "final_val_loss", 4)]
    with_logit = {o: e for o, e in others.items() if e.get(MAX_ATTENTION_LOGIT) is not None}
    if merit.get(MAX_ATTENTION_LOGIT) is not None and with_logit:
        lines.append(
            _claim("2 (MERIT keeps the max attention logit lower)", large, merit, with_logit, MAX_ATTENTION_LOGIT, 2)
        )
    sharp = {o: _hessian_entry(e) for o, e in others.items() if (e.get("hessian") or {}).get(SHARPNESS) is not None}
    mh = _hessian_entry(merit)
    if mh.get(SHARPNESS) is not None and sharp:
        for key, what in ((SHARPNESS, "largest algebraic"), (PAPER_SHARPNESS, "largest-magnitude")):
            claim = f"3 (MERIT finds a flatter minimum: a lower {what} Hessian eigenvalue)"
            paper = " (paper, GPT-2 Small, top eigenvalue by power iteration: MERIT 12.3 vs AdamW 37.2)"
            lines.append(_claim(claim, large, mh, sharp, key, 3, paper if key == PAPER_SHARPNESS else ""))
    return lines


# Claim 3 is judged on the largest algebraic eigenvalue (the most positive curvature) and, as the
# paper's PyHessian reports "top", on the largest-magnitude one (merit_core.diagnostics.hessian).
SHARPNESS = "largest_algebraic_eigenvalue"
PAPER_SHARPNESS = "largest_magnitude_eigenvalue"


def _hessian_entry(entry: dict[str, Any]) -> dict[str, Any]:
    """A best cell's Hessian numbers with its environment check's Hessian spreads beside them."""
    env = (entry.get("environment") or {}).get("hessian") or {}
    return {**(entry.get("hessian") or {}), "environment": env}


def _claim(
    claim: str,
    batch: int,
    merit: dict[str, Any],
    others: dict[str, dict[str, Any]],
    key: str,
    digits: int,
    note: str = "",
) -> str:
    """'Paper claim N (...): at batch B, **holds here**: MERIT x vs adamw y (resolution), ...' for a
    claim that MERIT's `key` is below every other optimizer's (see `_claim_lines` for the rule)."""
    checks = {o: (merit[key] < e[key], resolution(merit, e, key).resolved) for o, e in others.items()}
    if all(better and ok for better, ok in checks.values()):
        verdict = "**holds here**"
    elif any(not better and ok for better, ok in checks.values()):
        verdict = "**does not hold here**"
    else:
        verdict = "**not resolved**"
    return (
        f"Paper claim {claim}: at batch {batch}, "
        + verdict
        + f": MERIT {_ms(merit, key, digits)} vs "
        + ", ".join(f"{o} {_ms(e, key, digits)} ({_resolution(merit, e, key)})" for o, e in others.items())
        + note
        + "."
    )


def results_table(summary: dict[str, Any]) -> list[str]:
    """Markdown: optimizers x batch sizes, best-lr validation loss and max attention logit (a smoke
    run's one lr per cell: the same columns, no best lr)."""
    best = best_table(summary)
    batches = summary["settings"]["batch_sizes"]
    head = "| optimizer | " + " | ".join(f"b{b} val loss | b{b} lr | b{b} max logit" for b in batches) + " |"
    rule = "|---|" + "---:|---:|---:|" * len(batches)
    rows = [head, rule]
    for name in summary["settings"]["optimizers"]:
        cells = []
        for b in batches:
            e = best.get((name, b))
            if e is None:
                cells += ["", "", ""]
            elif not _ok(e):
                cells += ["diverged", "-", "-"]
            else:
                cells += [_ms(e, "final_val_loss"), _lr(e["lr"]), _ms(e, MAX_ATTENTION_LOGIT, 2)]
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return rows


def seeds_table(summary: dict[str, Any]) -> list[str]:
    """Markdown: each seed's final validation loss and max logit of every best cell (several seeds only)."""
    if all(len(b.get("seeds") or []) < 2 for b in summary["best"]):
        return []
    rows = ["| optimizer | batch | lr | seed: final val loss | seed: max logit |", "|---|---:|---:|---|---|"]
    for b in summary["best"]:
        seeds = b.get("seeds") or []
        losses = ", ".join(f"{s}: {_f(v)}" for s, v in zip(seeds, b.get("final_val_loss_values") or []))
        logits = ", ".join(f"{s}: {_f(v, 2)}" for s, v in zip(seeds, b.get("max_attention_logit_values") or []))
        rows.append(f"| {b['optimizer']} | {b['batch_size']} | {_lr(b['lr'])} | {losses} | {logits} |")
    return rows


def hessian_lines(summary: dict[str, Any]) -> list[str]:
    """Markdown: the extreme Hessian eigenvalues and trace of each best run, beside the paper's figures."""
    entries = [b for b in summary["best"] if b.get("hessian")]
    if not entries:
        return []
    first = entries[0]["hessian"]
    batch, est = first.get("batch") or {}, first.get("estimator") or {}
    paper = (summary["settings"].get("paper") or {}).get("hessian") or {}
    rows = [
        f"Final weights of this comparison's own best runs, on a fixed validation batch (the first "
        f"{batch.get('sequences')} windows of {batch.get('seq_len')} tokens of the training's first validation "
        "batch, on which the max attention logit is measured; the same for every run). Three conventions, named "
        "apart: the *largest algebraic* eigenvalue (the most positive curvature), the *smallest algebraic* one "
        "and the one of *largest magnitude* (sign kept: what power iteration, as in the paper's PyHessian, calls "
        f"the top eigenvalue). Lanczos with full reorthogonalisation (at most {est.get('iters')} Hessian-vector "
        "products; 'converged' tests the largest algebraic one), trace by Hutchinson "
        f"({est.get('samples')} Rademacher samples); mean ± std over seeds.",
        "",
        "| optimizer | batch | lr | largest algebraic | smallest algebraic | largest magnitude | trace | converged "
        "| paper top eigenvalue | paper trace |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for b in entries:
        h = b["hessian"]
        conv = "yes" if all(h.get("eigen_converged") or [False]) else "no"
        top = (paper.get("top_eigenvalue") or {}).get(b["optimizer"])
        trace = (paper.get("trace") or {}).get(b["optimizer"])
        rows.append(
            f"| {b['optimizer']} | {b['batch_size']} | {_lr(b['lr'])} | {_ms(h, SHARPNESS, 3)} | "
            f"{_ms(h, 'smallest_algebraic_eigenvalue', 3)} | {_ms(h, PAPER_SHARPNESS, 3)} | {_ms(h, 'trace', 1)} | "
            f"{conv} | {'-' if top is None else f'{top:g}'} | {'-' if trace is None else f'{trace:,.0f}'} |"
        )
    rows += [
        "",
        f"The paper's figures are for {paper.get('model', 'GPT-2 Small')} trained on billions of tokens; "
        "compare the ordering between optimizers, not the magnitudes.",
    ]
    return rows


def environment_lines(summary: dict[str, Any]) -> list[str]:
    """Markdown: the floating-point environment of the runs and, per best cell, how far its first seed
    moved when trained again under another thread count (the environment spread verdicts weigh)."""
    env = summary["settings"].get("environment") or {}
    checked = [b for b in summary["best"] if b.get("environment")]
    if not env and not checked:
        return []
    rows = []
    if env:
        rows.append(
            f"Runs computed with torch {env.get('torch')}, BLAS {env.get('blas')}, {env.get('threads')} intra-op "
            f"thread(s), CPU {env.get('cpu')} (torch dispatch {env.get('cpu_capability')}; ISA flags "
            f"{', '.join(env.get('isa_flags') or []) or '-'}). Runs are bit-reproducible only in the same "
            "environment: another thread count, BLAS or ISA reorders sums, and an optimizer can amplify that "
            "rounding difference over hundreds of steps."
        )
    if not checked:
        rows += ["", "The environment spread was not measured (no environment check): no difference is resolved."]
        return rows
    rows += [
        "",
        "Each best cell's first seed, trained again with everything equal but the thread count: |difference| is "
        "the cell's environment spread. A difference between two cells is resolved only when the seeds resolve it "
        "and it exceeds the sum of their environment spreads.",
        "",
        "| optimizer | batch | lr | threads | val loss | re-run | spread | max logit | re-run | spread |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for b in checked:
        e = b["environment"]
        rows.append(
            f"| {b['optimizer']} | {b['batch_size']} | {_lr(b['lr'])} | {env.get('threads', '-')} -> {e.get('threads', '-')} | "
            f"{_f(e.get('final_val_loss_original'))} | {_f(e.get('final_val_loss_rerun'))} | "
            f"{_f(e.get('final_val_loss_spread'))} | {_f(e.get('max_attention_logit_original'), 2)} | "
            f"{_f(e.get('max_attention_logit_rerun'), 2)} | {_f(e.get('max_attention_logit_spread'), 2)} |"
        )
    sharp = [b for b in checked if (b["environment"].get("hessian") or {}).get(f"{SHARPNESS}_spread") is not None]
    if sharp:
        rows += [
            "",
            "Hessian of the re-run (largest batch): "
            + "; ".join(
                f"{b['optimizer']} largest algebraic spread {_f(b['environment']['hessian'][f'{SHARPNESS}_spread'], 3)}, "
                f"largest magnitude spread {_f(b['environment']['hessian'].get(f'{PAPER_SHARPNESS}_spread'), 3)}"
                for b in sharp
            )
            + ".",
        ]
    return rows


def speed_lines(summary: dict[str, Any]) -> list[str]:
    """Markdown: training tokens/s of each best cell (median of each run's log lines, mean over seeds)
    and each optimizer's speed relative to LAMB at the same batch."""
    best = best_table(summary)
    batches = summary["settings"]["batch_sizes"]
    rows = []
    for batch in batches:
        speeds = {
            o: best[o, batch]["tokens_per_s"]
            for o in summary["settings"]["optimizers"]
            if (o, batch) in best and best[o, batch].get("tokens_per_s")
        }
        if not speeds:
            continue
        ref = speeds.get("lamb")
        parts = [
            f"{o} {v:,.0f}" + (f" ({v / ref:.3f}x LAMB)" if ref and o != "lamb" else "") for o, v in speeds.items()
        ]
        rows.append(f"- Batch {batch}: " + ", ".join(parts) + " tokens/s.")
    if not rows:
        return []
    return [
        "Training tokens/s of the best runs (median over each run's log lines, mean over seeds). The runs "
        "shared the machine with the comparison's other runs, so these are rough; benchmarks/train_throughput.py "
        "measures the optimizers side by side in one process (benchmarks/README.md). The paper puts MERIT's "
        "cost at about 1% over LAMB.",
        "",
        *rows,
    ]


ABLATION_COMPONENTS = {
    "merit-noclip": "element-wise clipping of the update ratios",
    "merit-nobound": "the weight-wise bound on the element-wise ratios",
    "max-lamb": "element-wise ratios (one max-norm ratio per tensor instead)",
    "l2-merit": "max-norms (l2 norms instead)",
    "lamb-ref": "all of MERIT's changes (the LAMB reference)",
}


def ablation_lines(summary: dict[str, Any]) -> list[str]:
    """One line per MERIT ablation that ran with MERIT at the largest batch: did removing the
    component hurt the final validation loss, by how much, and do the seeds resolve it."""
    batch = summary["settings"]["batch_sizes"][-1]
    best = best_table(summary)
    merit = best.get(("merit", batch))
    ablations = [o for o in summary["settings"]["optimizers"] if o in ABLATION_COMPONENTS]
    if not ablations or merit is None:
        return []
    if not _ok(merit):
        return [f"MERIT diverged at every lr tried at batch {batch}: the ablations cannot be judged."]
    lines = []
    for name in ablations:
        e = best.get((name, batch))
        what = ABLATION_COMPONENTS[name]
        if not _ok(e):
            lines.append(f"Without {what} ({name}): diverged at every lr tried, where MERIT did not.")
            continue
        if name == "merit-noclip" and _same_runs(summary, merit, name):
            lines.append(
                f"Without {what} ({name}): the clip never bound: at MERIT's lr every seed's loss and max logit "
                "equal MERIT's exactly. With max-norm ratios |s_ij u_ij| <= max|W| (docs/MERIT.md), so the clip at 1 "
                "only acts on a tensor holding an entry above 1 in magnitude; nothing here tests it."
            )
            continue
        delta = e["final_val_loss"] - merit["final_val_loss"]
        verdict = "hurt" if delta > 0 else "did not hurt"
        lines.append(
            f"Without {what} ({name}): {verdict}: loss {_ms(e, 'final_val_loss')} vs MERIT "
            f"{_ms(merit, 'final_val_loss')} ({delta:+.4f}, {100 * delta / merit['final_val_loss']:+.2f}%; "
            f"{_resolution(merit, e)}); max logit {_ms(e, MAX_ATTENTION_LOGIT, 2)} vs "
            f"{_ms(merit, MAX_ATTENTION_LOGIT, 2)}."
        )
    return lines


def _same_runs(summary: dict[str, Any], merit: dict[str, Any], name: str) -> bool:
    """Whether `name`'s cell at MERIT's best lr gave exactly MERIT's numbers on every seed."""
    cell = next(
        (
            c
            for c in summary.get("cells") or []
            if (c["optimizer"], c["batch_size"], c["lr"]) == (name, merit["batch_size"], merit["lr"])
        ),
        None,
    )
    if cell is None or cell["status"] != "finished" or cell.get("seeds") != merit.get("seeds"):
        return False
    return all(
        cell.get(f"{key}_values") == merit.get(f"{key}_values") for key in ("final_val_loss", MAX_ATTENTION_LOGIT)
    )


def zero_shot_lines(summary: dict[str, Any]) -> list[str]:
    """Markdown: the zero-shot scores of each best run (mean ± std over seeds), one column per metric."""
    entries = [b for b in summary["best"] if b.get("zero_shot")]
    if not entries:
        return []
    keys = list(dict.fromkeys((r["task"], r["metric"]) for b in entries for r in b["zero_shot"]))
    arrows = {}
    for b in entries:
        for r in b["zero_shot"]:
            arrows.setdefault((r["task"], r["metric"]), {True: " ↑", False: " ↓"}.get(r["higher_is_better"], ""))
    head = "| optimizer | batch | lr | " + " | ".join(f"{t} {m}{arrows[t, m]}" for t, m in keys) + " |"
    rows = [head, "|---|---:|---:|" + "---:|" * len(keys)]
    for b in entries:
        by_key = {(r["task"], r["metric"]): r for r in b["zero_shot"]}
        cells = [_ms(by_key[k], "value") if k in by_key else "-" for k in keys]
        rows.append(f"| {b['optimizer']} | {b['batch_size']} | {_lr(b['lr'])} | " + " | ".join(cells) + " |")
    ev = summary["settings"].get("eval") or {}
    paper = (summary["settings"].get("paper") or {}).get("zero_shot") or {}
    average = paper.get("average") or {}
    rows += [
        "",
        f"Zero-shot with lm-evaluation-harness (`merit eval`) on {', '.join(ev.get('tasks') or [])}"
        + (f", at most {ev['limit']} documents per task" if ev.get("limit") else "")
        + ". The paper's zero-shot average (LAMBADA, WikiText, SuperGLUE) on GPT-2: "
        + ", ".join(f"{o} {v:g}" for o, v in average.items())
        + ".",
    ]
    return rows


def grid_table(summary: dict[str, Any]) -> list[str]:
    """Markdown: every lr tried, its final validation loss (mean ± std over seeds, or 'diverged'), the best in
    bold (none in a smoke run)."""
    best = {} if no_verdict(summary) else {(b["optimizer"], b["batch_size"]): b["lr"] for b in summary["best"]}
    rows = ["| optimizer | batch | steps | lr: final val loss |", "|---|---:|---:|---|"]
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in summary.get("cells") or summary["runs"]:
        groups.setdefault((r["optimizer"], r["batch_size"]), []).append(r)
    for (name, batch), runs in groups.items():
        cells = []
        for r in sorted(runs, key=lambda r: r["lr"]):
            value = _ms(r, "final_val_loss") if r["status"] == "finished" else r["status"]
            cell = f"{_lr(r['lr'])}: {value}"
            cells.append(f"**{cell}**" if r["lr"] == best.get((name, batch)) and r["status"] == "finished" else cell)
        rows.append(f"| {name} | {batch} | {runs[0]['steps']} | {', '.join(cells)} |")
    return rows


# An lr counts as "good" when its mean final validation loss is within this fraction of the cell's best.
GOOD_LR_TOLERANCE = 0.02


def sensitivity_lines(summary: dict[str, Any]) -> list[str]:
    """Markdown: final validation loss and max attention logit against lr for each optimizer and
    batch (mean ± std over seeds), and how wide the range of good lrs is (GOOD_LR_TOLERANCE)."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in summary.get("cells") or summary["runs"]:
        groups.setdefault((r["optimizer"], r["batch_size"]), []).append(r)
    if not groups or all(len(cells) < 2 for cells in groups.values()):
        return []
    rows = [
        "Every lr of every grid: final validation loss and max attention logit (max over layers) at the "
        f"end, mean ± std over seeds; *good lrs* are those within {100 * GOOD_LR_TOLERANCE:g}% of the "
        "cell's best loss, and their span (largest / smallest) says how forgiving the optimizer is "
        "at that batch.",
        "",
        "| optimizer | batch | lr | final val loss | max logit | diverged seeds |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    spans = []
    for (name, batch), cells in groups.items():
        cells = sorted(cells, key=lambda r: r["lr"])
        for r in cells:
            finished = r["status"] == "finished"
            n_seeds = len(r.get("seeds") or [r.get("seed")])
            values = r.get("final_val_loss_values") or [r.get("final_val_loss")]
            n_bad = 0 if finished else sum(v is None or not math.isfinite(v) for v in values) or n_seeds
            rows.append(
                f"| {name} | {batch} | {_lr(r['lr'])} | "
                + (f"{_ms(r, 'final_val_loss')} | {_ms(r, 'max_attention_logit', 2)}" if finished else "- | -")
                + f" | {n_bad} of {n_seeds} |"
            )
        done = [r for r in cells if r["status"] == "finished" and r.get("final_val_loss") is not None]
        if done:
            top = min(r["final_val_loss"] for r in done)
            good = [r["lr"] for r in done if r["final_val_loss"] <= top * (1 + GOOD_LR_TOLERANCE)]
            edge = " (reaches the grid's edge)" if min(good) == cells[0]["lr"] or max(good) == cells[-1]["lr"] else ""
            spans.append(
                f"- {name} at batch {batch}: good lrs {_lr(min(good))}-{_lr(max(good))}, "
                f"x{max(good) / min(good):.3g} wide, {len(good)} of {len(cells)} grid points{edge}."
            )
    return rows + [""] + spans


def caveats(summary: dict[str, Any]) -> list[str]:
    s = summary["settings"]
    params = s.get("n_params")
    size = f"{params / 1e6:.2f}M parameters" if params else "its size"
    lines = [
        f"Scale: {s['model']} has {size} and each run saw {s['tokens_per_run']:,} tokens; the paper's "
        "results are for GPT-2 models of 125M-770M parameters trained on billions of tokens at batch "
        "sizes of 1k-8k sequences. Effects of large-batch training (and the attention-logit growth the paper "
        "reports) need not appear, or may look different, at this scale.",
    ]
    seeds = s.get("seeds") or [s.get("seed", 0)]
    if max(len(seeds), s.get("best_seeds") or 0) < 2:
        lines.append("One seed per run: the run-to-run spread was not measured, so small gaps may be noise.")
    else:
        lines.append(
            f"{len(seeds)} seed(s) per learning rate (train seeds {', '.join(map(str, seeds))})"
            + (f", {s['best_seeds']} at each best lr" if (s.get("best_seeds") or 0) > len(seeds) else "")
            + ": numbers are the mean ± the sample standard deviation over seeds, and the best lr is chosen on the "
            "mean. A difference is called resolved only when every seed of one lies below every seed of the other "
            "and the gap between the means exceeds the two cells' environment spreads (see Environment spread); "
            "otherwise it is not resolved, and a claim holds only when resolved against every other optimizer."
        )
    for b in summary["best"]:
        if b.get("lr_extended"):
            lines.append(
                f"{b['optimizer']} at batch {b['batch_size']}: the grid was extended past its edge "
                f"(added lr {', '.join(_lr(v) for v in b['lr_extended'])})"
                + ("; the best lr is now interior." if not b.get("lr_at_edge") else ".")
            )
        if b.get("lr_at_edge"):
            side = "smallest" if b["lr_at_edge"] == "low" else "largest"
            reason = {
                "limit": f"after {s.get('max_extensions', 0)} extension(s) on that side, the stated limit",
                "given": "a given lr list, which is never extended",
                "quick": "--quick runs one lr per grid and never extends it",
            }.get(b.get("edge_reason"), "")
            lines.append(
                f"{b['optimizer']} at batch {b['batch_size']}: the best lr ({_lr(b['lr'])}) is still the {side} "
                f"of its grid ({reason}), so its optimum may lie outside the grid: this comparison is not "
                "fair to it yet."
            )
    diverged = [r for r in summary["runs"] if r["status"] == "diverged"]
    if diverged:
        lines.append(
            "Diverged runs (non-finite loss; ranked last): "
            + ", ".join(
                f"{r['optimizer']} b{r['batch_size']} lr {_lr(r['lr'])}"
                + (f" (seed {r['seed']} of {', '.join(map(str, seeds))})" if len(seeds) > 1 else "")
                for r in diverged
            )
            + "."
        )
    return lines


def setup_lines(summary: dict[str, Any]) -> list[str]:
    s = summary["settings"]
    steps = ", ".join(f"batch {b}: {n} steps" for b, n in s["steps"].items())
    warmup = ", ".join(f"batch {b}: {n} steps" for b, n in s["warmup_steps"].items())
    return [
        f"- Model: {s['model']}" + (f" ({s['n_params']:,} parameters)" if s.get("n_params") else ""),
        f"- Data: {s['data']}",
        f"- Sequence length {s['seq_len']}; token budget {s['tokens_per_run']:,} tokens per run at every "
        f"batch size ({steps})",
        f"- Schedule: linear warmup ({warmup}), then cosine decay to {s['min_lr_ratio']:g} x lr; "
        f"gradient clipping at {s['grad_clip']:g}; "
        + (f"seeds {', '.join(map(str, s['seeds']))}" if len(s.get("seeds") or []) > 1 else f"seed {s['seed']}"),
        f"- Learning rates: {s['lr_rule']}; "
        + (
            "one per optimizer and batch size, untuned (smoke run)"
            if no_verdict(summary)
            else "the best per optimizer and batch size by (mean) final validation loss"
        ),
        f"- Validation: {s['eval_tokens']:,} held-out tokens; max attention logit on the first validation batch",
    ] + ([f"- Command: `{s['command']}`"] if s.get("command") else [])


def _section(title: str, lines: list[str]) -> list[str]:
    return [f"## {title}", "", *lines, ""] if lines else []


def render_report(typed: CompareSummary) -> str:
    """The whole REPORT.md, from the comparison's typed record.

    The sections below still read summary.json's form of it (`to_dict()`: plain dicts, as a script
    reading summary.json would)."""
    s = typed.settings
    summary = typed.to_dict()
    title = " vs ".join(s["optimizers"])
    intro = (
        f"**{SMOKE}.** One learning rate per optimizer and batch size (no grid, so no optimizer was tuned); "
        "the numbers check that everything runs. Generated from `summary.json`."
        if no_verdict(summary)
        else "Each optimizer at its best learning rate (by final validation loss, the mean over seeds) for each "
        "batch size, all at the same token budget. Generated from `summary.json`."
    )
    parts = [
        f"# merit compare: {title} on {s['model']}",
        "",
        intro,
        "",
        "## Results",
        "",
        *results_table(summary),
        "",
        "## What the numbers show",
        "",
        *[f"- {line}" for line in findings(summary)],
        "",
        *_section("Each seed", seeds_table(summary)),
        *_section("Learning-rate sensitivity", sensitivity_lines(summary)),
        *_section("Sharpness (Hessian)", hessian_lines(summary)),
        *_section("Instability precursors", instability_lines(summary)),
        *_section("Environment spread", environment_lines(summary)),
        *_section("Training speed", speed_lines(summary)),
        *_section("Ablations (largest batch)", [f"- {line}" for line in ablation_lines(summary)]),
        *_section("Zero-shot evaluation", zero_shot_lines(summary)),
        "## Caveats",
        "",
        *[f"- {line}" for line in caveats(summary)],
        "",
        "## Learning-rate grid",
        "",
        *grid_table(summary),
        "",
        "## Setup",
        "",
        *setup_lines(summary),
        "",
    ]
    return "\n".join(parts)
