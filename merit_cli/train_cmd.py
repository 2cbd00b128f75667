"""`merit train`: parse options into a TrainConfig, run merit_core's training, render progress."""

from __future__ import annotations

import os
import shlex
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from merit_cli.options import check_output, device_callback, dtype_callback, number, setting_option
from merit_cli.render import (
    LiveReport,
    configs_table,
    console,
    eval_line,
    fmt_count,
    fmt_duration,
    fmt_float,
    peak_logit,
    plural,
    print_command_hints,
    print_key_values,
    print_whole,
    shown,
    train_log_line,
    training_progress,
)
from merit_core.checkpoint import CONFIG_FILE, read_run_config
from merit_core.config_reading import check_names_and_out, load_config
from merit_core.durable_writes import refuse_link
from merit_core.errors import ConfigError, MeritError
from merit_core.settings import TRAIN_DTYPES, TrainConfig, option_names

if TYPE_CHECKING:
    from rich.progress import TaskID

    from merit_core.train.callbacks import RunInfo, RunSummary


def lr_source(chosen: Any) -> str:
    """Where a default lr came from, for the start line: the lr table's own words, shortened for an
    extrapolated one (whose full account, with both runs, is several hundred characters; it stays in
    merit_core.optim.lr_table's LrDefault.source)."""
    entry = chosen.entry
    if not chosen.extrapolated or entry is None:
        return chosen.source
    cap = f", capped at {chosen.cap.lr:g}, the largest lr trained stably on {chosen.cap.model}" if chosen.cap else ""
    return (
        f"extrapolated from the lr measured for {entry.model} at batch {entry.batch_size} x {entry.seq_len}, "
        f"{entry.lr:g}{cap}; run: {entry.run}"
    )


class RichTrainReport(LiveReport):
    """Renders a run: a header, a live progress bar, eval lines, and a summary table.

    It is the run's merit_core.train.callbacks.TrainCallbacks, every hook written out (on_prepare from
    LiveReport) rather than inherited, so that this module, read at `merit train --help`, does not import
    the training package (torch); tests/cli check that it answers every hook."""

    def __init__(self, yes: bool = False):
        super().__init__(guard=True)
        self.yes = yes  # --yes: a long run goes on without asking
        self.task: TaskID | None = None
        self.fields: dict[str, Any] = {"loss": "-", "lr": "-", "tok_s": "-", "max_logit": "-"}
        self.data_line: str | None = None  # shown with the start line: a run refused before it starts prints only why
        self.started = time.monotonic()  # the summary's time counts the run; this, all the command took

    def stop_requested(self) -> str | None:
        """'SIGPIPE' once stdout is lost (its reader went away): the run checkpoints and stops, as
        on SIGTERM; the log file and metrics.jsonl are written as before."""
        return "SIGPIPE" if self.output is not None and self.output.lost else None

    def on_data(self, meta) -> None:
        if self.stages is not None:
            self.stages.stop()
        self.data_line = (
            f"[dim]data {shown(meta.path)}: {fmt_count(meta.train_tokens)} train / {fmt_count(meta.val_tokens)} "
            f"val tokens, vocabulary {meta.vocab_size}[/]"
        )

    def on_start(self, info: RunInfo) -> None:
        if self.data_line is not None:
            self.out.print(self.data_line, soft_wrap=True)
        c = info.config
        world = f" x {info.world_size} processes ({c.parallel})" if info.world_size > 1 else ""
        verb = f"Resuming from {shown(info.resumed_from)}" if info.resumed_from else "Training"
        source = info.lr_default  # where resolve took the lr from; None when the config gave it
        lr_note = f" ({shown(lr_source(source))})" if source is not None else ""
        # e.g. "lr 0.002 (merit's measured default for gpt2-small at batch 64 x 1024; run: ...)"
        self.out.print(
            f"[bold]{verb}[/] {shown(c.model)} ({fmt_count(info.n_params)} parameters) with [bold]{c.optimizer}[/], "
            f"lr {c.lr:g}{lr_note}, batch {c.batch_size} x {c.seq_len} = {fmt_count(info.tokens_per_step)} tokens/step "
            f"(micro-batch {c.micro_batch_size}), {plural(info.total_steps, 'step')} on {info.device}{world}"
        )
        self.out.print(f"[dim]{device_line(info)}[/]")
        print_whole(self.out, f"[dim]run folder {shown(info.run_dir)}[/]")
        self.total_steps = info.total_steps
        if self.plain:
            return
        self.progress = training_progress(self.out)
        self.progress.start()
        self.task = self.progress.add_task("train", total=info.total_steps, completed=info.start_step, **self.fields)

    def on_step(self, step: int) -> None:
        if self.progress is not None and self.task is not None:  # the bar moves every step; its numbers on log steps
            self.progress.update(self.task, completed=step)

    def on_step_loss(self, step: int, loss: float) -> None:
        if (
            self.progress is not None and self.task is not None
        ):  # the loss between log lines (every step on a CPU, step 1 anywhere)
            self.fields.update(loss=fmt_float(loss))
            self.progress.update(self.task, completed=step, **self.fields)

    def on_log(self, record: dict[str, Any]) -> None:
        if self.plain:
            self.say(train_log_line(record, self.total_steps))
            return
        self.fields.update(
            loss=fmt_float(record["loss"]), lr=f"{record['lr']:.1e}", tok_s=fmt_count(record["tokens_per_s"])
        )
        if self.progress is not None and self.task is not None:  # started by on_start outside plain mode
            self.progress.update(self.task, completed=record["step"], **self.fields)

    def on_eval(self, record: dict[str, Any]) -> None:
        if self.plain:
            self.say(eval_line(record))
            return
        peak, at = peak_logit(record)
        self.fields["max_logit"] = fmt_float(peak, 3)
        if self.progress is not None and self.task is not None:
            self.progress.update(self.task, **self.fields)
            layer = at if at is not None else "-"
            self.progress.console.print(
                f"[dim]step {record['step']:>6}[/]  val loss [bold cyan]{fmt_float(record['val_loss'])}[/]  "
                f"max attention logit [magenta]{fmt_float(peak, 3)}[/] (layer {layer})"
            )

    def on_watch(self, record: dict[str, Any]) -> None:
        """Nothing to draw: a warning arrives as a note (on_note), the values go to metrics.jsonl."""

    def on_checkpoint(self, step: int, path: Path) -> None:
        if self.plain:
            self.say(f"checkpoint step={step} path={path}")
        elif self.progress is not None:
            print_whole(self.progress.console, f"[dim]step {step:>6}  saved {shown(path)}[/]")

    def confirm(self, message: str) -> bool:
        """On a terminal (stdin and stdout), unless --yes: ask before a long run; off one, go on."""
        if self.yes or self.plain or not sys.stdin.isatty():
            return True
        return click.confirm("start it anyway?", default=False, err=False)

    def on_note(self, message: str) -> None:
        console = self.progress.console if self.progress is not None else self.out

        console.print(f"[yellow]note:[/] {shown(message)}", highlight=False, soft_wrap=True)

    def on_end(self, summary: RunSummary) -> None:
        self.close()
        logits = summary.max_attention_logit or []
        rows = [
            ("run folder", summary.run_dir),
            ("steps", f"{summary.steps} ({fmt_count(summary.tokens)} tokens)"),
            ("time", run_time(summary.elapsed_s, time.monotonic() - self.started)),
            ("wall tokens/s", f"{fmt_count(summary.tokens_per_s)} (the whole run: evals and checkpoints included)"),
            ("device", f"{summary.device} ({summary.device_name or '-'}), {summary.compute_dtype}"),
            ("peak memory", peak_memory_text(summary.peak_memory, summary.device)),
            ("compile", summary.compile or "-"),
            ("MFU", f"{summary.mfu:.1%}" if summary.mfu is not None else "- (not measured on CPU or an unlisted GPU)"),
            ("final train loss", fmt_float(summary.final_loss)),
            ("final val loss", fmt_float(summary.final_val_loss)),
            ("max attention logit", ", ".join(fmt_float(v, 3) for v in logits) + "  (per layer)" if logits else "-"),
            ("last checkpoint", summary.last_checkpoint or "-"),
            ("curves", summary.run_dir / "curves.png"),
        ]
        self.out.print()
        print_key_values(self.out, "Run summary", rows)
        self.out.print()
        hints = [
            (f"merit inspect {shlex.quote(str(summary.run_dir))}", "max-norms and attention logits per checkpoint")
        ]
        if summary.last_checkpoint:
            hints.append(eval_hint(str(summary.last_checkpoint)))
        print_command_hints(self.out, "Next", hints)


def _list_configs(ctx, param, value):
    if not value or ctx.resilient_parsing:
        return

    from merit_core.config_catalog import shipped_configs

    out = console()
    configs = shipped_configs()
    if out.is_terminal:
        out.print(configs_table(configs))
    else:  # whole lines for a pipe or a file
        width = max(len(f"merit {c.command} {c.name}") for c in configs)
        cost_width = max(len(c.cost or "-") for c in configs)
        for c in configs:
            line = f"{f'merit {c.command} {c.name}':<{width}}  {c.cost or '-':<{cost_width}}  {c.summary}"
            out.print(line, markup=False, highlight=False, soft_wrap=True)
    out.print(
        "[dim]GPU costs assume 6·N·tokens FLOPs at 40% MFU in bf16; each file's header has the details.[/]",
        soft_wrap=not out.is_terminal,
    )
    ctx.exit(0)


def eval_hint(checkpoint: str) -> tuple[str, str]:
    """The Next line for `merit eval`: the hub's LAMBADA / WikiText when the hub answers, else the
    offline tasks on the built-in corpus (the hub's datasets cannot be fetched then)."""
    from merit_core.hub import hub_reachable

    if hub_reachable():
        return (
            f"merit eval {shlex.quote(checkpoint)} --tasks lambada,wikitext",
            "zero-shot LAMBADA / WikiText (datasets downloaded once; --tasks builtin works offline)",
        )
    return (
        f"merit eval {shlex.quote(checkpoint)} --tasks builtin",
        "offline: perplexity and last-word accuracy on the built-in corpus's held-out text",
    )


def micro_batch(ctx, param, value):
    """--micro-batch-size: 'auto' (the trainer chooses: the config value "auto") or a positive integer."""
    if value is not None and value.strip().lower() == "auto":
        return "auto"
    return number(int)(ctx, param, value)


def device_line(info: RunInfo) -> str:
    """Device name, compute dtype, TF32 and the peak MFU is measured against."""
    dtype = "bf16 autocast" if info.compute_dtype == "bfloat16" else "float32"
    memory = f" ({info.device_memory / 2**30:.0f} GiB)" if info.device_memory else ""
    parts = [f"device {info.device_name or info.device}{memory}", dtype]
    tf32 = "tf32 " + ("on" if info.config.tf32 else "off")
    if info.device.startswith("cuda"):
        parts.append(tf32)
        parts.append(
            f"MFU against a {info.peak_flops / 1e12:g} TFLOP/s bf16 peak"
            if info.peak_flops
            else "MFU not reported (GPU not in merit_core.train.hardware's peak table)"
        )
    else:
        parts += [f"{tf32} (no effect on CPU)", "MFU not reported on CPU"]
    return ", ".join(parts)


def run_time(run_s: float, command_s: float) -> str:
    """The run's time, and all the command took where that is a second longer (data preparation, model
    building and imports come before the run's clock starts)."""
    if command_s - run_s < 1:
        return fmt_duration(run_s)
    return f"{fmt_duration(run_s)} training, {fmt_duration(command_s)} in all (data preparation and start-up included)"


def peak_memory_text(peak: int | None, device: str) -> str:
    if peak is None:
        return "-"
    what = "allocated on the GPU" if device.startswith("cuda") else "peak RSS of the process"
    return f"{peak / 2**30:.2f} GiB ({what})"


# How `merit train` converts the options whose words differ from their setting's type; every other
# option is what merit_core.settings declares (setting_option).
CONVERTERS = {
    "micro_batch_size": micro_batch,
    "device": device_callback,
    "dtype": dtype_callback(TRAIN_DTYPES),
}
# The options of `merit train` that set a config key, one per TrainConfig setting declared with an
# option (merit_core.settings), in its order: an option's parameter name is its TrainConfig key, so the
# command passes them to load_config as they are (None: not given).
CONFIG_OPTIONS = tuple(
    setting_option(
        TrainConfig,
        name,
        **({"short": "-o", "metavar": "DIR"} if name == "out" else {}),
        **({"callback": CONVERTERS[name]} if name in CONVERTERS else {}),
    )
    for name in option_names(TrainConfig)
)


def config_options(command):
    """Apply CONFIG_OPTIONS to `command`, in their order in --help."""
    for option in reversed(CONFIG_OPTIONS):
        command = option(command)
    return command


@click.command("train", context_settings={"show_default": True})
@click.argument("config_file", required=False, metavar="[CONFIG]")
@click.option(
    "--list-configs",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=_list_configs,
    help="List the shipped configs (CONFIG may be one of their names) with their costs, and exit.",
)
@click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="KEY=VALUE",
    help="Override any config key (a TOML value; dotted keys for tables: optimizer_args.betas=[0.9,0.95]).",
)
@click.option(
    "--yes",
    "-y",
    is_flag=True,
    help="Start a run estimated at more than about an hour on a CPU without asking (off a terminal it never asks).",
)
@config_options
def train(config_file, overrides, yes, **values):
    """Pretrain a language model with MERIT or a baseline optimizer.

    --model: GPT-2, Llama, Qwen, Mistral, Gemma, OLMo, Phi-3 or Pythia (a named one, a -tiny of each
    family, or a config.json).

    CONFIG is a TOML file or the name of a shipped config (merit train --list-configs).
    With no arguments: a tiny GPT-2 trained with MERIT on the built-in corpus (a few minutes on a CPU).
    Under `torchrun --nproc_per_node N -m merit_cli train ...` it trains with DDP, or with FSDP2 given --parallel fsdp.
    SIGTERM / SIGUSR1 (cluster preemption), Ctrl-C, SIGHUP (a closed terminal or ssh session) and a
    closed stdout (merit train | head) finish the current step (or micro-batch), save a checkpoint and
    exit with 143 / 130 / 129 / 141; continue with --resume. A second one aborts at once, losing the
    step under way; a signal ignored at start (nohup) stays ignored. On a CPU a run estimated at more
    than about an hour says so first, with a config that fits, and asks on a terminal (--yes: no).

    \b
    Examples:
      merit train --steps 5 --out runs/first        # gpt2-tiny + MERIT on the built-in corpus
      merit train debug --set lr=3e-3               # a shipped config (--list-configs), one setting changed
      merit train --model llama-tiny --optimizer sophiag --batch-size 64 --steps 200
      merit train --data my_corpus/ --tokenizer gpt2 --model gpt2-small
      merit train --resume --out runs/first         # continue from the latest checkpoint
    """
    from merit_core.hub import prefer_offline

    prefer_offline()
    main = int(os.environ.get("RANK", "0")) == 0
    try:
        summary_config = _load(config_file, overrides, values)
        check_names_and_out(summary_config)  # before the seconds of importing torch: a typo is one line at once
        check_output(summary_config.out, folder=True)  # a folder that refuses a file: before any work
        from merit_core.train.training_run import run_training

        report = RichTrainReport(yes=yes) if main else None
        try:
            run_training(summary_config, report)
        finally:
            if report is not None:
                report.close()
    except MeritError:
        if main:
            raise
        sys.exit(2)  # the main process prints the one error line


def _load(config_file, overrides, values):
    """Defaults < CONFIG.toml (or the resumed run's config.toml) < --set < options."""
    from merit_core.config_catalog import find_config

    base = find_config(config_file, "train") if config_file is not None else None
    if values.get("resume") or values.get("resume_from"):
        if not values.get("out"):
            raise ConfigError("--resume needs the run folder: merit train --resume --out RUN_DIR")
        saved = Path(values["out"]) / CONFIG_FILE
        refuse_link(saved, "in a run folder")  # a planted link: neither read as the run's config nor replaced
        if saved.exists() and not saved.is_file():
            raise ConfigError(f"{saved} is not a file (a folder?); it is not the run's config: move it away to resume")
        if base is None:
            return load_config(read_run_config(values["out"]), overrides, values)
    return load_config(base, overrides, values)
