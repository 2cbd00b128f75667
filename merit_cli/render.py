"""Shared rich rendering: consoles, number formats, key/value tables, progress of long work, a training bar."""

from __future__ import annotations

import contextlib
import io
import math
import os
import sys
import time
from collections.abc import Callable, Iterable
from typing import IO, Any, cast

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table
from rich.text import Text

from merit_core.errors import printable
from merit_core.metric_names import MAX_ATTENTION_LOGIT, VAL_LOSS
from merit_core.precursors import peak


def shown(value: Any) -> str:
    """A name, path or any text a user or a file gave, ready to be put in a rich markup string: the
    control characters and non-UTF-8 bytes escaped (merit_core.errors.printable) so that nothing
    reaches the terminal raw, then rich's markup escaped so that `[/bold]` in a tensor or folder
    name prints as itself. Every name and path the CLI prints goes through here."""
    return escape(printable(os.fspath(value) if isinstance(value, os.PathLike) else value))


def console(stderr: bool = False) -> Console:
    return Console(stderr=stderr, highlight=False)


# The width of a --wide console: more columns than any table of merit's takes, so every column is at its
# full width and each row one line (rich pads a table to its own width, not to the console's).
WIDE_COLUMNS = 100_000


def wide_console(out: Console) -> Console:
    """A console on `out`'s stream (terminal or not, colours or not, as `out`) that no table reaches the
    edge of: tables print every column unfolded at its full width, one line per row, whatever the
    terminal's width (--wide: for a pipe or a wide terminal)."""
    return Console(
        file=out.file,
        width=WIDE_COLUMNS,
        force_terminal=out.is_terminal,
        color_system=cast(Any, out.color_system),  # the name ("256", "truecolor", ...) or None, as out's
        no_color=out.no_color,
        highlight=False,
    )


def print_whole(out: Console, markup: str, **kwargs: Any) -> None:
    """Print `markup` (names and paths in it through `shown`) as one line that rich neither wraps nor
    cuts: only the terminal folds it on screen, so that a path or a command in it is copied whole.
    Every line that prints a path (a run folder, a checkpoint, a file written) goes through here or
    `print_key_values`."""
    out.print(markup, soft_wrap=True, **kwargs)


def print_key_values(out: Console, title: str, rows: Iterable[tuple[str, Any]], key_style: str = "dim") -> None:
    """A bold title, then one `key   value` line per row with the keys aligned, each line whole
    (`print_whole`): a path among the values is never wrapped or cut, at any width."""
    pairs = [(key, value) for key, value in rows]
    width = max((len(key) for key, _ in pairs), default=0)
    print_whole(out, f"[bold]{escape(title)}[/]")
    for key, value in pairs:
        print_whole(out, f"  [{key_style}]{escape(key.ljust(width))}[/]    {shown(value)}")


def plain_line(kind: str, fields: Iterable[tuple[str, Any]]) -> str:
    """One `kind key=value ...` line for logs read by batch systems (None values are left out)."""
    return " ".join([kind, *(f"{key}={value}" for key, value in fields if value is not None)])


def peak_logit(record: dict[str, Any]) -> tuple[float | None, int | None]:
    """The peak of a record's per-layer max attention logits and its layer (None, None when not measured)."""
    values = record.get(MAX_ATTENTION_LOGIT)
    if isinstance(values, (int, float)):
        return float(values), None
    top = peak(MAX_ATTENTION_LOGIT, values, nan_worst=True)  # a logit that is not a number is shown
    return (float(top[0]), top[1]) if top else (None, None)


def train_log_line(record: dict[str, Any], total_steps: int | None = None) -> str:
    """`train step=10/300 loss=5.1234 lr=2.000e-02 tokens_per_s=9870 [max_logit=12.345]`."""
    peak, _ = peak_logit(record)
    step = f"{record['step']}/{total_steps}" if total_steps else record["step"]
    return plain_line(
        "train",
        [
            ("step", step),
            ("loss", f"{record['loss']:.4f}"),
            ("lr", f"{record['lr']:.3e}"),
            ("tokens_per_s", f"{record['tokens_per_s']:.0f}" if record.get("tokens_per_s") is not None else None),
            ("max_logit", f"{peak:.3f}" if peak is not None else None),
        ],
    )


def eval_line(record: dict[str, Any]) -> str:
    """`eval step=50 val_loss=5.4321 max_logit=12.345 layer=3`."""
    peak, layer = peak_logit(record)
    return plain_line(
        "eval",
        [
            ("step", record["step"]),
            (VAL_LOSS, f"{record['val_loss']:.4f}" if record.get(VAL_LOSS) is not None else None),
            ("max_logit", f"{peak:.3f}" if peak is not None else None),
            ("layer", layer),
        ],
    )


def configs_table(configs) -> Table:
    """The shipped configs (merit_core.config_catalog.ShippedConfig): command, name, cost, what it is."""
    table = Table(title="Shipped configs", title_justify="left", box=None, padding=(0, 2), header_style="bold")
    # the command is what a user copies: never cut; the cost and the description wrap instead
    commands = [f"merit {c.command} {c.name}" for c in configs]
    table.add_column("run with", no_wrap=True, min_width=max(map(len, commands), default=8))
    table.add_column("cost", ratio=1)
    table.add_column("what", style="dim", ratio=1)
    for c in configs:
        table.add_row(f"merit {c.command} {c.name}", c.cost or "-", c.summary)
    return table


def fmt_float(value: float | None, digits: int = 4) -> str:
    """A compact number ('-' for missing, 'nan'/'inf' as such)."""
    if value is None:
        return "-"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return f"{value:.{digits}g}"


def fmt_count(n: float | None) -> str:
    """1234 -> '1.23k', 5_600_000 -> '5.6M'."""
    if n is None:
        return "-"
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.0f}"


def plural(n: int, word: str) -> str:
    """'1 step', '5 steps'."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def fmt_duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def print_command_hints(out: Console, title: str, hints: Iterable[tuple[str, str]]) -> None:
    """'What to try next': each command whole on its own line (never cut or wrapped by rich, so it can
    be copied as it is), its note after a shell comment mark."""
    text = Text(title, style="bold")
    for command, note in hints:
        text.append(f"\n  {printable(command)}")
        text.append(f"  # {printable(note)}", style="dim")
    out.print(text, soft_wrap=True)


class ProgressView:
    """The one renderer of merit_core.progress.Progress events, for every command.

    On a terminal: transient rich bars, one per stage (the stage before is shown complete when the
    next begins), or with `one_line` a single line that follows the latest event. Off a terminal (a
    batch system's log, a pipe): with `plain_kind`, one `KIND stage=... total=N` line per new stage;
    without, nothing (commands whose stderr must stay one error line). `first` is shown before the
    first event (a slow import); `redirect` lets rich redirect prints to stdout/stderr above the bars.
    """

    def __init__(
        self,
        out: Console,
        *,
        one_line: bool = False,
        plain_kind: str | None = None,
        first: str | None = None,
        redirect: bool = True,
    ):
        self.out = out
        self.plain = not out.is_terminal
        self.one_line = one_line
        self.plain_kind = plain_kind
        self.first = first
        self.bar = Progress(
            SpinnerColumn(),
            TextColumn("{task.description:<28}"),
            BarColumn(bar_width=24),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=out,
            transient=True,
            redirect_stdout=redirect,
            redirect_stderr=redirect,
        )
        self.tasks: dict[tuple[str | None, str], Any] = {}
        self.last: Any = None
        self.seen: set[tuple[str | None, str]] = set()
        self.started = False

    def __enter__(self) -> ProgressView:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        if self.started or self.plain:
            return
        self.bar.start()
        self.started = True
        if self.first is not None:
            self.last = self.bar.add_task(self.first, total=None)

    def __call__(self, event: Any) -> None:
        """Draw one merit_core.progress.Progress event."""
        key = (event.item, event.stage)
        if self.plain:
            if key not in self.seen and self.plain_kind is not None:
                self.seen.add(key)
                fields = [("stage", event.stage.replace(" ", "_")), ("item", event.item), ("total", event.total)]
                line = printable(plain_line(self.plain_kind, fields))
                self.out.print(line, markup=False, highlight=False, soft_wrap=True)
            return
        self.start()
        if self.one_line:
            if self.last is None:
                self.last = self.bar.add_task("", total=None)
            self.bar.update(self.last, description=shown(event.describe()), completed=event.done, total=event.total)
            return
        if key not in self.tasks:
            self._finish_last()
            self.tasks[key] = self.last = self.bar.add_task(shown(event.describe()), total=event.total)
        self.bar.update(self.tasks[key], completed=event.done, total=event.total)

    def _finish_last(self) -> None:
        if self.last is None:
            return
        if self.last not in self.tasks.values():  # the `first` line: it ends with the first stage
            self.bar.remove_task(self.last)
        else:
            task = next(t for t in self.bar.tasks if t.id == self.last)
            self.bar.update(task.id, total=task.completed or 1, completed=task.completed or 1)
        self.last = None

    def stop(self) -> None:
        if self.started:
            self.bar.stop()
            self.started = False


class EtaColumn(ProgressColumn):
    """`eta 12:34`: the time left at the rate measured since the bar was first drawn.

    rich's TimeRemainingColumn averages only the updates of the last 30 s; a training bar moves
    once per log record, and when records come further apart than that (a CPU run logging every
    few tens of seconds) it read `--:--` for the whole run. Here the rate is steps done since the
    first drawing over the time they took, so the estimate appears with the first record.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        super().__init__()
        self.clock = clock
        self.first: dict[Any, tuple[float, float]] = {}  # task id -> (time, completed) when first drawn
        self.latest: dict[Any, tuple[float, float]] = {}  # task id -> (time, completed) of the last move seen

    def render(self, task) -> Text:
        now = self.clock()
        if task.finished:
            return Text("eta 0:00", style="progress.remaining")
        first = self.first.setdefault(task.id, (now, task.completed))
        latest = self.latest.get(task.id)
        if latest is None or task.completed != latest[1]:
            latest = self.latest[task.id] = (now, task.completed)
        done, spent = latest[1] - first[1], latest[0] - first[0]
        if task.total is None or done <= 0 or spent <= 0:
            return Text("eta --:--", style="progress.remaining")
        left = max((task.total - task.completed) * spent / done - (now - latest[0]), 0.0)
        minutes, seconds = divmod(int(round(left)), 60)
        hours, minutes = divmod(minutes, 60)
        clock = f"{hours}:{minutes:02d}:{seconds:02d}" if hours else f"{minutes}:{seconds:02d}"
        return Text(f"eta {clock}", style="progress.remaining")


def training_progress(out: Console) -> Progress:
    """A compact progress bar (fits 80 columns) whose task fields are loss, lr, tok_s and max_logit."""
    return Progress(
        BarColumn(bar_width=12),
        TextColumn("{task.completed:>.0f}/{task.total:.0f}"),
        TextColumn("loss [cyan]{task.fields[loss]}"),
        TextColumn("lr {task.fields[lr]}"),
        TextColumn("{task.fields[tok_s]} train tok/s"),
        TextColumn("logit [magenta]{task.fields[max_logit]}"),
        EtaColumn(),
        console=out,
        transient=False,
    )


class GuardedOutput:
    """A text stream (stdout) whose loss does not fail a long run: the first write or flush that
    fails (EPIPE: the reader of `merit train | head -1` went away; EIO: the terminal hung up) marks
    it `lost` and every later write is dropped. The descriptor is pointed at /dev/null, so that
    Python's own flush at exit cannot fail either."""

    def __init__(self, stream):
        self.stream = stream
        self.lost = False

    def write(self, text: str) -> int:
        if not self.lost:
            try:
                return self.stream.write(text)
            except (OSError, ValueError):
                self._lose()
        return len(text)

    def flush(self) -> None:
        if not self.lost:
            try:
                self.stream.flush()
            except (OSError, ValueError):
                self._lose()

    def _lose(self) -> None:
        self.lost = True
        with contextlib.suppress(OSError, ValueError, AttributeError, io.UnsupportedOperation):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self.stream.fileno())
            os.close(devnull)

    def isatty(self) -> bool:
        try:
            return not self.lost and self.stream.isatty()
        except (OSError, ValueError):
            return False

    def __getattr__(self, name: str):  # fileno, encoding, ... of the stream
        return getattr(self.stream, name)


class LiveReport:
    """Base of the commands' rich callbacks: a console, stage bars started on the first
    `on_prepare`, a main progress bar set by the subclass, and `close()` that stops both."""

    def __init__(self, guard: bool = False):
        # guard: stdout behind GuardedOutput (a long run outlives its reader; `stop_requested` of
        # the train report then asks the run to stop)
        self.output = GuardedOutput(sys.stdout) if guard else None
        # GuardedOutput is a text stream by duck typing (write, flush, isatty, the rest from stdout)
        self.out = Console(file=cast(IO[str], self.output), highlight=False) if guard else console()
        # Not a terminal (a batch system's log file, a pipe): no live bars, one plain line per event.
        self.plain = not self.out.is_terminal
        if self.plain:
            self.out.soft_wrap = True  # a log file has no width: keep each line whole
        self.stages: ProgressView | None = None
        self.progress: Progress | None = None  # the subclass's main display, once it starts it

    def say(self, line: str) -> None:
        """Print `line` as it is: no markup, no wrapping (rich flushes after each print)."""
        self.out.print(printable(line), markup=False, highlight=False, soft_wrap=True)

    def on_prepare(self, event) -> None:
        """Data preparation progress (a merit_core.progress.Progress event)."""
        if self.stages is None:
            self.stages = ProgressView(self.out, plain_kind="prepare")
        self.stages(event)

    def close(self) -> None:
        if self.stages is not None:
            self.stages.stop()
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


def cell_width(cell: Any) -> int:
    text = Text.from_markup(cell) if isinstance(cell, str) else cell
    return text.cell_len if isinstance(text, Text) else 0


def never_cut(table: Table) -> Table:
    """`table` made so that a narrow console never cuts a cell with '…': a right-aligned (number) column
    keeps its widest cell's (and header's) width, other columns (names, paths) fold onto more lines.
    :func:`print_table` also folds columns into a second table when even that is too wide."""
    for column in table.columns:
        if column.justify == "right":
            widths = [cell_width(c) for c in column.cells] + [cell_width(column.header)]
            column.min_width = max([column.min_width or 0, *widths])
            column.no_wrap = True
        else:
            column.overflow = "fold"
    return table


def _styled_like(table: Table, title: Any, caption: Any) -> Table:
    """An empty table drawn as `table` is (justification, box, header style), with its own title and caption."""
    return Table(
        title=title,
        title_justify=table.title_justify,
        caption=caption,
        caption_justify=table.caption_justify,
        box=table.box,
        header_style=table.header_style,
    )


def _on_its_side(table: Table) -> Table:
    """A one-row table as two columns: each column's header beside its cell (the first column's pair
    heads the table), title and caption kept."""
    first, *rest = table.columns
    side = _styled_like(table, table.title, table.caption)
    side.add_column(first.header, justify="left")
    side.add_column(list(first.cells)[0], justify="right")
    for column in rest:
        side.add_row(column.header, list(column.cells)[0])
    return side


def print_table(out: Console, table: Table, first_width: int = 16) -> None:
    """Print `table` (:func:`never_cut`) on `out`; when its number columns do not fit the console beside
    a `first_width` first column, the columns go into several tables of the first column and as many
    others as fit, one after the other (each title says which part it is). A table of one row is never
    split: it is turned on its side, one line per column."""
    never_cut(table)
    columns = table.columns
    space = lambda c: (c.min_width or cell_width(c.header)) + 3  # noqa: E731  (padding and border)
    if len(columns) < 3 or first_width + sum(space(c) for c in columns[1:]) <= out.width:
        out.print(table)
        return
    if table.row_count == 1:
        out.print(never_cut(_on_its_side(table)))
        return
    parts: list[list[int]] = [[]]
    used = first_width
    for index in range(1, len(columns)):
        if parts[-1] and used + space(columns[index]) > out.width:
            parts.append([])
            used = first_width
        parts[-1].append(index)
        used += space(columns[index])
    rows = [[list(c.cells)[r] for c in columns] for r in range(table.row_count)]
    for n, part in enumerate(parts, 1):
        title = f"{table.title} ({n}/{len(parts)})" if table.title else None
        last = n == len(parts)
        piece = _styled_like(table, title, table.caption if last else None)
        for index in [0, *part]:
            column = columns[index]
            piece.add_column(column.header, justify=column.justify, style=column.style)
        for row in rows:
            piece.add_row(*[row[i] for i in [0, *part]])
        out.print(never_cut(piece))
