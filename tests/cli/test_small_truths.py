"""What the commands say of themselves is true: skipped check rows are not "ok", every shipped config
states its cost once, `merit --help` names the families README lists, the run summary's time says
what it counts, and a smoke comparison's "no verdict" line says why once."""

import re
from types import SimpleNamespace

from merit_cli.check_cmd import skipped, verdict_line
from merit_cli.train_cmd import run_time
from tests.cli_runs import invoke

FAMILIES = ("GPT-2", "Llama", "Qwen")


def _row(note: str = "") -> SimpleNamespace:
    return SimpleNamespace(note=note, ok=True)


def test_check_counts_skipped_rows_apart():
    rows = [_row(), _row(), _row("skipped: triton is not installed")]
    assert [skipped(r) for r in rows] == [False, False, True]
    assert verdict_line(SimpleNamespace(rows=rows)) == "2 rows ok, 1 skipped (not on this machine)"
    assert verdict_line(SimpleNamespace(rows=rows[:2])) == "all 2 rows ok"


def test_every_shipped_config_states_one_cost():
    from merit_core.config_catalog import shipped_configs

    duration = re.compile(r"\b\d+(\.\d+)?\s*(min|minutes|h|hours|s)\b|H100-hours|GPU-hours")
    for config in shipped_configs():
        assert config.cost and duration.search(config.cost), (config.name, config.cost)
        assert not duration.search(config.summary), (config.name, config.summary)  # the cost column alone says it


def test_merit_help_names_the_families():
    text = invoke(["--help"]).output
    line = next(l for l in text.splitlines() if l.strip().startswith("train"))
    assert all(f in line for f in FAMILIES) and "GPT-2 or Llama" not in text


def test_the_run_summary_time_says_what_it_counts():
    assert run_time(12.0, 12.4) == "12s"
    assert run_time(13.0, 37.0) == "13s training, 37s in all (data preparation and start-up included)"


def test_no_verdict_is_said_once():
    from merit_cli.compare_cmd import no_verdict_line

    quick = SimpleNamespace(settings=SimpleNamespace(quick=True), best=[])
    line = no_verdict_line(quick)
    assert line is not None and line.count("no verdict") == 1 and line.count("smoke run") == 1, line
