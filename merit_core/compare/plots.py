"""compare.png: validation loss against batch size per optimizer (best lr each), the max
attention logit and validation loss against step at the largest batch size, (with --hessian)
the largest algebraic Hessian eigenvalue of each best run, and, below, the lr sensitivity: one
panel per optimizer for the final validation loss and one for the max attention logit against
lr, each batch size in its own colour and marker.

With several seeds a point is the mean over seeds; in the lr-sensitivity panels its bar spans
the seeds' minimum to maximum (it stays on a log axis, where mean ± std can go below zero), on
the batch-size panel it is ± one standard deviation, with each seed's value as a small dot; a
curve is the mean over seeds with the seeds' range shaded. A diverged lr is a triangle at the top
edge of its panel (labelled "diverged, drawn at the top edge": it has no value to plot); the
best lr of each batch is a dotted vertical line and its good band (lrs within GOOD_LR_TOLERANCE
of the best loss) shaded, except in a smoke run, which has no best lr.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from merit_core.compare.report import GOOD_LR_TOLERANCE
from merit_core.compare.results import CellResult, CompareSummary
from merit_core.compare.verdicts import no_verdict
from merit_core.fileio import atomic_path
from merit_core.metric_names import MAX_ATTENTION_LOGIT, VAL_LOSS

PLOT_FILE = "compare.png"
COLORS = {"adamw": "tab:blue", "lamb": "tab:orange", "merit": "tab:green"}
# lr-sensitivity panels: batch sizes in order of size
BATCH_COLORS = ("tab:purple", "tab:red", "tab:cyan", "tab:olive", "tab:brown", "tab:pink")
BATCH_MARKERS = ("o", "s", "D", "v", "P", "*")
DIVERGED_LABEL = "diverged (drawn at the top edge)"
UNSTABLE_LABEL = "unstable (excluded from the best)"
BEST_LABEL = "best lr"
BAND_LABEL = f"good lrs (within {100 * GOOD_LR_TOLERANCE:g}% of the best)"


def _color(name: str, index: int) -> str:
    return COLORS.get(name) or f"C{(index + 3) % 10}"


def plot_compare(summary: CompareSummary, out_dir: str | Path) -> Path:
    """Draw <out_dir>/compare.png from a comparison's typed record and return its path."""
    import matplotlib.pyplot as plt

    fig = compare_figure(summary)
    out = Path(out_dir) / PLOT_FILE
    try:
        with atomic_path(out) as tmp:
            fig.savefig(tmp, dpi=110, format="png")
    finally:
        plt.close(fig)
    return out


def compare_figure(summary: CompareSummary):
    """The matplotlib Figure of compare.png (see the module docstring): a top row of summary
    panels, then a row of loss-vs-lr and a row of max-logit-vs-lr panels, one per optimizer."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    settings = summary.settings
    optimizers, batches = settings.optimizers, settings.batch_sizes
    best = summary.best_table()
    largest = batches[-1]
    with_hessian = any(b.hessian for b in summary.best)
    panels = 4 if with_hessian else 3
    width = 5.7 * max(panels, len(optimizers))
    fig = plt.figure(figsize=(width, 14.4), layout="constrained")
    top, lr_loss_row, lr_logit_row = fig.subfigures(3, 1)
    axes = list(top.subplots(1, panels))
    ax_b, ax_logit, ax_val = axes[:3]
    lr_loss = list(lr_loss_row.subplots(1, len(optimizers), squeeze=False)[0])
    lr_logit = list(lr_logit_row.subplots(1, len(optimizers), squeeze=False)[0])

    for i, name in enumerate(optimizers):
        points = [(b, best[name, b]) for b in batches if (name, b) in best and best[name, b].finished]
        if points:
            xs, entries = zip(*points)
            ys = [e.final_val_loss for e in entries]
            errs = [e.final_val_loss_std or 0.0 for e in entries]
            ax_b.errorbar(xs, ys, yerr=errs, marker="o", color=_color(name, i), label=name, linewidth=1.6, capsize=3)
            for x, e in zip(xs, entries):
                seeds = [v for v in e.final_val_loss_values or [] if v is not None]
                if len(seeds) > 1:
                    ax_b.plot([x] * len(seeds), seeds, linestyle="", marker=".", color=_color(name, i), alpha=0.5)
            for x, y, e in zip(xs, ys, entries):
                ax_b.annotate(
                    f"lr {e.lr:.2g}",
                    (x, y),
                    textcoords="offset points",
                    xytext=(6, 4 - 10 * i),
                    fontsize="x-small",
                    color=_color(name, i),
                )
        plotted = {b for b, _ in points}
        failed = [b for b in batches if (name, b) in best and b not in plotted]
        if failed:
            ax_b.plot(
                [],
                [],
                marker="x",
                linestyle="",
                color=_color(name, i),
                label=f"{name}: diverged at batch {', '.join(map(str, failed))}",
            )
    ax_b.set_xscale("log", base=2)
    ax_b.set_xticks(batches, [str(b) for b in batches])
    ax_b.set(
        title="Final validation loss vs batch size (best lr each)",
        xlabel="batch size (sequences)",
        ylabel="validation loss (nats/token)",
    )

    for i, name in enumerate(optimizers):
        entry = best.get((name, largest))
        if entry is None or not (entry.curve or {}).get("step"):
            continue
        curve = entry.curve
        style = dict(color=_color(name, i), marker=".", linewidth=1.6)
        suffix = "" if entry.status == "finished" else " (diverged)"
        seeds = entry.seed_curves or []
        n = f", {len(seeds)} seeds" if len(seeds) > 1 else ""
        label = f"{name} (lr {entry.lr:.2g}{n}){suffix}"
        for ax, key in ((ax_logit, MAX_ATTENTION_LOGIT), (ax_val, VAL_LOSS)):
            if len(seeds) > 1 and all(s["step"] == curve["step"] for s in seeds):
                _plot_seeds(ax, curve["step"], [s[key] for s in seeds], label, style)
            else:
                _plot_series(ax, curve["step"], curve[key], label, style)
    ax_logit.set(
        title=f"Max attention logit vs step, batch {largest}",
        xlabel="step",
        ylabel="max over layers and heads of q·k/√d_head",
    )
    _log_if_spread(ax_logit)
    ax_val.set(title=f"Validation loss vs step, batch {largest}", xlabel="step", ylabel="validation loss (nats/token)")
    if with_hessian:
        _plot_hessian(axes[3], summary, optimizers, batches)
    smoke = no_verdict(summary) is not None
    groups: dict[tuple[str, int], list[CellResult]] = {}
    for r in summary.grid_cells():
        groups.setdefault((r.optimizer, r.batch_size), []).append(r)
    for name, ax_loss, ax_lr_logit in zip(optimizers, lr_loss, lr_logit):
        _plot_sensitivity(ax_loss, ax_lr_logit, name, groups, batches, mark_best=not smoke)
    for ax in (*axes, *lr_loss, *lr_logit):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    fig.suptitle(
        f"{settings.model}: {' vs '.join(optimizers)}, {settings.tokens_per_run:,} tokens per run, "
        f"seq len {settings.seq_len}" + (" (smoke run: one untuned lr each)" if smoke else "")
    )
    return fig


def _plot_sensitivity(
    ax_loss: Any,
    ax_logit: Any,
    name: str,
    groups: dict[tuple[str, int], list[CellResult]],
    batches: list[int],
    mark_best: bool = True,
) -> None:
    """One optimizer's final validation loss and max attention logit against lr, each batch in its
    own colour and marker: the mean over seeds with a min-max bar, a diverged lr as a triangle at
    the top edge, and (`mark_best`) each batch's best lr and good band (see the module docstring)."""
    from matplotlib.transforms import blended_transform_factory

    for j, b in enumerate(batches):
        cells = sorted(groups.get((name, b), []), key=lambda r: r.lr)
        if not cells:
            continue
        color, marker = BATCH_COLORS[j % len(BATCH_COLORS)], BATCH_MARKERS[j % len(BATCH_MARKERS)]
        done_loss = [r for r in cells if r.finished]
        band = None
        if mark_best and done_loss:
            top = min(r.final_val_loss for r in done_loss)
            winner = min(done_loss, key=lambda r: (r.final_val_loss, r.lr))
            good = [r.lr for r in done_loss if r.final_val_loss <= top * (1 + GOOD_LR_TOLERANCE)]
            band = (min(good), max(good), winner.lr)
        for ax, key in ((ax_loss, "final_val_loss"), (ax_logit, MAX_ATTENTION_LOGIT)):
            done = [r for r in cells if r.status == "finished" and r.value(key) is not None]
            if done:
                low, high = zip(*(_seed_range(r, key) for r in done))
                ys = [r.value(key) for r in done]
                ax.errorbar(
                    [r.lr for r in done],
                    ys,
                    yerr=[[y - lo for y, lo in zip(ys, low)], [hi - y for y, hi in zip(ys, high)]],
                    color=color,
                    marker=marker,
                    capsize=3,
                    label=f"batch {b}",
                )
            shaky = [r for r in cells if r.status == "unstable" and r.value(key) is not None]
            if shaky:
                ax.plot(
                    [r.lr for r in shaky],
                    [r.value(key) for r in shaky],
                    linestyle="",
                    marker="X",
                    markersize=9,
                    markerfacecolor="none",
                    markeredgewidth=1.6,
                    color=color,
                    label=f"batch {b}: {UNSTABLE_LABEL}",
                )
            failed = [r.lr for r in cells if not r.valued]
            if failed:
                edge = blended_transform_factory(ax.transData, ax.transAxes)  # x: lr, y: the top edge
                ax.plot(
                    failed,
                    [1.0] * len(failed),
                    linestyle="",
                    marker="^",
                    markersize=9,
                    markerfacecolor="none",
                    markeredgewidth=1.8,
                    color=color,
                    transform=edge,
                    clip_on=False,
                    label=f"batch {b}: {DIVERGED_LABEL}",
                )
            if band is not None:
                ax.axvspan(band[0], band[1], color=color, alpha=0.12, label=f"batch {b}: {BAND_LABEL}")
                ax.axvline(band[2], color=color, linestyle=":", linewidth=1.4, label=f"batch {b}: {BEST_LABEL}")
    for ax in (ax_loss, ax_logit):
        ax.set_xscale("log")
        ax.set_xlabel("peak learning rate (log scale)")
    ax_loss.set(title=f"{name}: final validation loss vs lr", ylabel="validation loss (nats/token)")
    ax_logit.set_title(f"{name}: max attention logit at the end vs lr")
    ax_logit.set_yscale("log")  # a good lr's logit is O(10), a too-large one's up to 1e7
    ax_logit.set_ylabel("max over layers and heads of q·k/√d_head (log scale)")


def _seed_range(cell: CellResult, key: str) -> tuple[float, float]:
    """The smallest and largest seed value of a cell (its mean when the seeds are not listed)."""
    values = [v for v in cell.value(f"{key}_values") or [] if v is not None]
    return (min(values), max(values)) if values else (cell.value(key), cell.value(key))


def _log_if_spread(ax: Any, ratio: float = 20.0) -> None:
    """A log y axis when the plotted positive values span more than `ratio` (so small curves stay visible)."""
    values = [y for line in ax.get_lines() for y in line.get_ydata()]
    if values and min(values) > 0 and max(values) / min(values) > ratio:
        ax.set_yscale("log")
        ax.set_ylabel(ax.get_ylabel() + " (log scale)")


def _plot_seeds(ax: Any, steps: list[int], series: list[list[float | None]], label: str, style: dict) -> None:
    """The mean over seeds at each step where every seed has a value, with the seeds' range shaded."""
    points = [(s, [v[k] for v in series]) for k, s in enumerate(steps) if all(v[k] is not None for v in series)]
    if not points:
        return
    xs = [s for s, _ in points]
    ax.plot(xs, [sum(v) / len(v) for _, v in points], label=label, **style)
    ax.fill_between(xs, [min(v) for _, v in points], [max(v) for _, v in points], color=style["color"], alpha=0.2)


def _plot_hessian(ax: Any, summary: CompareSummary, optimizers: list[str], batches: list[int]) -> None:
    """Bars: the largest algebraic Hessian eigenvalue of each best run (± std over seeds, seed values as dots)."""
    labels, x = [], 0
    for i, name in enumerate(optimizers):
        for b in batches:
            entry = summary.best_for(name, b)
            h = (entry.hessian if entry else None) or {}
            if h.get("largest_algebraic_eigenvalue") is None:
                continue
            ax.bar(
                x,
                h["largest_algebraic_eigenvalue"],
                yerr=h.get("largest_algebraic_eigenvalue_std") or 0.0,
                color=_color(name, i),
                capsize=3,
            )
            seeds = [v for v in h.get("largest_algebraic_eigenvalue_values") or [] if v is not None]
            if len(seeds) > 1:
                ax.plot([x] * len(seeds), seeds, linestyle="", marker=".", color="black", alpha=0.6)
            if h.get("trace") is not None:
                top = h["largest_algebraic_eigenvalue"] + (h.get("largest_algebraic_eigenvalue_std") or 0.0)
                ax.annotate(
                    f"tr {h['trace']:.3g}",
                    (x, top),
                    ha="center",
                    va="bottom",
                    textcoords="offset points",
                    xytext=(0, 3),
                    fontsize="x-small",
                )
            labels.append((x, f"{name}\nb{b}"))
            x += 1
    if labels:
        ax.set_xticks([p for p, _ in labels], [t for _, t in labels], fontsize="small")
    paper = (summary.settings.paper or {}).get("hessian") or {}
    ref = ", ".join(f"{o} {v:g}" for o, v in (paper.get("top_eigenvalue") or {}).items())
    ax.set(
        title="Largest algebraic Hessian eigenvalue of the final weights (tr: trace)",
        ylabel="largest algebraic eigenvalue (validation batch)",
        xlabel=f"optimizer and batch; paper, {paper.get('model', 'GPT-2 Small')} (top by power iteration): {ref}"
        if ref
        else "optimizer and batch",
    )


def _plot_series(ax: Any, steps: list[int], values: list[float | None], label: str, style: dict[str, Any]) -> None:
    points = [(s, v) for s, v in zip(steps, values) if v is not None]
    if points:
        ax.plot(*zip(*points), label=label, **style)
