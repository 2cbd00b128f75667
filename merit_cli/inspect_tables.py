"""The tables `merit inspect` prints: per layer, per head, per weight, side by side and per checkpoint,
and a verdict's signals. `merit_cli.inspect_cmd` chooses which to print."""

from __future__ import annotations

from typing import TYPE_CHECKING

from merit_cli.render import cell_width, shown
from merit_core.diagnostics.plots import short_labels
from merit_core.metric_names import MAX_ATTENTION_LOGIT

if TYPE_CHECKING:  # rich is imported where a table is drawn
    from rich.console import JustifyMethod

MAX_SIDE_BY_SIDE = 8
BOUNDS_CAPTION = (
    "logit bound, spectral bound: upper bounds on any attention logit for inputs as large as the probe's, "
    "from the max-norms and from the spectral norms of W_Q, W_K (docs/DIAGNOSTICS.md)"
)


def fmt(x, digits: int = 4) -> str:
    if x is None:
        return "-"
    if isinstance(x, int):
        return str(x)
    return f"{x:.{digits}g}"


def highlighted(values: list, digits: int = 4) -> list[str]:
    """Cells for a column: the largest value bold red, the runner-up yellow."""
    present = sorted({v for v in values if v is not None}, reverse=True)
    top = present[0] if present else None
    second = present[1] if len(present) > 1 else None
    cells = []
    for v in values:
        text = fmt(v, digits)
        if v is not None and v == top and len(values) > 1:
            text = f"[bold red]{text}[/]"
        elif v is not None and v == second and len(values) > 2:
            text = f"[yellow]{text}[/]"
        cells.append(text)
    return cells


def outlier_text(dist, axis: str) -> str:
    out = dist.outliers[0] if dist.outliers else None
    if out is None:
        return "-"
    head = f" h{out.head}" if out.head is not None else ""
    ratio = f", {out.x_median:.1f}x median" if out.x_median else ""
    return f"{axis} {out.index}{head}: {fmt(out.max_norm, 3)}{ratio}"


def layer_tables(ckpt):
    """Two tables, one row per layer: the norms, then the measured logits and outlier features."""
    from rich.table import Table

    title = f"{ckpt.label}  ({ckpt.architecture}, {ckpt.n_layers} layers, {ckpt.n_heads or '?'} heads"
    title += f", step {ckpt.step})" if ckpt.step is not None else ")"
    layers = ckpt.layers
    norms = Table(title=title + ": W_Q / W_K norms", title_justify="left", header_style="bold")
    columns = [
        ("‖Q‖m", "q_max_norm"),
        ("‖K‖m", "k_max_norm"),
        ("‖Q‖m·‖K‖m", "bound"),
        ("‖Q‖F", "q_l2_norm"),
        ("‖K‖F", "k_l2_norm"),
        ("‖Q‖m/‖Q‖F", "q_max_over_l2"),
        ("‖K‖m/‖K‖F", "k_max_over_l2"),
    ]
    norms.add_column("layer", justify="right")
    for name, _ in columns:
        norms.add_column(name, justify="right")
    cols = [highlighted([getattr(l, k) for l in layers]) for _, k in columns]
    for i, layer in enumerate(layers):
        norms.add_row(str(layer.layer), *(c[i] for c in cols))

    # out-features are split into heads: stored rows for Linear weights, columns for GPT-2 Conv1D
    axis, out_key = ("row", "rows") if ckpt.row_axis == "output" else ("col", "cols")
    probe = Table(
        title=f"{ckpt.label}: max attention logit and largest output features",
        title_justify="left",
        header_style="bold",
    )
    right = ("layer", "max logit", "logit bound", "spectral bound", "min H/log n", "mean H (nats)", "act max/median")
    names = ("layer", "max logit", "logit bound", "spectral bound", "top head", f"top W_Q {axis}", f"top W_K {axis}")
    measured = any(l.activation_ratio is not None for l in layers)
    if measured:
        names += ("min H/log n", "mean H (nats)", "act max/median", "act max at")
    for name in names:
        probe.add_column(name, justify="right" if name in right else "left")
    logit_cells = highlighted([l.max_attention_logit for l in layers])
    entropy_cells = lowest([l.normalized_attention_entropy_min for l in layers])
    ratio_cells = highlighted([l.activation_ratio for l in layers])
    for i, layer in enumerate(layers):
        heads = [h for h in layer.heads if h.max_attention_logit is not None]
        top = max(heads, key=lambda h: h.max_attention_logit) if heads else None
        row = [
            str(layer.layer),
            logit_cells[i],
            fmt(layer.logit_bound),
            fmt(layer.spectral_logit_bound),
            f"h{top.head} ({fmt(top.max_attention_logit)})" if top else "-",
            outlier_text(getattr(layer, f"q_{out_key}"), axis),
            outlier_text(getattr(layer, f"k_{out_key}"), axis),
        ]
        if measured:
            where = f"pos {layer.activation_max_position}, dim {layer.activation_max_dim}"
            row += [entropy_cells[i], fmt(layer.attention_entropy_mean), ratio_cells[i], where]
        probe.add_row(*row)
    return norms, probe


def lowest(values: list, digits: int = 4) -> list[str]:
    """Cells for a column where small is alarming (entropy): the smallest bold red."""
    present = [v for v in values if v is not None and v == v]
    low = min(present) if present else None
    return [
        f"[bold red]{fmt(v, digits)}[/]" if v is not None and v == low and len(values) > 1 else fmt(v, digits)
        for v in values
    ]


def entropy_head_table(ckpt):
    """Normalised attention entropy (min over positions) per layer and head: 1 uniform, 0 one-hot."""
    from rich.table import Table

    table = Table(
        title=f"{ckpt.label}: attention entropy / log n per head, min over positions (mean)",
        title_justify="left",
        header_style="bold",
    )
    table.add_column("layer", justify="right")
    for h in range(max(len(l.heads) for l in ckpt.layers)):
        table.add_column(f"h{h}", justify="right")
    for layer in ckpt.layers:
        lows = lowest([h.normalized_attention_entropy_min for h in layer.heads], 3)
        cells = [f"{c} ({fmt(h.normalized_attention_entropy_mean, 3)})" for c, h in zip(lows, layer.heads)]
        table.add_row(str(layer.layer), *cells)
    return table


def updates_table(ckpt):
    """RMS(next update) / RMS(weight) per 2-D weight, and MERIT's ratio s where the optimizer is MERIT."""
    from rich.table import Table

    up = ckpt.updates
    merit = any(w.merit is not None for w in up.weights)
    table = Table(
        title=f"{ckpt.label}: next update / weight ({up.optimizer}, step {up.step}, lr {fmt(up.lr, 3)}; zero-gradient step)",
        title_justify="left",
        header_style="bold",
    )
    cols = ["weight", "RMS(Δw)/RMS(w)"]
    if merit:
        cols += ["s p50", "s p99", "s max", "row wins", "col wins", "weight wins", "clipped"]
    for name in cols:
        table.add_column(name, justify="left" if name == "weight" else "right")
    ratios = highlighted([w.ratio for w in up.weights], 3)
    for w, r in zip(up.weights, ratios):
        row = [shown(w.name), r]
        if merit and w.merit is not None:
            m = w.merit
            pct = lambda x: f"{100 * x:.0f}%"  # noqa: E731
            row += [fmt(m.percentiles[50], 3), fmt(m.percentiles[99], 3), fmt(m.percentiles[100], 3)]
            row += [pct(m.share_row), pct(m.share_col), pct(m.share_weight), pct(m.clipped)]
        table.add_row(*row)
    return table


def head_table(ckpt):
    from rich.table import Table

    key = MAX_ATTENTION_LOGIT if any(l.max_attention_logit is not None for l in ckpt.layers) else "bound"
    table = Table(
        title=f"{ckpt.label}: {'max attention logit' if key != 'bound' else '‖Q_h‖m·‖K_h‖m'} per head",
        title_justify="left",
        header_style="bold",
    )
    table.add_column("layer", justify="right")
    n = max(len(l.heads) for l in ckpt.layers)
    for h in range(n):
        table.add_column(f"h{h}", justify="right")
    for layer in ckpt.layers:
        table.add_row(str(layer.layer), *highlighted([getattr(h, key) for h in layer.heads], 3))
    return table


def weights_table(ckpt):
    from rich.table import Table

    table = Table(title=f"{ckpt.label}: every 2-D weight", title_justify="left", header_style="bold")
    for name, justify in (("name", "left"), ("shape", "right"), ("max-norm", "right"), ("l2 norm", "right")):
        table.add_column(name, justify=justify)
    ws = ckpt.weights
    maxes = highlighted([w.max_norm for w in ws])
    for w, m in zip(ws, maxes):
        table.add_row(shown(w.name), "x".join(map(str, w.shape)), m, fmt(w.l2_norm))
    return table


def pick(checkpoints: list, n: int) -> list:
    if len(checkpoints) <= n:
        return checkpoints
    idx = sorted({round(i * (len(checkpoints) - 1) / (n - 1)) for i in range(n)})
    return [checkpoints[i] for i in idx]


def side_by_side(checkpoints: list):
    from rich.table import Table

    shown = pick(checkpoints, MAX_SIDE_BY_SIDE)
    key = (
        MAX_ATTENTION_LOGIT if all(any(l.max_attention_logit is not None for l in c.layers) for c in shown) else "bound"
    )
    what = "max attention logit" if key != "bound" else "‖Q‖m·‖K‖m"
    note = f" ({len(shown)} of {len(checkpoints)} checkpoints)" if len(shown) < len(checkpoints) else ""
    table = Table(title=f"{what} per layer, side by side{note}", title_justify="left", header_style="bold")
    table.add_column("layer", justify="right")
    for label in short_labels([c.label for c in shown]):
        table.add_column(label, justify="right")
    n_layers = max(c.n_layers for c in shown)
    cols = [
        highlighted([getattr(c.layers[i], key) if i < len(c.layers) else None for i in range(n_layers)]) for c in shown
    ]
    for i in range(n_layers):
        table.add_row(str(i), *(col[i] for col in cols))
    return table


SHORT_WIDTH = 100  # the short summary's width, its names folded where long
SHORT_NAME_WIDTH = 10  # the least a name column keeps
# The short summary's columns, renamed where the title says it ("(n)": the layer of the maximum).
SHORT_COLUMNS = {
    "checkpoint": "checkpoint",
    "step": "step",
    "max ‖Q‖m·‖K‖m (layer)": "‖Q‖m·‖K‖m",
    "max logit (layer)": "max logit",
    "logit bound": "logit bound",
    "spectral bound": "spectral bound",
    "verdict": "verdict",
}


def summary_table(checkpoints: list, full: bool = True):
    """One row per checkpoint, maxima over layers. Short (`full` False): the columns of SHORT_COLUMNS and
    the Hessian's when measured, the verdict's level alone: it fits 100 columns; full: every measure."""
    from rich.table import Table

    table = Table(
        title="per checkpoint (max over layers; entropy: min)"
        if full
        else "per checkpoint (max over layers, (n): layer n)",
        title_justify="left",
        header_style="bold",
        caption=BOUNDS_CAPTION,
        caption_justify="left",
    )
    cols: list[tuple[str, JustifyMethod]] = [
        ("checkpoint", "left"),
        ("step", "right"),
        ("optimizer", "left"),
        ("‖Q‖m", "right"),
        ("‖K‖m", "right"),
        ("max ‖Q‖m·‖K‖m (layer)", "right"),
        ("max logit (layer)", "right"),
        ("logit bound", "right"),
        ("spectral bound", "right"),
    ]
    with_probe = any(c.summary.activation_ratio is not None for c in checkpoints)
    if with_probe:
        cols += [("min H/log n (layer)", "right"), ("max act ratio (layer)", "right"), ("mean log Z", "right")]
    with_updates = any(c.summary.update_rms_ratio is not None for c in checkpoints)
    if with_updates:
        cols += [("max Δw/w", "right")]
    with_h = any(c.hessian for c in checkpoints)
    with_verdict = any(c.verdict is not None and c.verdict.level for c in checkpoints)
    if with_h:
        cols += [
            ("largest alg. Hessian eig", "right"),
            ("smallest alg. eig", "right"),
            ("largest |eig|", "right"),
            ("Hessian trace ± se", "right"),
        ]
    if with_verdict:
        cols += [("verdict", "left")]
    hessian = lambda name: "eig" in name or name.startswith("Hessian")  # noqa: E731
    keep = [i for i, (name, _) in enumerate(cols) if full or name in SHORT_COLUMNS or with_h and hessian(name)]
    for i in keep:  # short: a long checkpoint name folds, so that the table fits 100 columns
        name, justify = cols[i]
        header = name if full else SHORT_COLUMNS.get(name, name)
        table.add_column(header, justify=justify)
    s = [c.summary for c in checkpoints]
    qm, km = highlighted([x.q_max_norm for x in s]), highlighted([x.k_max_norm for x in s])
    bd, lg = highlighted([x.bound for x in s]), highlighted([x.max_attention_logit for x in s])
    labels = short_labels([c.label for c in checkpoints])
    ent = lowest([x.normalized_attention_entropy_min for x in s])
    act, logz = highlighted([x.activation_ratio for x in s]), highlighted([x.log_z_mean for x in s])
    upd = highlighted([x.update_rms_ratio for x in s])
    for i, c in enumerate(checkpoints):
        row = [
            labels[i],
            fmt(c.step),
            str(c.optimizer or "-"),
            qm[i],
            km[i],
            f"{bd[i]} ({s[i].bound_layer})",
            f"{lg[i]} ({s[i].max_attention_logit_layer})" if s[i].max_attention_logit is not None else "-",
            fmt(max((l.logit_bound for l in c.layers if l.logit_bound is not None), default=None)),
            fmt(max((l.spectral_logit_bound for l in c.layers if l.spectral_logit_bound is not None), default=None)),
        ]
        if with_probe:
            row.append(f"{ent[i]} ({s[i].normalized_attention_entropy_min_layer})" if s[i].activation_ratio else "-")
            row.append(f"{act[i]} ({s[i].activation_ratio_layer})" if s[i].activation_ratio else "-")
            row.append(logz[i])
        if with_updates:
            row.append(upd[i])
        if with_h:
            h = c.hessian or {}
            conv = "" if h.get("eigen_converged", True) else " (not converged)"
            row.append(fmt(h.get("largest_algebraic_eigenvalue")) + conv if h else "-")
            row.append(fmt(h.get("smallest_algebraic_eigenvalue")) if h else "-")
            row.append(fmt(h.get("largest_magnitude_eigenvalue")) if h else "-")
            se = f" ± {fmt(h['trace_stderr'], 2)}" if h.get("trace_stderr") is not None else ""
            row.append(fmt(h.get("trace")) + se if h else "-")
        if with_verdict:
            row.append(verdict_cell(c.verdict) if full else level_text(c.verdict.level if c.verdict else None))
        table.add_row(*(row[i] for i in keep))
    if not full:  # the names fold into what the other columns leave of SHORT_WIDTH
        others = sum(max(map(cell_width, [c.header, *c.cells])) + 3 for c in table.columns[1:])
        table.columns[0].max_width = max(SHORT_NAME_WIDTH, SHORT_WIDTH - others - 4)
    return table


LEVEL_STYLE = {"healthy": "green", "watch": "yellow", "alarming": "bold red"}


def level_text(level: str | None) -> str:
    return f"[{LEVEL_STYLE[level]}]{level}[/]" if level in LEVEL_STYLE else "-"


def verdict_cell(verdict) -> str:
    """The worst level, and the signals at it unless healthy: 'alarming (max_logit, log_z_drift)'."""
    if verdict is None or verdict.level is None:
        return "-"
    if verdict.level == "healthy":
        return level_text(verdict.level)
    names = ", ".join(s.signal for s in verdict.signals if s.level == verdict.level)
    return f"{level_text(verdict.level)} ({names})"


def verdict_table(title: str, verdict, with_step: bool):
    """One row per signal: its level, the value judged, where, and why (docs/DIAGNOSTICS.md)."""
    from rich.table import Table

    table = Table(title=title, title_justify="left", header_style="bold")
    cols: list[tuple[str, JustifyMethod]] = [("signal", "left"), ("level", "left"), ("value", "right")]
    if with_step:
        cols.append(("step", "right"))
    cols += [("rule", "left"), ("reason", "left")]
    for name, justify in cols:
        table.add_column(name, justify=justify)
    for sig in verdict.signals:
        row = [sig.signal, level_text(sig.level), fmt(sig.value, 3)]
        if with_step:
            row.append(fmt(sig.step))
        table.add_row(*row, sig.rule, shown(sig.reason))
    return table
