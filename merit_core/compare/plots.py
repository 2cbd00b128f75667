"""compare.png: validation loss against batch size per optimizer (best lr each), and the max
attention logit and validation loss against step at the largest batch size."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

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
    fig, (ax_b, ax_logit, ax_val) = plt.subplots(1, 3, figsize=(17, 4.8), constrained_layout=True)

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
            ax_b.plot(xs, ys, marker="o", color=_color(name, i), label=name, linewidth=1.6)
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
        label = f"{name} (lr {entry['lr']:.2g}){suffix}"
        _plot_series(ax_logit, curve["step"], curve["max_attention_logit"], label, style)
        _plot_series(ax_val, curve["step"], curve["val_loss"], label, style)
    ax_logit.set(
        title=f"Max attention logit vs step, batch {largest}",
        xlabel="step",
        ylabel="max over layers and heads of q·k/√d_head",
    )
    _log_if_spread(ax_logit)
    ax_val.set(title=f"Validation loss vs step, batch {largest}", xlabel="step", ylabel="validation loss (nats/token)")
    for ax in (ax_b, ax_logit, ax_val):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    fig.suptitle(
        f"{settings['model']}: {' vs '.join(optimizers)}, {settings['tokens_per_run']:,} tokens per run, "
        f"seq len {settings['seq_len']}"
    )
    out = Path(out_dir) / PLOT_FILE
    tmp = out.with_name(".tmp-" + PLOT_FILE)
    fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    os.replace(tmp, out)
    return out


def _log_if_spread(ax: Any, ratio: float = 20.0) -> None:
    """A log y axis when the plotted positive values span more than `ratio` (so small curves stay visible)."""
    values = [y for line in ax.get_lines() for y in line.get_ydata()]
    if values and min(values) > 0 and max(values) / min(values) > ratio:
        ax.set_yscale("log")
        ax.set_ylabel(ax.get_ylabel() + " (log scale)")


def _plot_series(ax: Any, steps: list[int], values: list[float | None], label: str, style: dict[str, Any]) -> None:
    points = [(s, v) for s, v in zip(steps, values) if v is not None]
    if points:
        ax.plot(*zip(*points), label=label, **style)
