"""`merit eval RUN --checkpoints all` (or --all-steps) / `--checkpoints N,M`: one row per step beside the recorded max logit, a
figure, and each step's result with its recorded logit in the JSON."""

import json
import shutil

from click.testing import CliRunner

from merit_cli.main import cli
from merit_core.evaluation.results import format_value
from tests.eval.test_eval import world  # noqa: F401  (the module fixture: a run folder and local tasks)

TASK = "harbour_lambada"


def _run_with_logits(world, tmp_path):  # noqa: F811
    run = tmp_path / "run"
    shutil.copytree(world["run"], run)
    (run / "metrics.jsonl").write_text(
        "".join(
            json.dumps(r) + "\n" for r in ({"step": 5, "max_attention_logit": [1.5, 2.5]}, {"step": 12, "loss": 3.0})
        )
    )
    state = json.loads((run / "step_12" / "trainer_state.json").read_text())
    (run / "step_12" / "trainer_state.json").write_text(json.dumps({**state, "max_attention_logit": [4.0, 3.0]}))
    return run


def _eval(*args):
    return CliRunner().invoke(cli, ["eval", *args], catch_exceptions=False)


def test_all_steps_prints_one_row_per_step_with_recorded_logit(world, tmp_path):  # noqa: F811
    run = _run_with_logits(world, tmp_path)
    out, fig = tmp_path / "steps.json", tmp_path / "steps.png"
    common = [
        "--tasks",
        TASK,
        "--include-path",
        str(world["tasks"]),
        "--trust-task-code",
        "--batch-size",
        "4",
        "--bootstrap-iters",
        "0",
    ]
    res = _eval(str(run), "--all-steps", *common, "--limit", "4", "-o", str(out), "--plot", str(fig))
    assert res.exit_code == 0, res.output
    assert f"{run}: took step_5, step_12 (--checkpoints all)" in res.output  # which checkpoints, said once
    table = res.output[res.output.index("scores over training steps") :]
    # merit_cli.render.print_table folds the columns that do not fit into more tables, each led by the
    # step column: a step's cells are those of its rows in every part, in order
    parts = [[line for line in part.splitlines() if line.startswith("│")] for part in table.split("└")]
    cells: dict[str, list[str]] = {}
    for part in parts:
        for line in part:
            step, *rest = [cell.strip() for cell in line.split("│")[1:-1]]
            cells.setdefault(step, []).extend(rest)
    assert list(cells) == ["5", "12"]
    assert [float(cells[s][0]) for s in cells] == [2.5, 4.0]  # metrics.jsonl at 5, trainer_state.json at 12
    assert fig.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = json.loads(out.read_text())["checkpoints"]
    assert [c["meta"]["step"] for c in saved] == [5, 12]
    assert [c["meta"]["recorded_max_attention_logit"] for c in saved] == [2.5, 4.0]
    for step, c in zip(cells, saved):  # the table's scores are the JSON's
        assert cells[step][1:] == [format_value(c["results"][TASK][k]) for k in ("perplexity,none", "acc,none")]


def test_steps_choose_those_checkpoints(world):  # noqa: F811
    import pytest

    from merit_core.checkpoint import ALL, LATEST, parse_selection
    from merit_core.errors import ConfigError
    from merit_core.evaluation.steps import eval_targets

    run = world["run"]

    def picked(selection):
        (taken,) = eval_targets([str(run)], selection).taken
        return list(taken.picked)

    assert picked(parse_selection("12, 12")) == [(12, run / "step_12")]
    assert [s for s, _ in picked(ALL)] == [5, 12]  # step_20.tmp is no checkpoint
    assert [s for s, _ in picked(LATEST)] == [12]
    # what is evaluated and what is said come from one resolution: a run folder's steps in its place
    targets = eval_targets([str(run), str(run / "step_5"), "gpt2"], LATEST)
    assert targets.checkpoints == (str(run / "step_12"), str(run / "step_5"), "gpt2")
    assert targets.lines() == [f"{run}: took step_12 (--checkpoints latest)"]
    assert eval_targets([str(run)], ALL).checkpoints == (str(run / "step_5"), str(run / "step_12"))
    with pytest.raises(ConfigError, match="--checkpoints all takes a `merit train` run folder"):
        eval_targets([str(run / "step_5")], ALL)


def test_eval_of_a_run_folder_evaluates_the_checkpoint_it_says_it_took(world, monkeypatch):  # noqa: F811
    from merit_cli import eval_cmd
    from merit_core.evaluation.results import CheckpointResult

    calls = []

    def evaluate(checkpoints, settings, progress=None, quiet=True, note=None):
        calls.append(list(checkpoints))
        return [CheckpointResult(path=c, label=c, results={}, meta={}) for c in checkpoints]

    monkeypatch.setattr(eval_cmd, "evaluate_checkpoints", evaluate)
    run = world["run"]
    res = _eval(str(run), "--tasks", TASK, "--include-path", str(world["tasks"]), "--trust-task-code")
    assert res.exit_code == 0, res.output
    assert calls == [[str(run / "step_12")]]
    assert f"{run}: took step_12 (--checkpoints latest)" in res.output


def test_steps_input_errors_are_one_line(world, tmp_path):  # noqa: F811
    run = world["run"]
    common = ["--tasks", TASK, "--include-path", str(world["tasks"]), "--trust-task-code"]
    for args, words in (
        ([str(run), "--steps", "7"], "has no checkpoint at step 7; it has step_5, step_12"),
        ([str(run), "--steps", "x"], "give latest, all or step numbers"),
        ([str(run), "--steps", "²"], "give latest, all or step numbers"),
        ([str(run / "step_5"), "--all-steps"], "run folder"),
        ([str(run / "step_5"), "--steps", "all"], "run folder"),
        ([str(run), str(run), "--all-steps"], "one `merit train` run folder"),
        ([str(run), "--all-steps", "--steps", "5"], "--all-steps is --checkpoints all"),
        ([str(run), "--plot", str(tmp_path / "a.png")], "with --checkpoints all or --checkpoints N,M"),
    ):
        res = CliRunner().invoke(cli, ["eval", *args, *common])
        assert res.exit_code == 2, (args, res.output)
        assert words in res.output, (args, res.output)
