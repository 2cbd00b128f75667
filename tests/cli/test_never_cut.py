"""Tables on a narrow console never cut a number or a name with '…' (merit_cli.render.never_cut): numbers
keep their width, names fold onto more lines."""

from __future__ import annotations

import io

from rich.console import Console
from rich.table import Table

from merit_cli.render import never_cut, print_table

NAMES = ("transformer.h.0.attn.c_attn.weight", "transformer.h.11.mlp.c_proj.weight")
NUMBERS = ("0.0912345", "123456.789", "-7.25e-05")


def _table() -> Table:
    table = Table(title="weights")
    table.add_column("weight")
    for name in ("max |w|", "RMS", "update / weight", "outlier rows", "kurtosis"):
        table.add_column(name, justify="right")
    for name in NAMES:
        table.add_row(name, *NUMBERS, "[bold]12.5[/]", "3.25")
    return table


def _render(table: Table, width: int, fold: bool = False) -> str:
    buf = io.StringIO()
    out = Console(file=buf, width=width, force_terminal=False, color_system=None)
    print_table(out, table) if fold else out.print(table)
    return buf.getvalue()


def test_rich_alone_cuts_numbers_on_a_narrow_console():
    assert "…" in _render(_table(), 60)  # what the tables did


def test_never_cut_sets_number_columns_to_their_widest_cell_and_names_to_fold():
    table = never_cut(_table())
    assert table.columns[0].overflow == "fold"
    assert [c.min_width for c in table.columns[1:]] == [9, 10, len("update / weight"), len("outlier rows"), 8]


def test_tables_keep_every_number_whole_and_fold_names_and_columns():
    for width in (60, 80, 100):
        text = _render(_table(), width, fold=True)
        assert "…" not in text, text
        for number in (*NUMBERS, "12.5", "3.25"):
            assert text.count(number) == len(NAMES), (width, number, text)
        joined = "".join(line.strip("│| ").replace(" ", "").replace("│", "") for line in text.splitlines())
        for name in NAMES:
            assert name in joined or all(part in text for part in name.split(".")), (width, text)
