"""compare.png: a top row of summary panels (final validation loss and max attention logit
against batch size per optimizer at its best lr, the max attention logit and validation loss
against step at the largest batch size, and with --hessian the largest algebraic Hessian
eigenvalue of each best run), and below, the lr sensitivity: one panel per optimizer for the
final validation loss and one for the max attention logit against lr, each batch size in its
own colour and marker.

With several seeds a point is the mean over seeds and its bar spans the seeds' minimum to
maximum, in every panel (a range stays on a log axis, where mean ± std can go below zero; the
panel titles say so); each seed's value is a small dot; a curve is the mean over seeds with the
seeds' range shaded. A diverged lr is a triangle at the top edge of its panel (labelled
"diverged, drawn at the top edge": it has no value to plot), an unstable one a hollow cross at
its value (merit_core.compare.stability); the best lr of each batch is a dotted vertical line
and its good band (lrs within GOOD_LR_TOLERANCE of the best loss) shaded. A smoke run (one
untuned lr per cell) has no best lr and no lr sensitivity: its figure is the top row alone,
titled as a smoke run. Legends sit outside the data: below each top-row panel, and one per lr
row below the row.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any, cast

from merit_core.compare.markdown_report import GOOD_LR_TOLERANCE
from merit_core.compare.results import BestResult, CellResult, CompareSummary
from merit_core.compare.verdicts import no_verdict, num
from merit_core.durable_writes import atomic_path
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
BARS = "bars: seeds' min-max"  # what every error bar spans, said in each panel with bars
SMOKE_TITLE = "smoke run: one untuned lr each, no best lr"
LOGIT_LABEL = "max over layers and heads of q·k/√d_head"


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


def compare_figure(summary: CompareSummary) -> Any:
    """The matplotlib Figure of compare.png (see the module docstring)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    settings = summary.settings
    optimizers, batches = settings.optimizers, settings.batch_sizes
    best = summary.best_table()
    largest = batches[-1]
    smoke = no_verdict(summary) is not None
    with_hessian = any(b.hessian for b in summary.best)
    panels = 5 if with_hessian else 4
    width = 5.2 * max(panels, 0 if smoke else len(optimizers))
    fig = plt.figure(figsize=(width, 5.6 if smoke else 15.6), layout="constrained")
    rows: list[Any] = [fig] if smoke else list(cast(Iterable[Any], fig.subfigures(3, 1, height_ratios=[1.05, 1, 1])))
    axes = list(rows[0].subplots(1, panels))
    ax_b, ax_lb, ax_logit, ax_val = axes[:4]
    which = "one untuned lr each" if smoke else "best lr each"
    for ax, key, title, ylabel in (
        (ax_b, "final_val_loss", "Final validation loss vs batch size", "validation loss (nats/token)"),
        (ax_lb, MAX_ATTENTION_LOGIT, "Max attention logit at the end vs batch size", LOGIT_LABEL),
    ):
        _plot_vs_batch(ax, key, best, optimizers, batches)
        ax.set(title=f"{title}\n({which}; {BARS})", xlabel="batch size (sequences)", ylabel=ylabel)
    _log_if_spread(ax_lb)

    for i, name in enumerate(optimizers):
        entry = best.get((name, largest))
        curve = entry.curve if entry is not None else None
        if entry is None or curve is None or not curve.step:
            continue
        style = dict(color=_color(name, i), marker=".", linewidth=1.6)
        suffix = "" if entry.status == "finished" else f" ({entry.status})"
        seeds = entry.seed_curves or []
        n = f", {len(seeds)} seeds" if len(seeds) > 1 else ""
        label = f"{name} (lr {entry.lr:.2g}{n}){suffix}"
        for ax, key in ((ax_logit, MAX_ATTENTION_LOGIT), (ax_val, VAL_LOSS)):
            if len(seeds) > 1 and all(s.step == curve.step for s in seeds):
                _plot_seeds(ax, curve.step, [s.series(key) for s in seeds], label, style)
            else:
                _plot_series(ax, curve.step, curve.series(key), label, style)
    shade = "; shaded: seeds' min-max" if any(len(b.seed_curves or []) > 1 for b in summary.best) else ""
    ax_logit.set(title=f"Max attention logit vs step, batch {largest}\n({which}{shade})", xlabel="step")
    ax_logit.set_ylabel(LOGIT_LABEL)
    _log_if_spread(ax_logit)
    ax_val.set(
        title=f"Validation loss vs step, batch {largest}\n({which}{shade})",
        xlabel="step",
        ylabel="validation loss (nats/token)",
    )
    if with_hessian:
        _plot_hessian(axes[4], summary, optimizers, batches)
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.title.set_fontsize("medium")  # two-line titles within their panel's width
        _legend_below(ax)
    if not smoke:
        groups: dict[tuple[str, int], list[CellResult]] = {}
        for r in summary.grid_cells():
            groups.setdefault((r.optimizer, r.batch_size), []).append(r)
        lr_loss = list(rows[1].subplots(1, len(optimizers), squeeze=False)[0])
        lr_logit = list(rows[2].subplots(1, len(optimizers), squeeze=False)[0])
        for name, ax_loss, ax_lr_logit in zip(optimizers, lr_loss, lr_logit):
            _plot_sensitivity(ax_loss, ax_lr_logit, name, groups, batches)
        for row, row_axes in ((rows[1], lr_loss), (rows[2], lr_logit)):
            for ax in row_axes:
                ax.grid(alpha=0.3)
            _row_legend(row, row_axes)
    fig.suptitle(
        f"{settings.model}: {' vs '.join(optimizers)}, {settings.tokens_per_run:,} tokens per run, "
        f"seq len {settings.seq_len}" + (f" ({SMOKE_TITLE})" if smoke else "")
    )
    return fig


def _legend_below(ax: Any) -> None:
    """The axes' legend under its x label, outside the data (none without labelled artists)."""
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        ax.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.16), fontsize="small", ncols=2)


def _row_legend(row: Any, row_axes: list[Any]) -> None:
    """One legend for a row of lr panels (their entries are the same batches and marks), below the row."""
    entries: dict[str, Any] = {}
    for ax in row_axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            entries.setdefault(label, handle)
    if entries:
        row.legend(list(entries.values()), list(entries), loc="outside lower center", ncols=4, fontsize="small")


def _plot_vs_batch(
    ax: Any, key: str, best: dict[tuple[str, int], BestResult], optimizers: list[str], batches: list[int]
) -> None:
    """Each optimizer's best cell at each batch: the mean of `key` over seeds, a bar from the seeds'
    minimum to maximum, each seed a dot, the lr beside the point; a batch whose best is not
    finished (every lr diverged or unstable) is named in the legend."""
    for i, name in enumerate(optimizers):
        points = [(b, best[name, b]) for b in batches if (name, b) in best and best[name, b].finished]
        points = [(b, e) for b, e in points if e.value(key) is not None]
        color = _color(name, i)
        if points:
            xs = [b for b, _ in points]
            ys = [float(e.value(key)) for _, e in points]
            low, high = zip(*(_seed_range(e, key) for _, e in points))
            errors = [[y - lo for y, lo in zip(ys, low)], [hi - y for y, hi in zip(ys, high)]]
            ax.errorbar(xs, ys, yerr=errors, marker="o", color=color, label=name, linewidth=1.6, capsize=3)
            for x, (_, e) in zip(xs, points):
                seeds = [v for v in e.value(f"{key}_values") or [] if v is not None]
                if len(seeds) > 1:
                    ax.plot([x] * len(seeds), seeds, linestyle="", marker=".", color=color, alpha=0.5)
            for x, y, (_, e) in zip(xs, ys, points):
                ax.annotate(
                    f"lr {e.lr:.2g}",
                    (x, y),
                    textcoords="offset points",
                    xytext=(6, 4 - 10 * i),
                    fontsize="x-small",
                    color=color,
                )
        plotted = {b for b, _ in points}
        failed = [(b, best[name, b].status) for b in batches if (name, b) in best and b not in plotted]
        if failed:
            ax.plot(
                [],
                [],
                marker="x",
                linestyle="",
                color=color,
                label=f"{name}: " + ", ".join(f"{status} at batch {b}" for b, status in failed),
            )
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.minorticks_off()


def _hollow(ax, xs, ys, marker: str, edge_width: float, color, label: str, **more) -> None:
    """Hollow markers without a line: the lrs a cell could not value (unstable, or not finished)."""
    ax.plot(
        xs,
        ys,
        linestyle="",
        marker=marker,
        markersize=9,
        markerfacecolor="none",
        markeredgewidth=edge_width,
        color=color,
        label=label,
        **more,
    )


def _plot_sensitivity(
    ax_loss: Any,
    ax_logit: Any,
    name: str,
    groups: dict[tuple[str, int], list[CellResult]],
    batches: list[int],
) -> None:
    """One optimizer's final validation loss and max attention logit against lr, each batch in its
    own colour and marker: the mean over seeds with a min-max bar, a diverged lr as a triangle at
    the top edge, an unstable one as a hollow cross, and each batch's best lr and good band (see
    the module docstring)."""
    from matplotlib.ticker import LogFormatterSciNotation, LogLocator, NullFormatter
    from matplotlib.transforms import blended_transform_factory

    for j, b in enumerate(batches):
        cells = sorted(groups.get((name, b), []), key=lambda r: r.lr)
        if not cells:
            continue
        color, marker = BATCH_COLORS[j % len(BATCH_COLORS)], BATCH_MARKERS[j % len(BATCH_MARKERS)]
        done_loss = [(num(r.final_val_loss), r.lr) for r in cells if r.finished]
        band = None
        if done_loss:
            top, best_lr = min(done_loss)
            good = [lr for loss, lr in done_loss if loss <= top * (1 + GOOD_LR_TOLERANCE)]
            band = (min(good), max(good), best_lr)
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
                _hollow(
                    ax,
                    [r.lr for r in shaky],
                    [r.value(key) for r in shaky],
                    "X",
                    1.6,
                    color,
                    f"batch {b}: {UNSTABLE_LABEL}",
                )
            failed = [r.lr for r in cells if not r.valued]
            if failed:
                edge = blended_transform_factory(ax.transData, ax.transAxes)  # x: lr, y: the top edge
                _hollow(
                    ax,
                    failed,
                    [1.0] * len(failed),
                    "^",
                    1.8,
                    color,
                    f"batch {b}: {DIVERGED_LABEL}",
                    transform=edge,
                    clip_on=False,
                )
            if band is not None:
                ax.axvspan(band[0], band[1], color=color, alpha=0.12, label=f"batch {b}: {BAND_LABEL}")
                ax.axvline(band[2], color=color, linestyle=":", linewidth=1.4, label=f"batch {b}: {BEST_LABEL}")
    for ax in (ax_loss, ax_logit):
        ax.set_xscale("log")
        # labelled ticks at 1 and 3 x each decade only: the minor ticks' labels collide on a grid
        # spanning one or two decades
        ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 3.0)))
        ax.xaxis.set_major_formatter(LogFormatterSciNotation(labelOnlyBase=False))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("peak learning rate (log scale)")
    ax_loss.set(title=f"{name}: final validation loss vs lr\n({BARS})", ylabel="validation loss (nats/token)")
    ax_logit.set_title(f"{name}: max attention logit at the end vs lr\n({BARS})")
    ax_logit.set_yscale("log")  # a good lr's logit is O(10), a too-large one's up to 1e7
    ax_logit.set_ylabel(f"{LOGIT_LABEL} (log scale)")


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
    points = [(s, [num(v[k]) for v in series]) for k, s in enumerate(steps) if all(v[k] is not None for v in series)]
    if not points:
        return
    xs = [s for s, _ in points]
    ax.plot(xs, [sum(v) / len(v) for _, v in points], label=label, **style)
    ax.fill_between(xs, [min(v) for _, v in points], [max(v) for _, v in points], color=style["color"], alpha=0.2)


def _plot_hessian(ax: Any, summary: CompareSummary, optimizers: list[str], batches: list[int]) -> None:
    """Bars: the largest algebraic Hessian eigenvalue of each best run (mean over seeds; error bar:
    the seeds' min-max, seed values as dots; the trace written above)."""
    key = "largest_algebraic_eigenvalue"
    labels, x = [], 0
    for i, name in enumerate(optimizers):
        for b in batches:
            entry = summary.best_for(name, b)
            h = (entry.hessian if entry else None) or {}
            if h.get(key) is None:
                continue
            seeds = [v for v in h.get(f"{key}_values") or [] if v is not None]
            low, high = (min(seeds), max(seeds)) if seeds else (h[key], h[key])
            ax.bar(x, h[key], yerr=[[h[key] - low], [high - h[key]]], color=_color(name, i), capsize=3)
            if len(seeds) > 1:
                ax.plot([x] * len(seeds), seeds, linestyle="", marker=".", color="black", alpha=0.6)
            if h.get("trace") is not None:
                ax.annotate(
                    f"tr {h['trace']:.3g}",
                    (x, max(high, h[key])),
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
        title=f"Largest algebraic Hessian eigenvalue, final weights\n(best lr each; tr: trace; {BARS})",
        ylabel="largest algebraic eigenvalue (validation batch)",
        xlabel="optimizer and batch" + (f"\npaper ({paper.get('model', 'GPT-2 Small')}, top): {ref}" if ref else ""),
    )
    ax.margins(y=0.12)  # room above the tallest bar for its trace


def _plot_series(ax: Any, steps: list[int], values: list[float | None], label: str, style: dict[str, Any]) -> None:
    points = [(s, v) for s, v in zip(steps, values) if v is not None]
    if points:
        ax.plot(*zip(*points), label=label, **style)
