"""curves.png's image: training/validation loss and the max attention logit per layer against step
(drawn here, written into the run folder by its owner, merit_core.train.run_folder)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from merit_core.metric_names import MAX_ATTENTION_LOGIT, VAL_LOSS
from merit_core.metrics import read_metrics


def plot_curves(run_dir: str | Path, title: str | None = None) -> bytes | None:
    """The PNG image of <run>/curves.png drawn from <run>/metrics.jsonl; None when there is nothing to plot."""
    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    train = [(r["step"], r["loss"]) for r in records if r.get("loss") is not None]
    val = [(r["step"], r[VAL_LOSS]) for r in records if r.get(VAL_LOSS) is not None]
    logits = [(r["step"], r[MAX_ATTENTION_LOGIT]) for r in records if r.get(MAX_ATTENTION_LOGIT)]
    if not (train or val or logits):
        return None

    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_logit) = plt.subplots(1, 2, figsize=(12, 4.5), constrained_layout=True)
    if train:
        # a line alone draws nothing for one point (a run shorter than two log steps): then a marker
        marker = {"marker": "o", "markersize": 4} if len(train) == 1 else {}
        ax_loss.plot(*zip(*train), label="train", color="tab:blue", linewidth=1.2, **marker)
    if val:
        ax_loss.plot(*zip(*val), label="validation", color="tab:orange", marker="o", markersize=3)
    ax_loss.set(title="Loss", xlabel="step", ylabel="cross-entropy (nats/token)")
    ax_loss.grid(alpha=0.3)
    ax_loss.legend()

    _plot_logits(ax_logit, logits)
    if title:
        fig.suptitle(title)
    image = io.BytesIO()
    fig.savefig(image, dpi=110, format="png")
    plt.close(fig)
    return image.getvalue()


def _plot_logits(ax: Any, logits: list[tuple[int, list[float | None]]]) -> None:
    ax.set(title="Max attention logit per layer", xlabel="step", ylabel="max q·k/√d_head")
    ax.grid(alpha=0.3)
    if not logits:
        ax.text(0.5, 0.5, "no evaluation yet", ha="center", va="center", transform=ax.transAxes)
        return
    n_layers = max(len(v) for _, v in logits)
    cmap = __import__("matplotlib").colormaps["viridis"]
    for layer in range(n_layers):
        points = [(s, v[layer]) for s, v in logits if layer < len(v) and v[layer] is not None]
        if points:
            color = cmap(layer / max(1, n_layers - 1))
            ax.plot(*zip(*points), label=f"layer {layer}", color=color, marker=".", linewidth=1.2)
    ax.legend(fontsize="small", ncol=1 + n_layers // 13, loc="best")
