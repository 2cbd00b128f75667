"""compare.png: validation loss against batch size per optimizer (best lr each), the max
attention logit and validation loss against step at the largest batch size, and (with
--hessian) the top Hessian eigenvalue of each best run.

With several seeds a point is the mean over seeds with a bar of ± one standard deviation and
each seed's value as a small dot; a curve is the mean over seeds with the seeds' range shaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from merit_core.fileio import atomic_path
from merit_core.metric_names import MAX_ATTENTION_LOGIT, VAL_LOSS

PLOT_FILE = "compare.png"
COLORS = {"adamw": "tab:blue", "lamb": "tab:orange", "merit": "tab:green"}


def _color(name: str, index: int) -> str:
    return COLORS.get(name) or f"C{(index + 3) % 10}"


def plot_compare(summary: dict[str, Any], out_dir: str | Path) -> Path:
    """Draw <out_dir>/compare.png from a summary (see merit_core.compare.summary) and return its path."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    settings = summary["settings"]
    optimizers, batches = settings["optimizers"], settings["batch_sizes"]
    best = {(b["optimizer"], b["batch_size"]): b for b in summary["best"]}
    largest = batches[-1]
    with_hessian = any(b.get("hessian") for b in summary["best"])
    panels = 4 if with_hessian else 3
    fig, axes = plt.subplots(1, panels, figsize=(5.7 * panels, 4.8), constrained_layout=True)
    ax_b, ax_logit, ax_val = axes[:3]

    for i, name in enumerate(optimizers):
        points = [
            (b, best[name, b])
            for b in batches
            if (name, b) in best
            and best[name, b]["status"] == "finished"
            and best[name, b]["final_val_loss"] is not None
        ]
        if points:
            xs, entries = zip(*points)
            ys = [e["final_val_loss"] for e in entries]
            errs = [e.get("final_val_loss_std") or 0.0 for e in entries]
            ax_b.errorbar(xs, ys, yerr=errs, marker="o", color=_color(name, i), label=name, linewidth=1.6, capsize=3)
            for x, e in zip(xs, entries):
                seeds = [v for v in e.get("final_val_loss_values") or [] if v is not None]
                if len(seeds) > 1:
                    ax_b.plot([x] * len(seeds), seeds, linestyle="", marker=".", color=_color(name, i), alpha=0.5)
            for x, y, e in zip(xs, ys, entries):
                ax_b.annotate(
                    f"lr {e['lr']:.2g}",
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
        if entry is None or not entry.get("curve", {}).get("step"):
            continue
        curve = entry["curve"]
        style = dict(color=_color(name, i), marker=".", linewidth=1.6)
        suffix = "" if entry["status"] == "finished" else " (diverged)"
        seeds = entry.get("seed_curves") or []
        n = f", {len(seeds)} seeds" if len(seeds) > 1 else ""
        label = f"{name} (lr {entry['lr']:.2g}{n}){suffix}"
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
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    fig.suptitle(
        f"{settings['model']}: {' vs '.join(optimizers)}, {settings['tokens_per_run']:,} tokens per run, "
        f"seq len {settings['seq_len']}"
    )
    out = Path(out_dir) / PLOT_FILE
    try:
        with atomic_path(out) as tmp:
            fig.savefig(tmp, dpi=110, format="png")
    finally:
        plt.close(fig)
    return out


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


def _plot_hessian(ax: Any, summary: dict[str, Any], optimizers: list[str], batches: list[int]) -> None:
    """Bars: the top Hessian eigenvalue of each best run (± std over seeds, seed values as dots)."""
    labels, x = [], 0
    for i, name in enumerate(optimizers):
        for b in batches:
            entry = next((e for e in summary["best"] if (e["optimizer"], e["batch_size"]) == (name, b)), None)
            h = (entry or {}).get("hessian") or {}
            if h.get("top_eigenvalue") is None:
                continue
            ax.bar(x, h["top_eigenvalue"], yerr=h.get("top_eigenvalue_std") or 0.0, color=_color(name, i), capsize=3)
            seeds = [v for v in h.get("top_eigenvalue_values") or [] if v is not None]
            if len(seeds) > 1:
                ax.plot([x] * len(seeds), seeds, linestyle="", marker=".", color="black", alpha=0.6)
            if h.get("trace") is not None:
                top = h["top_eigenvalue"] + (h.get("top_eigenvalue_std") or 0.0)
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
    paper = (summary["settings"].get("paper") or {}).get("hessian") or {}
    ref = ", ".join(f"{o} {v:g}" for o, v in (paper.get("top_eigenvalue") or {}).items())
    ax.set(
        title="Top Hessian eigenvalue of the final weights (tr: trace)",
        ylabel="top eigenvalue (validation batch)",
        xlabel=f"paper, {paper.get('model', 'GPT-2 Small')}: {ref}" if ref else "",
    )


def _plot_series(ax: Any, steps: list[int], values: list[float | None], label: str, style: dict[str, Any]) -> None:
    points = [(s, v) for s, v in zip(steps, values) if v is not None]
    if points:
        ax.plot(*zip(*points), label=label, **style)
