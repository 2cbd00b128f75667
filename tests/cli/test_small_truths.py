"""What the commands say of themselves is true: skipped check rows are not "ok", every shipped config
states its cost once, `merit --help` names the families README lists, the run summary's time says
what it counts, and a smoke comparison's "no verdict" line says why once."""

import re
from types import SimpleNamespace

from merit_cli.train_cmd import run_time
from tests.cli_runs import invoke

FAMILIES = ("GPT-2", "Llama", "Qwen")


def test_check_counts_skipped_rows_apart():
    """In `merit check` and `python -m merit_core.check` alike: a backend this machine lacks is a
    skipped row, not an ok one."""
    from merit_core.check import table_lines
    from merit_core.optim.merit.verify import SKIPPED, CheckReport, Row

    rows = [Row("step", b, "float32", "(6, 5)", 0.0, 1e-6, True) for b in ("reference", "cpu")]
    rows.append(Row("step", "triton", "", "", None, None, True, f"{SKIPPED}: triton is not installed"))
    assert [r.skipped for r in rows] == [False, False, True]
    report = CheckReport("cpu", {"torch": "x"}, rows, 1.0)
    assert report.passed_line() == "2 rows ok, 1 skipped (not on this machine)"
    assert CheckReport("cpu", {}, rows[:2]).passed_line() == "all 2 rows ok"
    lines = list(table_lines(report))
    assert lines[-1] == "2 rows ok, 1 skipped (not on this machine) in 1.0 s"
    assert "skipped" in lines[-2] and " ok " not in lines[-2]


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
