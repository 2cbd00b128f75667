"""`merit inspect`: max-norms of W_Q / W_K, max attention logits and Hessian estimates of checkpoints.

The library (`merit_core.diagnostics.inspect_report`) returns a typed `InspectReport`; this module renders it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import click

from merit_cli.inspect_tables import (
    entropy_head_table,
    head_table,
    layer_tables,
    level_text,
    side_by_side,
    summary_table,
    updates_table,
    verdict_table,
    weights_table,
)
from merit_cli.options import (
    all_steps_option,
    check_checkpoint_path,
    check_output,
    device_option,
    drop_weights_option,
    given_out,
    no_verify_option,
    output_option,
    renamed,
    selection_of,
    steps_option,
    wide_option,
)
from merit_cli.render import print_table, print_whole, shown, wide_console
from merit_core.checkpoint.hub_revisions import REVISIONS_HELP, hub_request
from merit_core.diagnostics.plots import plot_report, short_labels
from merit_core.errors import ConfigError
from merit_core.file_reading import read_text_file

PLOT_SUFFIXES = (".png", ".pdf", ".svg")


def _print_verdicts(console, report, checkpoints: list, full: bool = True) -> None:
    """A run folder's verdict over its checkpoints; each checkpoint's own where a few were named
    one by one (or a run has one): the summary table has every checkpoint's level. Short (not `full`):
    a healthy verdict is one line, its signals left to --layers."""
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
        title = f"{shown(given.path)}: {level_text(verdict.level)} over its {len(taken)} checkpoints{span} (worst per signal)"
        if not full and verdict.level == "healthy":
            _say_healthy(console, title, verdict)
            continue
        print_table(console, verdict_table(title, verdict, with_step=True))
        for note in verdict.notes:
            console.print(f"[dim]{shown(note)}[/]")
    if len(singles) > 3:
        return
    for c in singles:
        if c.verdict is None or not c.verdict.signals:
            continue
        title = f"{c.label}: {level_text(c.verdict.level)}" + (f" at step {c.step}" if c.step is not None else "")
        if not full and c.verdict.level == "healthy":
            _say_healthy(console, title, c.verdict)
            continue
        print_table(console, verdict_table(title, c.verdict, with_step=False))
        for note in c.verdict.notes:
            console.print(f"[dim]{shown(note)}[/]")


def _say_healthy(console, title: str, verdict) -> None:
    """A healthy verdict in one line: how many signals were judged, and where their table is."""
    n = len(verdict.signals)
    console.print(f"{title}: {n} signal{'s' if n != 1 else ''} judged, none past its threshold (--layers: each)")


def render(console, report, per_head: bool, show_weights: bool | None, layers: bool = False) -> None:
    """Print an `InspectReport` as rich tables: by default the short summary (one row per checkpoint) and
    each verdict's level; with `layers` (or `per_head`) the per-layer tables, every summary column and
    each verdict's signals."""
    checkpoints = report.checkpoints
    checkpoints = [
        dataclasses.replace(c, label=shown(label))  # a label is a path: printable, no markup
        for c, label in zip(checkpoints, short_labels([c.label for c in checkpoints]))
    ]
    # per-layer detail for a few checkpoints named directly; runs get the side-by-side and summary tables
    detailed = [c for c in checkpoints if c.run is None or len(checkpoints) == 1]
    layers = layers or per_head
    if len(detailed) <= 3:
        for c in detailed:
            for table in layer_tables(c) if layers else ():
                print_table(console, table)
            if per_head and c.layers[0].heads:
                print_table(console, head_table(c))
                if any(h.normalized_attention_entropy_min is not None for l in c.layers for h in l.heads):
                    print_table(console, entropy_head_table(c))
            if layers and c.updates is not None and c.updates.weights:
                print_table(console, updates_table(c))
            if show_weights if show_weights is not None else layers and len(checkpoints) == 1:
                print_table(console, weights_table(c))
    if layers and len(checkpoints) > 1:
        print_table(console, side_by_side(checkpoints))
    print_table(console, summary_table(checkpoints, full=layers))
    _print_verdicts(console, report, checkpoints, full=layers)
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
                console.print(f"[yellow]note[/] {c.label}: {shown(note)}", soft_wrap=True)  # a path and a line whole
    if logit_notes:  # one per checkpoint of a run, all saying the same: the latest one, once
        label, note = logit_notes[-1]
        more = len(logit_notes) - 1
        also = f" (likewise at {more} other checkpoint{'s' if more != 1 else ''}; --json has each)" if more else ""
        console.print(f"[yellow]note[/] {label}: {shown(note)}{also}", soft_wrap=True)


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


def _old_json_target(word: str) -> bool:
    """Whether the word after --json is the file the old `--json PATH` wrote, rather than a PATH to
    inspect: no option, not a folder, and a name that is no checkpoint's (.safetensors, a shard index)."""
    path = Path(word).expanduser()
    if word.startswith("-") or path.is_dir() or word.endswith((".safetensors", ".index.json")):
        return False
    return not path.exists() or path.suffix.lower() == ".json"


class InspectCommand(click.Command):
    """`merit inspect`, which still reads the old `--json PATH` (now -o/--out PATH) with a one-line notice."""

    def parse_args(self, ctx, args):
        args = list(args)
        for i, arg in enumerate(args):
            if arg == "--":
                break
            if arg.startswith("--json="):
                renamed("--json PATH", "-o/--out PATH (--json alone prints the JSON)")
                args[i] = "--out=" + arg[len("--json=") :]
            elif arg == "--json" and i + 1 < len(args) and _old_json_target(args[i + 1]):
                renamed("--json PATH", "-o/--out PATH (--json alone prints the JSON)")
                args[i] = "--out"
        return super().parse_args(ctx, args)


@click.command("inspect", cls=InspectCommand, context_settings={"show_default": True})
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
@click.option(
    "--layers",
    is_flag=True,
    help="Also print the tables per layer (norms, logits, bounds, outliers, next update), every column of the "
    "summary and each verdict's signals; without it: one summary row per checkpoint.",
)
@click.option("--per-head", is_flag=True, help="Also print a layer x head table (implies --layers).")
@click.option(
    "--weights/--no-weights",
    "show_weights",
    default=None,
    help="Print the table of every 2-D weight [default: with --layers, for a single checkpoint].",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON instead of the tables.")
@output_option("Write the report as JSON to this file (the tables are printed too).", type=click.Path(dir_okay=False))
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(path_type=Path, dir_okay=False),
    help="Figure: per-layer bars, or the trajectory over steps for a run folder (.png/.pdf/.svg).",
)
@click.option("--revisions", help="Hub models ORG/NAME: " + REVISIONS_HELP)
@drop_weights_option()
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
    layers,
    per_head,
    show_weights,
    as_json,
    out,
    plot_path,
    revisions,
    drop_weights,
    trust_remote_code,
    wide,
):
    """Max-norms of W_Q / W_K, max attention logits, attention entropy, massive activations, output
    log Z, update size and Hessian estimates of checkpoints (docs/DIAGNOSTICS.md).

    Each PATH is a .safetensors file, a sharded model.safetensors.index.json, a Hugging Face
    checkpoint folder, a `merit train` run folder (its step_* checkpoints: --checkpoints all, latest or N,M),
    or a hub model ORG/NAME or ORG/NAME@REV (its revisions: --revisions).

    \b
    Examples:
      merit inspect runs/first                      # every checkpoint of a run, one row each
      merit inspect runs/first --checkpoints latest --layers  # its latest checkpoint, layer by layer
      merit inspect runs/a/step_200 runs/b/step_200 -o stats.json --plot layers.png
      merit inspect runs/first --json | jq .checkpoints[0].summary
      merit inspect model.safetensors --no-logits --heads 12
      merit inspect runs/first/step_5 --hessian
      merit inspect EleutherAI/pythia-160m --revisions all/16 --plot pythia.png
    """
    for path in paths:  # before torch and transformers load (seconds): a typo is answered at once
        check_checkpoint_path(path, hub_name_ok=True)  # a name that may be a hub model's is the resolver's
    selection = selection_of(selection, all_steps)
    from rich.console import Console

    from merit_cli.render import ProgressView

    if text is not None and text_file is not None:
        raise ConfigError("give --text or --text-file, not both")
    if plot_path is not None and plot_path.suffix.lower() not in PLOT_SUFFIXES:
        raise ConfigError(f"--plot {plot_path}: use a {', '.join(PLOT_SUFFIXES)} file name")

    json_path = given_out(out)
    json_path = None if json_path is None else Path(json_path)
    for option, path in (("--out", json_path), ("--plot", plot_path)):
        check_output(path, option)  # before the work, so a report is never lost at the end
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
    console = Console(stderr=as_json)  # --json: stdout holds the JSON alone
    if not console.is_terminal:  # piped / redirected: no terminal width to respect
        console = Console(width=160, stderr=as_json)
    with ProgressView(console, one_line=True, first="inspecting") as view:
        report = inspect_paths([str(p) for p in paths], opts, progress=view)
    if as_json:
        from merit_core.metrics import count_non_finite, json_safe

        data = report.to_dict()
        data = json_safe(data) if count_non_finite(data) else data  # JSON has no NaN: null, as in the file
        click.echo(json.dumps(data, indent=1, allow_nan=False))
    if wide:
        console = wide_console(console)
    if not as_json:
        _say_taken(console, report, selection)
        render(console, report, per_head, show_weights, layers)
    if json_path is not None:
        replaced = write_json(report, json_path)
        print_whole(console, f"wrote {shown(json_path)}")
        if replaced:
            console.print(f"[yellow]note[/] {replaced} values are not finite (NaN or infinite): null in the JSON")
    if plot_path is not None:
        kind = plot_report(report, plot_path)
        what = "trajectory over steps" if kind == "trajectory" else "per-layer bars"
        print_whole(console, f"wrote {shown(plot_path)} ({what})")
