"""`merit compare`: optimizers x batch sizes at one token budget, each at its best lr; rich progress and table."""

from __future__ import annotations

import math
import shlex
import time
from typing import TYPE_CHECKING, Any

import click
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from merit_cli.options import check_output, device_callback, setting_option, wide_option
from merit_cli.render import (
    EtaColumn,
    LiveReport,
    fmt_duration,
    fmt_float,
    peak_logit,
    plain_line,
    plural,
    print_whole,
    shown,
    wide_console,
)
from merit_core.metric_names import MAX_ATTENTION_LOGIT, VAL_LOSS
from merit_core.settings import COMPARE, COMPARE_TRAIN, CompareDefaults, TrainConfig

if TYPE_CHECKING:  # read at `merit compare --help`: the comparison (torch) is imported when it runs
    from merit_core.compare.estimate import CompareEstimate
    from merit_core.compare.results import CompareSummary


def _lr(value: float) -> str:
    return f"{value:.3g}"


def compare_progress(out, clock=time.monotonic) -> Progress:
    """One bar per running run and one for all runs, each with the time spent and the time left
    (merit_cli.render.EtaColumn: the rate since the bar appeared; for all runs, finished runs per second)."""
    return Progress(
        TextColumn("{task.description:<28}"),
        BarColumn(bar_width=20),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        EtaColumn(clock),
        console=out,
        transient=True,
    )


class RichCompareReport(LiveReport):
    """Renders a comparison: the plan and grids, an overall bar plus one bar per running run, a line per run.

    It is the comparison's merit_core.compare.runner.CompareCallbacks, every hook written out (on_prepare
    from LiveReport) rather than inherited, so that this module, read at `merit compare --help`, does not
    import the comparison (torch); tests/cli check that it answers every hook."""

    def __init__(self, wide: bool = False) -> None:
        super().__init__()
        self.tables = wide_console(self.out) if wide else self.out  # the console tables print on (--wide)
        self.overall: TaskID | None = None
        self.tasks: dict[str, Any] = {}
        self.started: dict[str, float] = {}
        self.last: dict[str, dict[str, Any]] = {}

    def on_plan(self, runs, states, jobs) -> None:
        if self.stages is not None:
            self.stages.stop()
        first = runs[0]
        batches = sorted({r.batch_size for r in runs})
        steps = ", ".join(f"b{b}: {plural(next(r.steps for r in runs if r.batch_size == b), 'step')}" for b in batches)
        todo = [r for r in runs if states[r.name] in ("new", "partial")]
        done = len(runs) - len(todo)
        counts = {state: sum(states[r.name] == state for r in runs) for state in ("finished", "diverged", "partial")}
        self.out.print(
            f"[bold]Comparing[/] {', '.join(dict.fromkeys(r.optimizer for r in runs))} on {shown(first.config.model)}, "
            f"seq len {first.config.seq_len}, {max(r.tokens for r in runs):,} tokens per run ({steps})"
        )
        self.tables.print(_grid_table(runs))
        parts = [f"{counts['finished']} finished"] if counts["finished"] else []
        parts += [f"{counts['diverged']} diverged"] if counts["diverged"] else []
        parts += [
            f"{len(todo)} to train"
            + (f" ({counts['partial']} resumed)" if counts["partial"] else "")
            + (f", {jobs} at a time" if todo else "")
        ]
        self.out.print(f"{len(runs)} runs: {', '.join(parts)}")
        print_whole(self.out, f"[dim]runs in {shown(first.run_dir.parent)}[/]")
        self.done = done
        self.total = len(runs)
        if self.plain:
            return
        self.progress = compare_progress(self.out)
        self.progress.start()
        self.overall = self.progress.add_task("all runs", total=len(runs), completed=done, info="")

    def on_estimate(self, estimate: CompareEstimate) -> None:
        took = fmt_duration(estimate.seconds)
        more = "; later rounds add runs" if estimate.more else ""
        if self.plain:
            self.say(plain_line("estimate", [("time", took), ("runs", estimate.runs), ("more", estimate.more or None)]))
            return
        self.out.print(
            f"[dim]estimate: about {took} for {plural(estimate.runs, 'run')}, {estimate.jobs} at a time "
            f"(from passes timed on this CPU{more})[/]"
        )

    def _display(self) -> tuple[Progress, TaskID]:
        """The progress display and its all-runs bar, which on_plan starts outside plain mode."""
        if self.progress is None or self.overall is None:
            raise RuntimeError("the comparison's progress display has not started")
        return self.progress, self.overall

    def on_extend(self, runs, states, jobs) -> None:
        self._added(runs, states, "grid edge", "the best lr sat on an edge; adding")

    def on_add(self, runs, states, jobs, why: str) -> None:
        if why == "seeds":
            self._added(runs, states, "best seeds", "topping the best cells up with seeds:")
        elif why == "missing":
            self._added(runs, states, "missing runs", "run folders removed after their run; training again:")
        else:
            self._added(
                runs,
                states,
                "environment check",
                "re-running best cells' seeds in a perturbed floating-point environment (threads, ISA, BLAS):",
            )

    def _added(self, runs, states, label: str, text: str) -> None:
        if not runs:
            return
        todo = [r for r in runs if states[r.name] in ("new", "partial")]
        cells = sorted({(r.optimizer, r.batch_size, r.lr) for r in runs})
        added = ", ".join(f"{o} b{b} lr {_lr(lr)}" for o, b, lr in cells)
        self.total += len(runs)
        self.done += len(runs) - len(todo)
        if self.plain:
            self.say(f"{label}: {text} {added} ({len(todo)} run(s) to train)")
            return
        self.out.print(f"[yellow]{label}:[/] {text} {added} ({len(todo)} run(s) to train)")
        progress, overall_id = self._display()
        overall = next(t for t in progress.tasks if t.id == overall_id)
        progress.update(overall_id, total=(overall.total or 0) + len(runs))
        progress.advance(overall_id, len(runs) - len(todo))

    def on_measure(self, what: str, run_name: str) -> None:
        label = {"hessian": "Hessian (eigenvalues, trace)", "eval": "zero-shot evaluation"}.get(what, what)
        if self.plain:
            self.say(plain_line("measure", [("what", what), ("run", run_name)]))
            return
        self.out.print(f"[dim]measuring {label} of {shown(run_name)}[/]")

    def on_run_start(self, run, resumed: bool) -> None:
        self.started[run.name] = time.perf_counter()
        if self.plain:
            self.say(plain_line("start", [("run", run.name), ("steps", run.steps), ("resumed", resumed or None)]))
            return
        label = run.name + (" (resume)" if resumed else "")
        self.tasks[run.name] = self._display()[0].add_task(label, total=run.steps, info="")

    def on_run_progress(self, run, record: dict[str, Any]) -> None:
        last = self.last.setdefault(run.name, {})
        last.update({k: v for k, v in record.items() if v is not None})
        task = self.tasks.get(run.name)
        if task is None:
            return
        info = f"loss {fmt_float(last.get('loss'))}"
        if VAL_LOSS in last:
            info += f"  val {fmt_float(last['val_loss'])}"
        self._display()[0].update(task, completed=record["step"], info=info)

    def on_run_end(self, run, state: str, message: str | None) -> None:
        took = fmt_duration(time.perf_counter() - self.started.get(run.name, time.perf_counter()))
        last = self.last.pop(run.name, {})
        if self.plain:
            self.done += 1
            top, _ = peak_logit(last)
            fields = [("run", run.name), ("state", state), ("runs_done", f"{self.done}/{self.total}")]
            if state == "finished":
                val = last.get(VAL_LOSS)
                fields += [(VAL_LOSS, f"{val:.4f}" if val is not None else None)]
                fields += [("max_logit", f"{top:.3f}" if top is not None else None), ("time", took)]
            else:
                fields += [("time", took), ("message", message)]
            self.say(plain_line("run", fields))
            return
        progress, overall_id = self._display()
        task = self.tasks.pop(run.name, None)
        if task is not None:
            progress.remove_task(task)
        progress.advance(overall_id)
        if state == "finished":
            top, _ = peak_logit(last)
            peak = fmt_float(top, 3) if top is not None else "-"
            progress.console.print(
                f"[green]done[/] {run.name:<26} val loss [bold cyan]{fmt_float(last.get('val_loss'))}[/]  "
                f"max logit [magenta]{peak}[/]  [dim]{took}[/]"
            )
        else:
            progress.console.print(f"[red]diverged[/] {shown(run.name):<22} [dim]{shown(message)}[/]")


def _command_line(ctx: click.Context) -> str:
    """The comparison as one `merit compare` command line, from the parsed options (recorded in REPORT.md)."""
    parts = ["merit", "compare"]
    spelled = lambda param: max(param.opts, key=len)  # noqa: E731  (the long name: --out, not -o)
    for param in ctx.command.params:
        value = ctx.params.get(param.name) if param.name is not None else None
        if value is None or value is False or value == ():
            continue
        if isinstance(param, click.Argument):
            parts.append(shlex.quote(str(value)))
        elif value is True:
            parts.append(spelled(param))
        else:
            for item in value if isinstance(value, tuple) else (value,):
                parts += [spelled(param), shlex.quote(str(item))]
    return " ".join(parts)


def _grid_table(runs):
    table = Table(title="Learning-rate grid", title_justify="left", box=None, padding=(0, 2), header_style="bold")
    for name in ("optimizer", "batch", "steps", "learning rates"):
        table.add_column(name, justify="right" if name in ("batch", "steps") else "left")
    seen = set()
    for run in runs:
        key = (run.optimizer, run.batch_size)
        if key not in seen:
            seen.add(key)
            table.add_row(run.optimizer, str(run.batch_size), str(run.steps), ", ".join(_lr(v) for v in run.grid))
    return table


def measures_table(summary: CompareSummary):
    """Each best run's Hessian eigenvalues and trace (--hessian) and zero-shot scores (--eval), or None."""
    entries = [b for b in summary.best if b.hessian or b.zero_shot]
    if not entries:
        return None
    table = Table(
        title="Best runs' final weights (mean ± std over seeds)",
        title_justify="left",
        header_style="bold",
        caption="paper, GPT-2 Small: top (largest-magnitude) eigenvalue AdamW 37.2, MERIT 12.3; trace 12,995 vs 3,445",
        caption_justify="left",
    )
    for name in ("optimizer", "batch", "lr"):
        table.add_column(name, justify="left" if name == "optimizer" else "right")
    with_h = any(b.hessian for b in entries)
    if with_h:
        table.add_column("largest alg. eig", justify="right")
        table.add_column("Hessian trace", justify="right")
    keys = list(dict.fromkeys((r["task"], r["metric"]) for b in entries for r in b.zero_shot or []))
    for task, metric in keys:
        table.add_column(f"{task} {metric}", justify="right")

    def ms(row, key, digits):
        value, std = row.get(key), row.get(f"{key}_std")
        if value is None:
            return "-"
        return fmt_float(value, digits) + (f" ± {fmt_float(std, digits)}" if std else "")

    for b in entries:
        cells = [b.optimizer, str(b.batch_size), _lr(b.lr)]
        h = b.hessian or {}
        if with_h:
            cells += [
                ms(h, "largest_algebraic_eigenvalue", 4),
                ms(h, "trace", 4),
            ]
        rows = {(r["task"], r["metric"]): r for r in b.zero_shot or []}
        cells += [ms(rows[k], "value", 4) if k in rows else "-" for k in keys]
        table.add_row(*cells)
    return table


def results_table(summary: CompareSummary):
    """Optimizers x batch sizes: best-lr final validation loss (± std over seeds), its lr, and the max
    attention logit.

    The lowest loss and the lowest max logit at each batch size are bold."""
    from merit_core.compare.verdicts import SMOKE, no_verdict

    settings = summary.settings
    best = summary.best_table()

    smoke = no_verdict(summary) is not None
    table = Table(
        title=f"{settings.model}, {settings.tokens_per_run:,} tokens per run, "
        + (f"one lr per optimizer and batch size b ({SMOKE})" if smoke else "best lr per optimizer and batch size b"),
        caption="loss: final validation loss; logit: max attention logit at the end (max over layers)",
        title_justify="left",
        caption_justify="left",
        header_style="bold",
    )
    table.add_column("optimizer")
    for b in settings.batch_sizes:
        table.add_column(f"b{b} loss", justify="right")
        table.add_column(f"b{b} lr", justify="right", style="dim")
        table.add_column(f"b{b} logit", justify="right")
    lowest = {}
    for b in settings.batch_sizes:
        for key in ("final_val_loss", MAX_ATTENTION_LOGIT):
            values = [
                e.value(key)
                for (o, bb), e in best.items()
                if bb == b and e.status == "finished" and e.value(key) is not None and math.isfinite(e.value(key))
            ]
            lowest[b, key] = min(values) if len(values) > 1 and not smoke else None
    for name in settings.optimizers:
        cells = [name]
        for b in settings.batch_sizes:
            e = best.get((name, b))
            if e is None:
                cells += ["", "", ""]
            elif e.status != "finished":
                cells += [f"[red]{e.status}[/]", "-", "-"]
            else:
                loss, logit = e.final_val_loss, e.max_attention_logit
                loss_text = f"{loss:.4f}" + (f" ± {e.final_val_loss_std:.4f}" if e.final_val_loss_std else "")
                logit_text = fmt_float(logit, 3)
                if loss == lowest[b, "final_val_loss"]:
                    loss_text = f"[bold green]{loss_text}[/]"
                if logit is not None and logit == lowest[b, MAX_ATTENTION_LOGIT]:
                    logit_text = f"[bold]{logit_text}[/]"
                edge = {"low": " ↓", "high": " ↑"}.get(e.lr_at_edge or "", "")
                cells += [loss_text, _lr(e.lr) + edge, logit_text]
        table.add_row(*cells)
    return table


def no_verdict_line(summary) -> str | None:
    """Why the comparison gives no verdict, said once ('no verdict: this is a smoke run ...'), or None."""
    from merit_core.compare.verdicts import no_verdict

    reason = no_verdict(summary)
    return None if reason is None else f"[yellow]no verdict:[/] {reason}"


def _check_task_trust(spec, trusted: bool) -> None:
    """A task folder is code (merit eval --trust-task-code): refused before any run trains."""
    from merit_core.evaluation.tasks import check_task_code_trusted

    check_task_code_trusted(spec.eval.include_path if spec.eval is not None else None, trusted)


@click.command("compare", context_settings={"show_default": True})
@click.argument("config_file", required=False, metavar="[CONFIG]")
@setting_option(CompareDefaults, "optimizers")
@setting_option(CompareDefaults, "batch_sizes")
@setting_option(CompareDefaults, "lrs")
@setting_option(CompareDefaults, "tokens", type=int, callback=None)
@setting_option(TrainConfig, "model", default=COMPARE_TRAIN["model"])
@setting_option(TrainConfig, "data")
@setting_option(TrainConfig, "seq_len", default=COMPARE_TRAIN["seq_len"], type=int, callback=None)
@setting_option(TrainConfig, "device", callback=device_callback)
@setting_option(CompareDefaults, "out", short="-o", metavar="DIR")
@setting_option(CompareDefaults, "jobs", type=int, callback=None)
@click.option(
    "--quick",
    is_flag=True,
    help=f"A smoke run: {COMPARE.quick_tokens} tokens per run, only the centre of each auto grid (6 runs of the "
    "default) and half the evaluations; its report gives no verdict on the paper's claims.",
)
@setting_option(CompareDefaults, "seeds", type=int, callback=None)
@setting_option(CompareDefaults, "best_seeds", type=int, callback=None)
@setting_option(CompareDefaults, "environment_check")
@setting_option(CompareDefaults, "hessian")
@setting_option(CompareDefaults, "preset")
@click.option("--eval", "eval_tasks", metavar="TASKS", help="Zero-shot tasks (merit eval's names) for each best run.")
@click.option(
    "--include-path",
    type=click.Path(),
    help="A folder of local lm-eval task YAMLs for --eval; it is code, so it needs --trust-task-code.",
)
@click.option(
    "--trust-task-code",
    is_flag=True,
    help="Read the --include-path task folder (or the spec's eval.include_path), which is code: see merit eval.",
)
@click.option("--eval-limit", type=int, help="At most this many documents per --eval task.")
@setting_option(CompareDefaults, "max_extensions", type=int, callback=None)
@click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="KEY=VALUE",
    help="A merit train setting for every run (e.g. warmup_ratio=0.05, micro_batch_size=16).",
)
@wide_option()
def compare(
    config_file,
    optimizers,
    batch_sizes,
    lrs,
    tokens,
    model,
    data,
    seq_len,
    device,
    out,
    jobs,
    quick,
    seeds,
    hessian,
    preset,
    eval_tasks,
    include_path,
    trust_task_code,
    eval_limit,
    max_extensions,
    overrides,
    best_seeds,
    environment_check,
    wide,
):
    """Compare optimizers at a small and a large batch, same token budget, each at its best lr.

    CONFIG is a TOML spec or the name of a shipped one (compare-gpt2-small; merit train --list-configs).
    Every run is an ordinary `merit train` run folder under OUT/runs/; OUT gets summary.json,
    compare.png (loss vs batch size, max attention logit vs step) and REPORT.md. A re-run
    skips finished runs and resumes unfinished ones.

    \b
    Examples:
      merit compare --quick                         # a smoke run: one lr per optimizer and batch
      merit compare --optimizers adamw,merit --batch-sizes 2,16 --seeds 2
      merit compare --preset ablations              # merit against its ablations
      merit compare compare-cpu --out runs/cpu      # the committed CPU reproduction
    """
    check_output(out, folder=True)  # as typed, before the spec's imports; the spec's own out is checked below
    from merit_core.hub import prefer_offline

    prefer_offline()
    from merit_core.compare import load_spec, run_compare
    from merit_core.config_catalog import find_config

    spec = load_spec(
        find_config(config_file, "compare") if config_file is not None else None,
        optimizers=optimizers,
        batch_sizes=batch_sizes,
        lrs=lrs,
        tokens=tokens,
        out=out,
        jobs=jobs,
        quick=quick,
        overrides=overrides,
        train_values=dict(model=model, data=data, seq_len=seq_len, device=device),
        seeds=seeds,
        hessian=hessian,
        eval_tasks=eval_tasks,
        include_path=include_path,
        eval_limit=eval_limit,
        preset=preset,
        max_extensions=max_extensions,
        best_seeds=best_seeds,
        environment_check=environment_check,
    )
    _check_task_trust(spec, trust_task_code)
    check_output(spec.out, folder=True)  # a folder that refuses a file: before the grid is planned
    spec.command = _command_line(click.get_current_context())
    report = RichCompareReport(wide=wide)
    try:
        result = run_compare(spec, report)
    finally:
        report.close()
    out_console = report.out
    summary = result.summary
    out_console.print()
    report.tables.print(results_table(summary))
    line = no_verdict_line(summary)
    if line is not None:
        out_console.print(line)
    measures = measures_table(summary)
    if measures is not None:
        report.tables.print(measures)
    for status in ("diverged", "unstable", "missing"):
        failed = [r.name for r in summary.runs if r.status == status]
        if failed:
            out_console.print(f"[red]{status}:[/] {', '.join(failed)}")
    extended = [b for b in summary.best if b.lr_extended]
    if extended:
        out_console.print(
            "[dim]grids extended past an edge: "
            + ", ".join(f"{b.optimizer} b{b.batch_size} +{', '.join(map(_lr, b.lr_extended))}" for b in extended)
            + "[/]"
        )
    if any(b.lr_at_edge for b in summary.best):
        out_console.print(
            "[dim]↓/↑: the best lr is still the smallest/largest of its grid (extension limit, a given list or "
            "--quick); the optimum may lie outside.[/]"
        )
    trained = len(result.trained)
    out_console.print(
        f"\n{trained} run(s) trained, {len(result.states_before) - trained} skipped, "
        f"in {fmt_duration(result.elapsed_s)}"
    )
    for path in (result.summary_path, result.plot_path, result.report_path):
        print_whole(out_console, f"  {shown(path)}")
