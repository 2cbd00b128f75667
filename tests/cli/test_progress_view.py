"""The one progress renderer (merit_cli.render.ProgressView) of merit_core.progress.Progress events."""

import io

from rich.console import Console

from merit_cli.render import LiveReport, ProgressView
from merit_core.progress import Progress, report_to


def _console(terminal: bool) -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, force_terminal=terminal, width=100, highlight=False), buf


def test_describe_names_the_item_among_several():
    assert Progress("tokenizing", 3, 10).describe() == "tokenizing"
    assert Progress("loading model", item="run/step_5").describe() == "run/step_5: loading model"
    assert Progress("done", item="b", index=1, count=3).describe() == "[2/3] b: done"
    report_to(None)(Progress("dropped"))  # no callback: the events go nowhere


def test_off_a_terminal_one_plain_line_per_stage():
    out, buf = _console(terminal=False)
    view = ProgressView(out, plain_kind="prepare")
    for done in (0, 5, 10):
        view(Progress("training tokenizer", done, 10))
    view(Progress("tokenizing", 0, None))
    view(Progress("tokenizing", 7, None))
    view.stop()
    assert buf.getvalue().splitlines() == ["prepare stage=training_tokenizer total=10", "prepare stage=tokenizing"]


def test_off_a_terminal_without_a_kind_nothing_is_written():
    out, buf = _console(terminal=False)
    with ProgressView(out, one_line=True, first="loading") as view:
        view(Progress("loading model", item="a"))
    assert buf.getvalue() == ""


def test_on_a_terminal_bars_per_stage_and_one_line():
    out, _ = _console(terminal=True)
    with ProgressView(out, first="loading torch") as view:
        view(Progress("training tokenizer", 4, 10))
        view(Progress("tokenizing", 2, None))
        tasks = {t.description: (t.completed, t.total) for t in view.bar.tasks}
    # the first line gives way to the first stage; a stage ends complete when the next begins
    assert tasks == {"training tokenizer": (4, 4), "tokenizing": (2, None)}

    out, _ = _console(terminal=True)
    with ProgressView(out, one_line=True, first="loading torch") as view:
        view(Progress("checking checkpoints"))
        view(Progress("loglikelihood requests", 3, 8, unit="requests", item="b", index=1, count=2))
        (task,) = view.bar.tasks
    assert (task.description, task.completed, task.total) == ("[2/2] b: loglikelihood requests", 3, 8)


def test_live_report_routes_prepare_events_to_the_view():
    report = LiveReport()
    report.out, buf = _console(terminal=False)
    report.plain = True
    report.on_prepare(Progress("gathering stdlib docstrings"))
    report.close()
    assert buf.getvalue().strip() == "prepare stage=gathering_stdlib_docstrings"


def test_training_bar_eta_appears_with_the_first_log_record():
    """Log records 40 s apart (rich's own column averages 30 s, and said --:-- for a whole CPU run):
    the eta is the rate since the bar was first drawn, from the first record on."""
    import io

    from rich.console import Console
    from rich.progress import Progress

    from merit_cli.render import EtaColumn

    now = [100.0]
    column = EtaColumn(clock=lambda: now[0])
    bar = Progress(column, console=Console(file=io.StringIO()), auto_refresh=False)
    task_id = bar.add_task("train", total=300, completed=0)

    def shown() -> str:
        return column.render(bar.tasks[0]).plain

    assert shown() == "eta --:--"  # the run starts: no rate yet
    now[0] += 40
    bar.update(task_id, completed=10)
    assert shown() == "eta 19:20"  # 290 steps left at 4 s/step
    now[0] += 10  # between records the estimate counts down
    assert shown() == "eta 19:10"
    now[0] += 30
    bar.update(task_id, completed=20)
    assert shown() == "eta 18:40"  # 280 steps left at 4 s/step
    bar.update(task_id, completed=300)
    assert shown() == "eta 0:00"
