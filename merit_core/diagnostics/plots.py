"""Figures of an inspect report: per-layer bars across checkpoints, or trajectories over training steps.

Both figures have one panel per quantity: ||W_Q||_m, ||W_K||_m, their product
||W_Q||_m·||W_K||_m (the report's "bound" field: the weight term of MERIT's bound, not a bound on
the logit by itself), and, when the probe ran, the max attention logit, the smallest normalised
attention entropy and the residual stream's max / median |h| per layer, the output layer's mean
log Z, and the largest update / weight ratio when the checkpoint had optimizer state (one value
per checkpoint for the last two). They read the typed
report of `merit_core.diagnostics.inspect_report`. Written with the Agg backend, to a temp file then
renamed.
"""

from __future__ import annotations

from pathlib import Path

from merit_core.durable_writes import atomic_path
from merit_core.metric_names import (
    ACTIVATION_RATIO,
    LOG_Z_MEAN,
    MAX_ATTENTION_LOGIT,
    NORMALIZED_ENTROPY_MIN,
    UPDATE_RATIO,
)

PANELS = (
    ("q_max_norm", "max-norm of $W_Q$", r"$\|W_Q\|_m$"),
    ("k_max_norm", "max-norm of $W_K$", r"$\|W_K\|_m$"),
    ("bound", r"max-norm product $\|W_Q\|_m \cdot \|W_K\|_m$", r"$\|W_Q\|_m \|W_K\|_m$"),
    (MAX_ATTENTION_LOGIT, "max attention logit (probe batch)", "max logit"),
    (NORMALIZED_ENTROPY_MIN, "min attention entropy / log(keys seen)", "H / log n"),
    (ACTIVATION_RATIO, "residual stream max |h| / median |h|", "max / median"),
)
# one value per checkpoint (the report's summary), shown over steps or as one bar per checkpoint
CHECKPOINT_PANELS = (
    (LOG_Z_MEAN, "output log Z, mean over positions", "log Z"),
    (UPDATE_RATIO, "largest RMS(update) / RMS(weight)", "update / weight"),
)


def short_labels(labels: list[str]) -> list[str]:
    """Labels without the folders they all share ('/runs/a/step_5', '/runs/b/step_5' -> 'a/step_5', ...)."""
    parts = [Path(label).parts for label in labels]
    common = 0
    while len(labels) > 1 and all(len(p) > common + 1 and p[common] == parts[0][common] for p in parts):
        common += 1
    return [str(Path(*p[common:])) for p in parts]


def _panels(checkpoints: list) -> list[tuple[str, str, str]]:
    """The per-layer panels with a value in some checkpoint (the weight norms always)."""
    return [p for p in PANELS[:3]] + [
        p for p in PANELS[3:] if any(getattr(l, p[0]) is not None for c in checkpoints for l in c.layers)
    ]


def _checkpoint_panels(checkpoints: list) -> list[tuple[str, str, str]]:
    return [p for p in CHECKPOINT_PANELS if any(getattr(c.summary, p[0]) is not None for c in checkpoints)]


def _over_layers(key: str) -> str:
    """Which end of the layers a run's summary keeps for a panel: the entropy's smallest, the others' largest
    (merit_core.diagnostics.inspect_report.Summary)."""
    return "min" if key == NORMALIZED_ENTROPY_MIN else "max"


def _integer_steps(ax) -> None:
    """Step axes tick at whole steps (a lone step 5 otherwise spans a 4.8-5.2 axis of fractions)."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _nan(y) -> float:
    return float("nan") if y is None else y


def _figure(n_panels: int, width: float):
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    cols = 2
    rows = -(-n_panels // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(width, 3.6 * rows), squeeze=False, constrained_layout=True)
    for ax in axes.flat[n_panels:]:
        ax.set_visible(False)
    return plt, fig, list(axes.flat[:n_panels])


def save_figure(plt, fig, path: Path) -> None:
    """Write `fig` to `path` atomically (format from the suffix) and close it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, dpi=120, format=path.suffix.lstrip(".").lower() or "png")
    finally:
        plt.close(fig)


def plot_layers(checkpoints: list, path: str | Path) -> None:
    """Grouped bars: x = layer, one bar colour per checkpoint, one panel per quantity."""
    panels, extra = _panels(checkpoints), _checkpoint_panels(checkpoints)
    n_layers = max(c.n_layers for c in checkpoints)
    plt, fig, axes = _figure(len(panels) + len(extra), max(9.0, 0.45 * n_layers * max(1, len(checkpoints)) + 3))
    width = 0.8 / len(checkpoints)
    cmap = plt.get_cmap("tab10")
    labels = short_labels([c.label for c in checkpoints])
    for ax, (key, title, ylabel) in zip(axes, panels):
        for i, ckpt in enumerate(checkpoints):
            xs = [l.layer + (i - (len(checkpoints) - 1) / 2) * width for l in ckpt.layers]
            ys = [getattr(l, key) if getattr(l, key) is not None else 0.0 for l in ckpt.layers]
            ax.bar(xs, ys, width=width, color=cmap(i % 10), label=labels[i])
        ax.set_title(title)
        ax.set_xlabel("layer")
        ax.set_ylabel(ylabel)
        ax.set_xticks(range(n_layers))
        ax.grid(axis="y", alpha=0.3)
    for ax, (key, title, ylabel) in zip(axes[len(panels) :], extra):
        ax.bar(
            labels,
            [_nan(getattr(c.summary, key)) for c in checkpoints],
            color=[cmap(i % 10) for i in range(len(labels))],
        )
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        ax.tick_params(axis="x", labelrotation=20, labelsize="small")
        ax.grid(axis="y", alpha=0.3)
    fig.legend(
        *axes[0].get_legend_handles_labels(),
        loc="outside lower center",
        ncols=min(4, len(checkpoints)),
        fontsize="small",
    )
    fig.suptitle("Query/key max-norms, attention and activations per layer")
    save_figure(plt, fig, Path(path))


def plot_trajectory(checkpoints: list, path: str | Path) -> None:
    """Lines over training steps: one per layer for a single run, one per run (max over layers) for several."""
    runs: dict[str, list] = {}
    for c in checkpoints:
        runs.setdefault(c.run or c.path, []).append(c)
    for cks in runs.values():
        cks.sort(key=lambda c: c.step or 0)
    panels, extra = _panels(checkpoints), _checkpoint_panels(checkpoints)
    plt, fig, axes = _figure(len(panels) + len(extra), 11.0)
    for ax, (key, title, _) in zip(axes[len(panels) :], extra):
        names = short_labels(list(runs))
        for i, cks in enumerate(runs.values()):
            ys = [_nan(getattr(c.summary, key)) for c in cks]
            ax.plot(
                [c.step or 0 for c in cks],
                ys,
                marker="o",
                markersize=3,
                color="black" if len(runs) == 1 else None,
                label=names[i],
            )
        ax.set_title(title)
    if len(runs) == 1:
        (cks,) = runs.values()
        n_layers = cks[0].n_layers
        cmap = plt.get_cmap("viridis")
        steps = [c.step or 0 for c in cks]
        for ax, (key, title, ylabel) in zip(axes, panels):
            for layer in range(n_layers):
                values = [getattr(c.layers[layer], key) if layer < len(c.layers) else None for c in cks]
                ax.plot(
                    steps,
                    [float("nan") if y is None else y for y in values],
                    marker="o",
                    markersize=3,
                    color=cmap(layer / max(1, n_layers - 1)),
                    label=f"layer {layer}",
                )
            ax.set_title(title)
            ax.set_xlabel("step")
            ax.set_ylabel(ylabel)
        handles, labels = axes[0].get_legend_handles_labels()
        fig.legend(
            handles,
            labels,
            loc="outside right center",
            fontsize="small",
            title="layer",
            ncols=1 if n_layers <= 16 else 2,
        )
        fig.suptitle(f"{Path(next(iter(runs))).name}: per-layer trajectory over training steps")
    else:
        cmap = plt.get_cmap("tab10")
        names = short_labels(list(runs))
        for ax, (key, title, ylabel) in zip(axes, panels):
            for i, cks in enumerate(runs.values()):
                steps = [c.step or 0 for c in cks]
                ys = [getattr(c.summary, key) for c in cks]
                ax.plot(
                    steps,
                    [float("nan") if y is None else y for y in ys],
                    marker="o",
                    markersize=3,
                    color=cmap(i % 10),
                    label=names[i],
                )
            ax.set_title(f"{title}, {_over_layers(key)} over layers")
            ax.set_xlabel("step")
            ax.set_ylabel(ylabel)
        fig.legend(
            *axes[0].get_legend_handles_labels(), loc="outside lower center", ncols=min(4, len(runs)), fontsize="small"
        )
        fig.suptitle("Trajectories over training steps")
    for ax, (_, _, ylabel) in zip(axes, panels + extra):
        ax.set_xlabel("training step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        _integer_steps(ax)
    save_figure(plt, fig, Path(path))


def plot_report(report, path: str | Path) -> str:
    """Trajectory when a run folder was given and some run has 2+ steps, otherwise per-layer bars; returns which.

    `report` is an `InspectReport`."""
    checkpoints = report.checkpoints
    steps: dict[str, set[int | None]] = {}
    for c in checkpoints:
        steps.setdefault(c.run or c.path, set()).add(c.step)
    # a trajectory needs a run with two steps at least; one checkpoint per run is a bar chart
    is_run = any(i.kind == "run" for i in report.inputs) and max(map(len, steps.values()), default=0) > 1
    if is_run and all(c.step is not None for c in checkpoints):
        plot_trajectory(checkpoints, path)
        return "trajectory"
    plot_layers(checkpoints, path)
    return "layers"
