"""`merit inspect`: max-norms of W_Q / W_K, max attention logits and Hessian estimates of checkpoints.

The library (`merit_core.diagnostics.inspect_report`) returns a typed `InspectReport`; this module renders it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

import click

from merit_cli.options import (
    all_steps_option,
    device_option,
    no_verify_option,
    selection_of,
    steps_option,
    wide_option,
)
from merit_cli.render import print_table, print_whole, shown, wide_console
from merit_core.checkpoint.hub_revisions import REVISIONS_HELP, hub_request, parse_hub_model
from merit_core.diagnostics.plots import plot_report, short_labels
from merit_core.errors import CheckpointError, ConfigError
from merit_core.file_reading import read_text_file
from merit_core.metric_names import MAX_ATTENTION_LOGIT
from merit_core.output_checks import check_writable

if TYPE_CHECKING:  # rich is imported where a table is drawn
    from rich.console import JustifyMethod

PLOT_SUFFIXES = (".png", ".pdf", ".svg")
MAX_SIDE_BY_SIDE = 8


def _fmt(x, digits: int = 4) -> str:
    if x is None:
        return "-"
    if isinstance(x, int):
        return str(x)
    return f"{x:.{digits}g}"


def _highlighted(values: list, digits: int = 4) -> list[str]:
    """Cells for a column: the largest value bold red, the runner-up yellow."""
    present = sorted({v for v in values if v is not None}, reverse=True)
    top = present[0] if present else None
    second = present[1] if len(present) > 1 else None
    cells = []
    for v in values:
        text = _fmt(v, digits)
        if v is not None and v == top and len(values) > 1:
            text = f"[bold red]{text}[/]"
        elif v is not None and v == second and len(values) > 2:
            text = f"[yellow]{text}[/]"
        cells.append(text)
    return cells


def _outlier_text(dist, axis: str) -> str:
    out = dist.outliers[0] if dist.outliers else None
    if out is None:
        return "-"
    head = f" h{out.head}" if out.head is not None else ""
    ratio = f", {out.x_median:.1f}x median" if out.x_median else ""
    return f"{axis} {out.index}{head}: {_fmt(out.max_norm, 3)}{ratio}"


def _layer_tables(ckpt):
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
    cols = [_highlighted([getattr(l, k) for l in layers]) for _, k in columns]
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
    logit_cells = _highlighted([l.max_attention_logit for l in layers])
    entropy_cells = _lowest([l.normalized_attention_entropy_min for l in layers])
    ratio_cells = _highlighted([l.activation_ratio for l in layers])
    for i, layer in enumerate(layers):
        heads = [h for h in layer.heads if h.max_attention_logit is not None]
        top = max(heads, key=lambda h: h.max_attention_logit) if heads else None
        row = [
            str(layer.layer),
            logit_cells[i],
            _fmt(layer.logit_bound),
            _fmt(layer.spectral_logit_bound),
            f"h{top.head} ({_fmt(top.max_attention_logit)})" if top else "-",
            _outlier_text(getattr(layer, f"q_{out_key}"), axis),
            _outlier_text(getattr(layer, f"k_{out_key}"), axis),
        ]
        if measured:
            where = f"pos {layer.activation_max_position}, dim {layer.activation_max_dim}"
            row += [entropy_cells[i], _fmt(layer.attention_entropy_mean), ratio_cells[i], where]
        probe.add_row(*row)
    return norms, probe


def _lowest(values: list, digits: int = 4) -> list[str]:
    """Cells for a column where small is alarming (entropy): the smallest bold red."""
    present = [v for v in values if v is not None and v == v]
    low = min(present) if present else None
    return [
        f"[bold red]{_fmt(v, digits)}[/]" if v is not None and v == low and len(values) > 1 else _fmt(v, digits)
        for v in values
    ]


def _entropy_head_table(ckpt):
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
        lows = _lowest([h.normalized_attention_entropy_min for h in layer.heads], 3)
        cells = [f"{c} ({_fmt(h.normalized_attention_entropy_mean, 3)})" for c, h in zip(lows, layer.heads)]
        table.add_row(str(layer.layer), *cells)
    return table


def _updates_table(ckpt):
    """RMS(next update) / RMS(weight) per 2-D weight, and MERIT's ratio s where the optimizer is MERIT."""
    from rich.table import Table

    up = ckpt.updates
    merit = any(w.merit is not None for w in up.weights)
    table = Table(
        title=f"{ckpt.label}: next update / weight ({up.optimizer}, step {up.step}, lr {_fmt(up.lr, 3)}; zero-gradient step)",
        title_justify="left",
        header_style="bold",
    )
    cols = ["weight", "RMS(Δw)/RMS(w)"]
    if merit:
        cols += ["s p50", "s p99", "s max", "row wins", "col wins", "weight wins", "clipped"]
    for name in cols:
        table.add_column(name, justify="left" if name == "weight" else "right")
    ratios = _highlighted([w.ratio for w in up.weights], 3)
    for w, r in zip(up.weights, ratios):
        row = [shown(w.name), r]
        if merit and w.merit is not None:
            m = w.merit
            pct = lambda x: f"{100 * x:.0f}%"  # noqa: E731
            row += [_fmt(m.percentiles[50], 3), _fmt(m.percentiles[99], 3), _fmt(m.percentiles[100], 3)]
            row += [pct(m.share_row), pct(m.share_col), pct(m.share_weight), pct(m.clipped)]
        table.add_row(*row)
    return table


def _head_table(ckpt):
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
        table.add_row(str(layer.layer), *_highlighted([getattr(h, key) for h in layer.heads], 3))
    return table


def _weights_table(ckpt):
    from rich.table import Table

    table = Table(title=f"{ckpt.label}: every 2-D weight", title_justify="left", header_style="bold")
    for name, justify in (("name", "left"), ("shape", "right"), ("max-norm", "right"), ("l2 norm", "right")):
        table.add_column(name, justify=justify)
    ws = ckpt.weights
    maxes = _highlighted([w.max_norm for w in ws])
    for w, m in zip(ws, maxes):
        table.add_row(shown(w.name), "x".join(map(str, w.shape)), m, _fmt(w.l2_norm))
    return table


def _pick(checkpoints: list, n: int) -> list:
    if len(checkpoints) <= n:
        return checkpoints
    idx = sorted({round(i * (len(checkpoints) - 1) / (n - 1)) for i in range(n)})
    return [checkpoints[i] for i in idx]


def _side_by_side(checkpoints: list):
    from rich.table import Table

    shown = _pick(checkpoints, MAX_SIDE_BY_SIDE)
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
        _highlighted([getattr(c.layers[i], key) if i < len(c.layers) else None for i in range(n_layers)]) for c in shown
    ]
    for i in range(n_layers):
        table.add_row(str(i), *(col[i] for col in cols))
    return table


def _summary_table(checkpoints: list):
    from rich.table import Table

    table = Table(title="per checkpoint (max over layers; entropy: min)", title_justify="left", header_style="bold")
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
    for name, justify in cols:
        table.add_column(name, justify=justify)
    s = [c.summary for c in checkpoints]
    qm, km = _highlighted([x.q_max_norm for x in s]), _highlighted([x.k_max_norm for x in s])
    bd, lg = _highlighted([x.bound for x in s]), _highlighted([x.max_attention_logit for x in s])
    labels = short_labels([c.label for c in checkpoints])
    ent = _lowest([x.normalized_attention_entropy_min for x in s])
    act, logz = _highlighted([x.activation_ratio for x in s]), _highlighted([x.log_z_mean for x in s])
    upd = _highlighted([x.update_rms_ratio for x in s])
    for i, c in enumerate(checkpoints):
        row = [
            labels[i],
            _fmt(c.step),
            str(c.optimizer or "-"),
            qm[i],
            km[i],
            f"{bd[i]} ({s[i].bound_layer})",
            f"{lg[i]} ({s[i].max_attention_logit_layer})" if s[i].max_attention_logit is not None else "-",
            _fmt(max((l.logit_bound for l in c.layers if l.logit_bound is not None), default=None)),
            _fmt(max((l.spectral_logit_bound for l in c.layers if l.spectral_logit_bound is not None), default=None)),
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
            row.append(_fmt(h.get("largest_algebraic_eigenvalue")) + conv if h else "-")
            row.append(_fmt(h.get("smallest_algebraic_eigenvalue")) if h else "-")
            row.append(_fmt(h.get("largest_magnitude_eigenvalue")) if h else "-")
            se = f" ± {_fmt(h['trace_stderr'], 2)}" if h.get("trace_stderr") is not None else ""
            row.append(_fmt(h.get("trace")) + se if h else "-")
        if with_verdict:
            row.append(_verdict_cell(c.verdict))
        table.add_row(*row)
    return table


LEVEL_STYLE = {"healthy": "green", "watch": "yellow", "alarming": "bold red"}


def _level_text(level: str | None) -> str:
    return f"[{LEVEL_STYLE[level]}]{level}[/]" if level in LEVEL_STYLE else "-"


def _verdict_cell(verdict) -> str:
    """The worst level, and the signals at it unless healthy: 'alarming (max_logit, log_z_drift)'."""
    if verdict is None or verdict.level is None:
        return "-"
    if verdict.level == "healthy":
        return _level_text(verdict.level)
    names = ", ".join(s.signal for s in verdict.signals if s.level == verdict.level)
    return f"{_level_text(verdict.level)} ({names})"


def _verdict_table(title: str, verdict, with_step: bool):
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
        row = [sig.signal, _level_text(sig.level), _fmt(sig.value, 3)]
        if with_step:
            row.append(_fmt(sig.step))
        table.add_row(*row, sig.rule, shown(sig.reason))
    return table


def _print_verdicts(console, report, checkpoints: list) -> None:
    """A run folder's verdict over its checkpoints; each checkpoint's own where a few were named
    one by one (or a run has one): the summary table has every checkpoint's level."""
    runs, singles = [], []
    start = 0
    for given in report.inputs:  # the checkpoints of each input follow one another, in input order
        taken = checkpoints[start : start + given.n_checkpoints]
        start += given.n_checkpoints
        if given.kind == "run" and len(taken) > 1 and given.verdict is not None:
            runs.append((given, taken))
        else:
            singles += taken
    for given, taken in runs:
        verdict = given.verdict
        steps = [x for x in verdict.steps if x is not None]
        span = f", steps {min(steps)}-{max(steps)}" if steps else ""
        title = f"{shown(given.path)}: {_level_text(verdict.level)} over its {len(taken)} checkpoints{span} (worst per signal)"
        print_table(console, _verdict_table(title, verdict, with_step=True))
        for note in verdict.notes:
            console.print(f"[dim]{shown(note)}[/]")
    if len(singles) > 3:
        return
    for c in singles:
        if c.verdict is None or not c.verdict.signals:
            continue
        title = f"{c.label}: {_level_text(c.verdict.level)}" + (f" at step {c.step}" if c.step is not None else "")
        print_table(console, _verdict_table(title, c.verdict, with_step=False))
        for note in c.verdict.notes:
            console.print(f"[dim]{shown(note)}[/]")


def render(console, report, per_head: bool, show_weights: bool | None) -> None:
    """Print an `InspectReport` as rich tables."""
    checkpoints = report.checkpoints
    checkpoints = [
        dataclasses.replace(c, label=shown(label))  # a label is a path: printable, no markup
        for c, label in zip(checkpoints, short_labels([c.label for c in checkpoints]))
    ]
    # per-layer detail for a few checkpoints named directly; runs get the side-by-side and summary tables
    detailed = [c for c in checkpoints if c.run is None or len(checkpoints) == 1]
    if len(detailed) <= 3:
        for c in detailed:
            for table in _layer_tables(c):
                print_table(console, table)
            if per_head and c.layers[0].heads:
                print_table(console, _head_table(c))
                if any(h.normalized_attention_entropy_min is not None for l in c.layers for h in l.heads):
                    print_table(console, _entropy_head_table(c))
            if c.updates is not None and c.updates.weights:
                print_table(console, _updates_table(c))
            if show_weights if show_weights is not None else len(checkpoints) == 1:
                print_table(console, _weights_table(c))
    if len(checkpoints) > 1:
        print_table(console, _side_by_side(checkpoints))
    print_table(console, _summary_table(checkpoints))
    _print_verdicts(console, report, checkpoints)
    _print_notes(console, checkpoints)


def _print_notes(console, checkpoints: list) -> None:
    """The probe and the notes; what is the same for every checkpoint is said once (the JSON keeps each)."""
    from merit_core.diagnostics.inspect_report import TRAINING_LOGIT

    probes = {(c.probe.source, c.probe.n_tokens) for c in checkpoints if c.probe}
    if len(probes) == 1 and len(checkpoints) > 1 and all(c.probe for c in checkpoints):
        (source, n_tokens), *_ = probes
        console.print(f"[dim]probe {shown(source)}, {n_tokens} tokens (every checkpoint)[/]")
        probes = set()
    logit_notes = []
    for c in checkpoints:
        if c.probe and probes:
            console.print(f"[dim]{c.label}: probe {shown(c.probe.source)}, {c.probe.n_tokens} tokens[/]")
        for note in c.notes + (c.probe.notes if c.probe else []):
            if getattr(note, "kind", None) == TRAINING_LOGIT:
                logit_notes.append((c.label, note))
            else:
                console.print(f"[yellow]note[/] {c.label}: {shown(note)}")
    if logit_notes:  # one per checkpoint of a run, all saying the same: the latest one, once
        label, note = logit_notes[-1]
        more = len(logit_notes) - 1
        also = f" (likewise at {more} other checkpoint{'s' if more != 1 else ''}; --json has each)" if more else ""
        console.print(f"[yellow]note[/] {label}: {shown(note)}{also}")


def _say_taken(console, report, selection) -> None:
    """For each run folder given, which of its checkpoints were taken, in one line."""
    from rich.markup import escape

    from merit_core.checkpoint import took

    start = 0
    for given in report.inputs:  # the checkpoints of each input follow one another, in input order
        taken = report.checkpoints[start : start + given.n_checkpoints]
        start += given.n_checkpoints
        if given.kind == "run":
            picked = [(c.step, Path(c.path)) for c in taken]
            console.print(f"[dim]{escape(took(given.path, picked, selection))}[/]", soft_wrap=True)


@click.command("inspect", context_settings={"show_default": True})
@click.argument("paths", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--text", help="Probe text for the max attention logit (default: a built-in paragraph).")
@click.option("--text-file", type=click.Path(path_type=Path), help="Read the probe text from a file.")
@click.option(
    "--seq-len",
    type=click.IntRange(min=2),
    help="Most tokens probed [default: the whole --text up to the context; the built-in paragraph fills 256].",
)
@click.option("--heads", "n_heads", type=click.IntRange(min=1), help="Head count, for weights without config.json.")
@click.option(
    "--top-k",
    default=3,
    type=click.IntRange(min=1),
    help="Outlier rows / columns named per matrix (in --json).",
)
@click.option(
    "--logits/--no-logits",
    default=True,
    help="Build the model and measure max attention logits (needs config.json).",
)
@click.option(
    "--updates/--no-updates",
    default=True,
    help="Update size per weight from a `merit train` checkpoint's optimizer state (zero-gradient step).",
)
@click.option(
    "--hessian",
    is_flag=True,
    help="Also estimate Hessian eigenvalues and trace on the probe batch: the largest algebraic eigenvalue "
    "(largest_algebraic_eigenvalue, the most positive curvature), the smallest algebraic "
    "(smallest_algebraic_eigenvalue) and the one of largest magnitude, sign kept "
    "(largest_magnitude_eigenvalue: what power iteration, e.g. PyHessian, reports as 'top').",
)
@click.option(
    "--hessian-iters",
    default=20,
    type=click.IntRange(min=1, max=1000),  # Lanczos keeps one parameter-sized vector per step
    help="Lanczos steps (Hessian-vector products) for the eigenvalues; at least 10 for the largest algebraic "
    "one to count as converged.",
)
@click.option(
    "--hutchinson-samples",
    default=10,
    type=click.IntRange(min=1),
    help="Rademacher samples for the Hutchinson trace.",
)
@click.option("--seed", default=0, type=int, help="Seed for the Hessian estimates and random probes.")
@device_option()
@steps_option(default="all")
@all_steps_option()
@no_verify_option()
@click.option("--per-head", is_flag=True, help="Also print a layer x head table.")
@click.option(
    "--weights/--no-weights",
    "show_weights",
    default=None,
    help="Print the table of every 2-D weight [default: for a single checkpoint].",
)
@click.option("--json", "json_path", type=click.Path(path_type=Path, dir_okay=False), help="Write the report as JSON.")
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(path_type=Path, dir_okay=False),
    help="Figure: per-layer bars, or the trajectory over steps for a run folder (.png/.pdf/.svg).",
)
@click.option("--revisions", help="Hub models ORG/NAME: " + REVISIONS_HELP)
@click.option("--drop-weights", is_flag=True, help="Delete each hub revision's weights from the cache once read.")
@click.option("--trust-remote-code", is_flag=True, help="Read hub models whose config asks to run their own code.")
@wide_option()
def inspect_cmd(
    paths,
    text,
    text_file,
    seq_len,
    n_heads,
    top_k,
    logits,
    updates,
    hessian,
    hessian_iters,
    hutchinson_samples,
    seed,
    device,
    selection,
    all_steps,
    no_verify,
    per_head,
    show_weights,
    json_path,
    plot_path,
    revisions,
    drop_weights,
    trust_remote_code,
    wide,
):
    """Max-norms of W_Q / W_K, max attention logits, attention entropy, massive activations, output
    log Z, update size and Hessian estimates of checkpoints (docs/DIAGNOSTICS.md).

    Each PATH is a .safetensors file, a sharded model.safetensors.index.json, a Hugging Face
    checkpoint folder, a `merit train` run folder (its step_* checkpoints: --steps all, latest or N,M),
    or a hub model ORG/NAME or ORG/NAME@REV (its revisions: --revisions).

    \b
    Examples:
      merit inspect runs/first                      # every checkpoint of a run
      merit inspect runs/first --steps latest       # its latest checkpoint only
      merit inspect runs/a/step_200 runs/b/step_200 --json stats.json --plot layers.png
      merit inspect model.safetensors --no-logits --heads 12
      merit inspect runs/first/step_5 --hessian
      merit inspect EleutherAI/pythia-160m --revisions all/16 --plot pythia.png
    """
    for path in paths:  # before torch and transformers load (seconds): a typo is answered at once
        if not path.expanduser().exists() and parse_hub_model(str(path)) is None:
            from merit_core.checkpoint import missing_step_hint

            raise CheckpointError(f"checkpoint not found: {path}{missing_step_hint(path.expanduser())}")
    selection = selection_of(selection, all_steps)
    from rich.console import Console

    from merit_cli.render import ProgressView

    if text is not None and text_file is not None:
        raise ConfigError("give --text or --text-file, not both")
    if plot_path is not None and plot_path.suffix.lower() not in PLOT_SUFFIXES:
        raise ConfigError(f"--plot {plot_path}: use a {', '.join(PLOT_SUFFIXES)} file name")

    for option, path in (("--json", json_path), ("--plot", plot_path)):
        if path is not None:
            check_writable(path, option)  # before the work, so a report is never lost at the end
    source = "builtin"
    if text_file is not None:
        text, source = read_text_file(text_file, "probe text"), "file"
    elif text is not None:
        if not text.strip():
            raise ConfigError("--text is empty")
        source = "text"
    if logits or hessian:
        from merit_core.hub import prefer_offline

        prefer_offline()
    if device != "cpu":
        from merit_core.devices import resolve_device  # auto -> cuda or cpu; cuda:N checked

        device = str(resolve_device(device))
    from merit_core.diagnostics.inspect_report import InspectOptions, inspect_paths, write_json

    opts = InspectOptions(
        n_heads=n_heads,
        top_k=top_k,
        logits=logits,
        text=text,
        text_source=source,
        seq_len=seq_len,
        hessian=hessian,
        hessian_iters=hessian_iters,
        hutchinson_samples=hutchinson_samples,
        seed=seed,
        device=device,
        updates=updates,
        selection=selection,
        verify=not no_verify,
        hub=hub_request(revisions, drop_weights, trust_remote_code),
    )
    console = Console()
    if not console.is_terminal:  # piped / redirected: no terminal width to respect
        console = Console(width=160)
    with ProgressView(console, one_line=True, first="inspecting") as view:
        report = inspect_paths([str(p) for p in paths], opts, progress=view)
    if wide:
        console = wide_console(console)
    _say_taken(console, report, selection)
    render(console, report, per_head, show_weights)
    if json_path is not None:
        replaced = write_json(report, json_path)
        print_whole(console, f"wrote {shown(json_path)}")
        if replaced:
            console.print(f"[yellow]note[/] {replaced} values are not finite (NaN or infinite): null in the JSON")
    if plot_path is not None:
        kind = plot_report(report, plot_path)
        what = "trajectory over steps" if kind == "trajectory" else "per-layer bars"
        print_whole(console, f"wrote {shown(plot_path)} ({what})")
