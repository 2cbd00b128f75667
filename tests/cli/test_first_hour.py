"""The small things a new user meets in the first hour: whole config names, data notes, a bar that
moves every step, an ETA for all runs, tokens/s labels, inspect's notes said once, the steps a run
has, examples in every --help, and the wording of a stop."""

from __future__ import annotations

import io
import json
import re

import pytest
from click.testing import CliRunner
from rich.console import Console

from merit_cli.main import COMMANDS, cli, stopped
from merit_cli.render import configs_table, plural
from merit_core.data import load_meta
from merit_core.data.meta import SMALL_VAL_TOKENS, data_notes

TINY = {"batch_size": 4, "micro_batch_size": 4, "seq_len": 16, "eval_batches": 1}


def test_list_configs_keeps_every_name_whole_at_80_columns():
    from merit_core.config_catalog import shipped_configs

    out = Console(file=io.StringIO(), width=80, force_terminal=False)
    out.print(configs_table(shipped_configs()))
    text = out.file.getvalue()
    assert max(map(len, text.splitlines())) <= 80
    for c in shipped_configs():
        assert re.search(rf"merit {c.command} {re.escape(c.name)}(\s|$)", text), c.name


def test_data_notes_name_a_small_validation_split_and_repeated_epochs(data_dir):
    meta = load_meta(data_dir)
    assert data_notes(meta) == []  # 5k held-out tokens, and no run to count epochs for
    (epochs,) = data_notes(meta, planned_tokens=3 * meta.train_tokens)
    assert "3.0 epochs" in epochs and f"{meta.train_tokens:,} training tokens" in epochs
    small = type(meta)(**{**meta.__dict__, "val_tokens": SMALL_VAL_TOKENS - 1})
    (val,) = data_notes(small, planned_tokens=meta.train_tokens)
    assert f"only {SMALL_VAL_TOKENS - 1:,} validation tokens" in val and "--val-fraction" in val


def test_train_bar_moves_every_step_and_labels_its_tokens_per_s(model_cfg, data_dir, tmp_path, monkeypatch):
    from merit_cli.train_cmd import RichTrainReport
    from merit_core.train import training_run
    from merit_core.train.config import load_config
    from merit_core.train.training_run import run_training

    seen = []

    class Report(RichTrainReport):
        def on_step(self, step):
            super().on_step(step)
            seen.append((step, self.progress.tasks[0].completed))

        def on_log(self, record):
            seen.append(("log", record["step"]))
            super().on_log(record)

        def on_note(self, message):
            seen.append(("note", message))

    monkeypatch.setattr(training_run, "data_notes", lambda meta, planned: [f"data note: {planned} tokens planned"])
    report = Report()
    report.out = Console(file=io.StringIO(), width=100, force_terminal=True)
    report.plain = False
    values = {**TINY, "model": str(model_cfg), "data": str(data_dir), "out": str(tmp_path / "run")}
    values.update(steps=3, log_every=100, eval_every=0, tokens=None)
    run_training(load_config(values={**values, "optimizer": "adamw"}), report)
    assert [s for s in seen if s[0] != "note"] == [(1, 1), (2, 2), (3, 3), ("log", 3)]  # logs only at the end
    assert ("note", "data note: 192 tokens planned") in seen  # 3 steps x 4 x 16 tokens: the run notes its data
    text = report.out.file.getvalue()
    assert "train tok/s" in text and "wall tokens/s" in text and "evals and checkpoints included" in text


def test_compare_all_runs_bar_has_an_eta():
    from merit_cli.compare_cmd import compare_progress

    now = [100.0]
    out = Console(file=io.StringIO(), width=160, force_terminal=True)
    progress = compare_progress(out, clock=lambda: now[0])
    task = progress.add_task("all runs", total=4, completed=0, info="")
    assert "eta --:--" in _row(progress)
    now[0] += 10.0
    progress.advance(task)
    assert "eta 0:30" in _row(progress)  # 1 run in 10 s, 3 left


def _row(progress) -> str:
    out = Console(file=io.StringIO(), width=160)
    out.print(progress.make_tasks_table(progress.tasks))
    return out.file.getvalue()


@pytest.fixture(scope="module")
def two_step_run(model_cfg, data_dir, tmp_path_factory):
    run = tmp_path_factory.mktemp("two") / "run"
    sets = {**TINY, "eval_every": 1, "save_every": 1}
    args = ["train", "--model", str(model_cfg), "--data", str(data_dir), "--out", str(run), "--steps", "2"]
    result = CliRunner().invoke(cli, args + [a for k, v in sets.items() for a in ("--set", f"{k}={v}")])
    assert result.exit_code == 0, result.output
    assert "2 steps on" in result.output
    return run


def test_inspect_says_the_training_logit_note_once_and_shows_the_logit_bound(two_step_run, tmp_path):
    out = tmp_path / "stats.json"
    args = ["inspect", str(two_step_run), "--seq-len", "16", "--no-weights", "-o", str(out)]
    result = CliRunner().invoke(cli, args, terminal_width=200)
    assert result.exit_code == 0, result.output
    per_checkpoint = [c for c in json.loads(out.read_text())["checkpoints"] if c["notes"]]
    assert len(per_checkpoint) == 2  # each checkpoint has the note in the JSON ...
    assert result.output.count("training recorded max attention logit") == 1  # ... the table says it once
    assert "likewise at 1 other checkpoint;" in result.output
    assert "logit bound" in result.output.split("per checkpoint")[1]
    assert result.output.count("probe builtin") == 1


@pytest.mark.parametrize("command", ["eval", "inspect"])
def test_a_missing_step_lists_the_steps_the_run_has(two_step_run, command):
    args = [command, str(two_step_run / "step_30")] + (["--tasks", "builtin"] if command == "eval" else [])
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2 and f"{two_step_run} has step_1, step_2" in result.output, result.output


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_every_help_has_examples(command):
    result = CliRunner().invoke(cli, [command, "--help"] if command else ["--help"])
    assert result.exit_code == 0 and "Examples:" in result.output
    assert re.search(r"^\s+merit " + (command or r"\w+"), result.output, re.MULTILINE)


def test_stop_wording(capsys):
    with pytest.raises(SystemExit) as exit_info:
        stopped("stopped by SIGINT after step 1: checkpoint runs/a/step_1", 130)
    assert exit_info.value.code == 130
    err = capsys.readouterr().err
    assert "stopped by SIGINT after step 1" in err and "stopped: stopped" not in err
    assert (plural(1, "step"), plural(5, "step")) == ("1 step", "5 steps")
