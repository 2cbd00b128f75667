"""Figures of an inspect report: per-layer bars across checkpoints, or trajectories over training steps.

Both figures have one panel per quantity: ||W_Q||_m, ||W_K||_m, their product
||W_Q||_m·||W_K||_m (the report's "bound" field: the weight term of MERIT's bound, not a bound on
the logit by itself), and the max attention logit when it was measured. They read the typed
report of `merit_core.diagnostics.report`. Written with the Agg backend, to a temp file then
renamed.
"""

from __future__ import annotations

from pathlib import Path

from merit_core.fileio import atomic_path
from merit_core.metric_names import MAX_ATTENTION_LOGIT

PANELS = (
    ("q_max_norm", "max-norm of $W_Q$", r"$\|W_Q\|_m$"),
    ("k_max_norm", "max-norm of $W_K$", r"$\|W_K\|_m$"),
    ("bound", r"max-norm product $\|W_Q\|_m \cdot \|W_K\|_m$", r"$\|W_Q\|_m \|W_K\|_m$"),
    (MAX_ATTENTION_LOGIT, "max attention logit (probe batch)", "max logit"),
)


def short_labels(labels: list[str]) -> list[str]:
    """Labels without the folders they all share ('/runs/a/step_5', '/runs/b/step_5' -> 'a/step_5', ...)."""
    parts = [Path(label).parts for label in labels]
    common = 0
    while len(labels) > 1 and all(len(p) > common + 1 and p[common] == parts[0][common] for p in parts):
        common += 1
    return [str(Path(*p[common:])) for p in parts]


def _panels(checkpoints: list) -> list[tuple[str, str, str]]:
    have_logits = any(l.max_attention_logit is not None for c in checkpoints for l in c.layers)
    return [p for p in PANELS if p[0] != MAX_ATTENTION_LOGIT or have_logits]


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


def _save(plt, fig, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, dpi=120, format=path.suffix.lstrip(".").lower() or "png")
    finally:
        plt.close(fig)


def plot_layers(checkpoints: list, path: str | Path) -> None:
    """Grouped bars: x = layer, one bar colour per checkpoint, one panel per quantity."""
    panels = _panels(checkpoints)
    n_layers = max(c.n_layers for c in checkpoints)
    plt, fig, axes = _figure(len(panels), max(9.0, 0.45 * n_layers * max(1, len(checkpoints)) + 3))
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
    fig.legend(
        *axes[0].get_legend_handles_labels(),
        loc="outside lower center",
        ncols=min(4, len(checkpoints)),
        fontsize="small",
    )
    fig.suptitle("Query/key max-norms and attention logits per layer")
    _save(plt, fig, Path(path))


def plot_trajectory(checkpoints: list, path: str | Path) -> None:
    """Lines over training steps: one per layer for a single run, one per run (max over layers) for several."""
    runs: dict[str, list] = {}
    for c in checkpoints:
        runs.setdefault(c.run or c.path, []).append(c)
    for cks in runs.values():
        cks.sort(key=lambda c: c.step or 0)
    panels = _panels(checkpoints)
    plt, fig, axes = _figure(len(panels), 11.0)
    if len(runs) == 1:
        (cks,) = runs.values()
        n_layers = cks[0].n_layers
        cmap = plt.get_cmap("viridis")
        steps = [c.step or 0 for c in cks]
        for ax, (key, title, ylabel) in zip(axes, panels):
            for layer in range(n_layers):
                ys = [getattr(c.layers[layer], key) if layer < len(c.layers) else None for c in cks]
                ax.plot(
                    steps,
                    [float("nan") if y is None else y for y in ys],
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
            ax.set_title(f"{title}, max over layers")
            ax.set_xlabel("step")
            ax.set_ylabel(ylabel)
        fig.legend(
            *axes[0].get_legend_handles_labels(), loc="outside lower center", ncols=min(4, len(runs)), fontsize="small"
        )
        fig.suptitle("Trajectories over training steps")
    for ax, (_, _, ylabel) in zip(axes, panels):
        ax.set_xlabel("training step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    _save(plt, fig, Path(path))


def plot_report(report, path: str | Path) -> str:
    """Trajectory when a run folder was given (with 2+ steps), otherwise per-layer bars; returns which.

    `report` is an `InspectReport`."""
    checkpoints = report.checkpoints
    is_run = any(i.kind == "run" for i in report.inputs) and len(checkpoints) > 1
    if is_run and all(c.step is not None for c in checkpoints):
        plot_trajectory(checkpoints, path)
        return "trajectory"
    plot_layers(checkpoints, path)
    return "layers"
