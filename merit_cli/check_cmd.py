"""`merit check`: MERIT's every backend on this device against a float64 reference step, as a table.

The library (`merit_core.check.run_check`) returns a `CheckReport`; this module renders it. What
each row means: docs/CHECK.md."""

from __future__ import annotations

import json
import sys

import click

from merit_cli.main import fail
from merit_cli.options import device_option
from merit_core.errors import ConfigError


def _cell(x: float | None) -> str:
    return "-" if x is None else f"{x:.2e}"


def render(report) -> None:
    """The rich table: device and versions above, one row per check, the verdict line below."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(highlight=False)
    if not console.is_terminal:  # a log file or a pipe: wide enough for the note column
        console = Console(highlight=False, width=160)
    console.print(f"[bold]device[/] {escape(report.device)}")
    console.print(escape(", ".join(f"{k} {v}" for k, v in report.versions.items())))
    table = Table(show_edge=False, pad_edge=False)
    for name in ("check", "backend", "dtype", "shape"):
        table.add_column(name, overflow="fold")
    for name in ("max rel. error", "tolerance"):
        table.add_column(name, justify="right")
    for name in ("ok", "note"):
        table.add_column(name, overflow="fold")
    for r in report.rows:
        ok = "[dim]skipped[/]" if r.ok and r.skipped else "[green]ok[/]" if r.ok else "[bold red]FAIL[/]"
        table.add_row(r.check, r.backend, r.dtype, r.shape, _cell(r.error), _cell(r.tolerance), ok, escape(r.note))
    console.print(table)
    failure = report.failure()
    if failure:
        Console(stderr=True, highlight=False).print(f"[bold red]{escape(failure)}[/]", soft_wrap=True)
    else:
        console.print(f"[green]{report.passed_line()}[/] in {report.seconds:.1f} s")


@click.command("check")
@device_option()
@click.option("--quick", is_flag=True, help="The short form `merit train` runs once per machine and device.")
@click.option("--backend", "backends", multiple=True, metavar="NAME", help="Only this backend (repeatable).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON instead of the table.")
def check(device: str, quick: bool, backends: tuple[str, ...], as_json: bool) -> None:
    """Prove MERIT on this device: every backend against a float64 reference step.

    fp32 and bf16, non-contiguous and zero-size tensors, a matrix of several Triton tiles, a
    tensor past 2**31 elements when memory allows, the non-finite rule, a state_dict round trip
    and one training step (docs/CHECK.md says what each row means). Exit status 1 if any row
    fails, with the one line to report.

    \b
    Examples:
      merit check                          # this machine's GPU, else its CPU
      merit check --device cpu --quick     # the short form merit train runs
      merit check --json > check.json
    """
    from merit_core.check import run_check
    from merit_core.devices import resolve_device

    try:
        report = run_check(resolve_device(device), quick=quick, backends=list(backends) or None)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=2))
        if not report.ok:
            fail(report.failure() or "", code=1)
    else:
        render(report)
    if not report.ok:
        sys.exit(1)
