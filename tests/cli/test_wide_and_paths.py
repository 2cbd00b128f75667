"""`--wide` prints every table column at its full width, one line per row (merit_cli.render.wide_console),
where a table otherwise fits the terminal; and a printed path (a run folder, a checkpoint, a file
written) comes out whole at 80 columns, a line that can be copied as it is (merit_cli.render.print_whole)."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
from click.testing import CliRunner
from rich.console import Console
from rich.table import Table

from merit_cli.main import cli
from merit_cli.render import print_key_values, print_table, print_whole, wide_console

NAMES = ("transformer.h.0.attn.c_attn.weight", "transformer.h.11.mlp.c_proj.weight")
COLUMNS = [f"stat {i}" for i in range(12)]


def _value(row: int, column: int) -> str:
    return f"{(row + 1) * 0.0912345 * (column + 1):.6f}"


def _table() -> Table:
    """Thirteen columns: far more than 80 columns hold."""
    table = Table(title="weights", title_justify="left")
    table.add_column("weight")
    for name in COLUMNS:
        table.add_column(name, justify="right")
    for row, name in enumerate(NAMES):
        table.add_row(name, *(_value(row, c) for c in range(len(COLUMNS))))
    return table


def _console(width: int = 80) -> Console:
    return Console(file=io.StringIO(), width=width, force_terminal=False, color_system=None)


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in re.split(r"[│┃|]", line) if cell.strip()]


def _record_lines(text: str) -> list[list[str]]:
    """The table lines that start with a record's name, split into their cells."""
    return [_cells(line) for line in text.splitlines() if any(name in line for name in NAMES)]


def test_a_table_too_wide_for_80_columns_folds_and_with_wide_is_one_line_per_record():
    out = _console()
    print_table(out, _table())
    folded = out.file.getvalue()
    assert "weights (1/" in folded and max(map(len, folded.splitlines())) <= 80  # split into parts that fit
    assert all(len(cells) < 1 + len(COLUMNS) for cells in _record_lines(folded))

    out = _console()
    print_table(wide_console(out), _table())
    wide = out.file.getvalue()
    assert "(1/" not in wide and max(map(len, wide.splitlines())) > 80
    header = next(_cells(line) for line in wide.splitlines() if "stat 0" in line)
    assert header == ["weight", *COLUMNS]
    expected = [[name, *(_value(row, c) for c in range(len(COLUMNS)))] for row, name in enumerate(NAMES)]
    assert _record_lines(wide) == expected  # one line per record, every column, in order


def test_wide_keeps_the_consoles_colours_and_terminal():
    plain, coloured = _console(), Console(file=io.StringIO(), width=80, force_terminal=True, color_system="256")
    assert (wide_console(plain).is_terminal, wide_console(plain).color_system) == (False, None)
    assert (wide_console(coloured).is_terminal, wide_console(coloured).color_system) == (True, "256")
    assert wide_console(coloured).file is coloured.file


@pytest.mark.parametrize("command", ["inspect", "eval", "compare"])
def test_every_command_that_prints_tables_takes_the_one_wide_option(command):
    from merit_cli.main import COMMANDS  # noqa: F401  (the commands load lazily)

    group = cli
    ctx = group.make_context("merit", [command, "--help"], resilient_parsing=True)
    found = group.get_command(ctx, command)
    (option,) = [p for p in found.params if p.name == "wide"]
    assert option.opts == ["--wide"] and option.is_flag
    assert "every column at its full width" in option.help
    result = CliRunner().invoke(cli, [command, "--help"])
    assert result.exit_code == 0 and "--wide" in result.output


def test_inspect_wide_prints_a_per_head_row_on_one_line(tmp_path):
    from tests.tiny_models import tiny_gpt2

    heads = 32
    folder = tmp_path / "ckpt"
    tiny_gpt2(n_embd=64, n_head=heads).save_pretrained(folder)
    args = ["inspect", str(folder), "--no-logits", "--no-updates", "--per-head", "--no-weights"]
    folded, wide = (CliRunner().invoke(cli, args + extra) for extra in ([], ["--wide"]))
    assert folded.exit_code == 0 and wide.exit_code == 0, folded.output + wide.output
    per_head = "‖Q_h‖m·‖K_h‖m per head"
    assert f"{per_head} (1/" in folded.output  # piped, inspect's tables fit 160 columns: split in parts
    assert f"{per_head} (1/" not in wide.output
    table = wide.output[wide.output.index(per_head) :]
    header = next(_cells(line) for line in table.splitlines() if "h31" in line)
    assert header == ["layer", *(f"h{h}" for h in range(heads))]
    rows = [_cells(line) for line in table.splitlines() if re.match(r"^│\s+[01]\s+│", line)][:2]
    assert [row[0] for row in rows] == ["0", "1"] and all(len(row) == 1 + heads for row in rows)


LONG = Path("/tmp/a-folder-with-a-rather-long-name/runs/20261203-101010-gpt2-tiny-merit/step_5")


def test_a_long_path_prints_whole_at_80_columns():
    out = _console()
    out.print(f"[dim]run folder {LONG}[/]")  # what rich alone does: the name broken across lines
    assert str(LONG) not in out.file.getvalue()
    out = _console()
    print_whole(out, f"[dim]run folder {LONG}[/]")
    assert out.file.getvalue().splitlines() == [f"run folder {LONG}"]


def test_key_values_keep_paths_whole_and_align_the_keys():
    out = _console()
    print_key_values(out, "Run summary", [("run folder", LONG), ("steps", "5 (10.2k tokens)"), ("curves", "c.png")])
    assert out.file.getvalue().splitlines() == [
        "Run summary",
        f"  run folder    {LONG}",
        "  steps         5 (10.2k tokens)",
        "  curves        c.png",
    ]


def test_the_train_summary_prints_its_paths_whole_at_80_columns(monkeypatch, capsys):
    from merit_cli.train_cmd import RichTrainReport
    from merit_core.settings import TrainConfig
    from merit_core.train.callbacks import RunSummary

    monkeypatch.setenv("COLUMNS", "80")
    report = RichTrainReport()
    checkpoint = LONG
    summary = RunSummary(
        run_dir=LONG.parent,
        config=TrainConfig(),
        steps=5,
        tokens=10240,
        n_params=1_350_000,
        elapsed_s=60.0,
        tokens_per_s=171.0,
        final_loss=7.641,
        final_val_loss=7.623,
        max_attention_logit=[0.295, 0.287],
        last_checkpoint=checkpoint,
        device="cpu",
    )
    report.on_checkpoint(5, checkpoint)
    report.on_end(summary)
    lines = capsys.readouterr().out.splitlines()
    assert any(line.split() == ["run", "folder", str(LONG.parent)] for line in lines), lines
    assert any(line.split() == ["last", "checkpoint", str(checkpoint)] for line in lines), lines
    assert any(line.split() == ["curves", str(LONG.parent / "curves.png")] for line in lines), lines
    assert f"checkpoint step=5 path={checkpoint}" in lines  # piped: the plain line, whole too
