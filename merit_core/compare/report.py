"""REPORT.md: what a comparison's numbers show, written from summary.json alone.

Every sentence is computed from the records (which optimizer had the lowest loss at each
batch size and by how much, how much each optimizer's loss rose from the smallest to the
largest batch, how the max attention logits compare), so the report reads the same way
whichever way the numbers fall. It ends with the grids, the setup and the caveats of scale.
"""

from __future__ import annotations

import math
from typing import Any


def _f(value: float | None, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:.{digits}f}" if abs(value) < 1000 else f"{value:.0f}"


def _lr(value: float) -> str:
    return f"{value:.3g}"


def _ok(entry: dict[str, Any] | None) -> bool:
    return bool(entry) and entry["status"] == "finished" and entry["final_val_loss"] is not None


def best_table(summary: dict[str, Any]) -> dict[tuple[str, int], dict[str, Any]]:
    return {(b["optimizer"], b["batch_size"]): b for b in summary["best"]}


def findings(summary: dict[str, Any]) -> list[str]:
    """The bullet points of 'What the numbers show'."""
    best = best_table(summary)
    optimizers = summary["settings"]["optimizers"]
    batches = summary["settings"]["batch_sizes"]
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


def _loss_line(batch: int, entries: list[dict[str, Any] | None]) -> str:
    ranked = sorted((e for e in entries if _ok(e)), key=lambda e: e["final_val_loss"])
    failed = [e["optimizer"] for e in entries if e is not None and not _ok(e)]
    tail = f" Diverged at every learning rate tried: {', '.join(failed)}." if failed else ""
    if not ranked:
        return f"**Batch {batch}:** no optimizer finished with a finite validation loss.{tail}"
    top = ranked[0]
    text = (
        f"**Batch {batch}:** {top['optimizer']} had the lowest final validation loss, "
        f"{_f(top['final_val_loss'])} (lr {_lr(top['lr'])})"
    )
    if len(ranked) == 1:
        return text + "." + tail
    gaps = [
        f"{e['optimizer']} {_f(e['final_val_loss'])} (+{_f(e['final_val_loss'] - top['final_val_loss'])}, "
        f"{100 * (e['final_val_loss'] / top['final_val_loss'] - 1):+.1f}%)"
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
            f" The smallest change: {rows[0][0]} ({rows[0][1]:+.4f}); the largest: {rows[-1][0]} ({rows[-1][1]:+.4f})."
        )
    return [line]


def _logit_line(batch: int, entries: list[dict[str, Any] | None]) -> str | None:
    ranked = sorted(
        (e for e in entries if _ok(e) and e.get("max_attention_logit") is not None),
        key=lambda e: e["max_attention_logit"],
    )
    if not ranked:
        return None
    parts = [f"{e['optimizer']} {_f(e['max_attention_logit'], 2)} (layer {_argmax(e)})" for e in ranked]
    line = f"**Max attention logit at the end, batch {batch}** (best-lr runs, max over layers): {', '.join(parts)}."
    lo, hi = ranked[0]["max_attention_logit"], ranked[-1]["max_attention_logit"]
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
    return (
        f"**||W_Q||_m x ||W_K||_m at the end, batch {batch}** (the max-norm product that bounds the logit; "
        "max over layers): " + ", ".join(f"{name} {value:.3g}" for value, name in rows) + "."
    )


def _argmax(entry: dict[str, Any]) -> str:
    layers = entry.get("max_attention_logit_by_layer") or []
    values = [(v, i) for i, v in enumerate(layers) if v is not None]
    return str(max(values)[1]) if values else "-"  # layers count from 0, as in merit train and inspect


def _claim_lines(best, optimizers, batches) -> list[str]:
    """The paper's two claims, checked against these numbers (only when MERIT and a baseline ran)."""
    if "merit" not in optimizers or len(optimizers) < 2:
        return []
    large = batches[-1]
    entries = {o: best.get((o, large)) for o in optimizers}
    merit = entries["merit"]
    others = {o: e for o, e in entries.items() if o != "merit" and _ok(e)}
    if not _ok(merit) or not others:
        return []
    lines = []
    lowest = all(merit["final_val_loss"] < e["final_val_loss"] for e in others.values())
    gap = min(e["final_val_loss"] for e in others.values()) - merit["final_val_loss"]
    lines.append(
        f"Paper claim 1 (MERIT has the lowest loss at large batch): at batch {large}, "
        + ("**holds here**" if lowest else "**does not hold here**")
        + f": MERIT's loss minus the best other optimizer's is {-gap:+.4f}."
    )
    with_logit = {o: e for o, e in others.items() if e.get("max_attention_logit") is not None}
    if merit.get("max_attention_logit") is not None and with_logit:
        smallest = all(merit["max_attention_logit"] < e["max_attention_logit"] for e in with_logit.values())
        lines.append(
            f"Paper claim 2 (MERIT keeps the max attention logit lower): at batch {large}, "
            + ("**holds here**" if smallest else "**does not hold here**")
            + f": MERIT {_f(merit['max_attention_logit'], 2)} vs "
            + ", ".join(f"{o} {_f(e['max_attention_logit'], 2)}" for o, e in with_logit.items())
            + "."
        )
    return lines


def results_table(summary: dict[str, Any]) -> list[str]:
    """Markdown: optimizers x batch sizes, best-lr validation loss and max attention logit."""
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
                cells += [_f(e["final_val_loss"]), _lr(e["lr"]), _f(e["max_attention_logit"], 2)]
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return rows


def grid_table(summary: dict[str, Any]) -> list[str]:
    """Markdown: every lr tried, its final validation loss (or 'diverged'), the best in bold."""
    best = {(b["optimizer"], b["batch_size"]): b["lr"] for b in summary["best"]}
    rows = ["| optimizer | batch | steps | lr: final val loss |", "|---|---:|---:|---|"]
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in summary["runs"]:
        groups.setdefault((r["optimizer"], r["batch_size"]), []).append(r)
    for (name, batch), runs in groups.items():
        cells = []
        for r in sorted(runs, key=lambda r: r["lr"]):
            value = _f(r["final_val_loss"]) if r["status"] == "finished" else r["status"]
            cell = f"{_lr(r['lr'])}: {value}"
            cells.append(f"**{cell}**" if r["lr"] == best.get((name, batch)) and r["status"] == "finished" else cell)
        rows.append(f"| {name} | {batch} | {runs[0]['steps']} | {', '.join(cells)} |")
    return rows


def caveats(summary: dict[str, Any]) -> list[str]:
    s = summary["settings"]
    params = s.get("n_params")
    size = f"{params / 1e6:.2f}M parameters" if params else "its size"
    lines = [
        f"Scale: {s['model']} has {size} and each run saw {s['tokens_per_run']:,} tokens; the paper's "
        "results are for GPT-2 models of 125M-770M parameters trained on billions of tokens at batch "
        "sizes of 1k-8k sequences. Effects of large-batch training (and the attention-logit growth the paper "
        "reports) need not appear, or may look different, at this scale.",
        "One seed per run: the run-to-run spread was not measured, so small gaps may be noise.",
    ]
    for b in summary["best"]:
        if b.get("lr_at_edge"):
            side = "smallest" if b["lr_at_edge"] == "low" else "largest"
            lines.append(
                f"{b['optimizer']} at batch {b['batch_size']}: the best lr ({_lr(b['lr'])}) is the {side} "
                "of its grid, so its optimum may lie outside the grid (try --lrs with a wider list)."
            )
    diverged = [r for r in summary["runs"] if r["status"] == "diverged"]
    if diverged:
        lines.append(
            "Diverged runs (non-finite loss; ranked last): "
            + ", ".join(f"{r['optimizer']} b{r['batch_size']} lr {_lr(r['lr'])}" for r in diverged)
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
        f"gradient clipping at {s['grad_clip']:g}; seed {s['seed']}",
        f"- Learning rates: {s['lr_rule']}; the best per optimizer and batch size by final validation loss",
        f"- Validation: {s['eval_tokens']:,} held-out tokens; max attention logit on the first validation batch",
    ]


def render_report(summary: dict[str, Any]) -> str:
    """The whole REPORT.md."""
    s = summary["settings"]
    title = " vs ".join(s["optimizers"])
    parts = [
        f"# merit compare: {title} on {s['model']}",
        "",
        "Each optimizer at its best learning rate (by final validation loss) for each batch size, "
        "all at the same token budget. Generated from `summary.json`.",
        "",
        "## Results",
        "",
        *results_table(summary),
        "",
        "## What the numbers show",
        "",
        *[f"- {line}" for line in findings(summary)],
        "",
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
