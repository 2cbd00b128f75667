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
