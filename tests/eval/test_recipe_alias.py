"""CONTRIBUTING.md's "add an eval alias" recipe, followed once: one TaskAlias in ALIASES is listed by
`merit eval --list-tasks`, expanded by the task resolver and evaluated by `merit eval --tasks ALIAS`."""

import json

import pytest
from click.testing import CliRunner

from merit_cli.main import cli
from merit_core.evaluation.tasks import ALIASES, TaskAlias, expand_aliases, resolve_tasks
from tests.eval.local_tasks import (
    HARBOUR_TEXT,
    LOCAL_TASKS,
    eval_gpt2,
    set_offline,
    train_tokenizer,
    write_local_tasks,
)


@pytest.fixture(scope="module")
def harbour(tmp_path_factory):
    """An untrained tiny GPT-2 checkpoint with its tokenizer, and two local lm-eval tasks."""
    root = tmp_path_factory.mktemp("alias")
    with pytest.MonkeyPatch.context() as mp:
        set_offline(mp, root)
        corpus = root / "harbour.txt"
        corpus.write_text(HARBOUR_TEXT * 8, encoding="utf-8")
        checkpoint = root / "model"
        eval_gpt2(seed=0).save_pretrained(checkpoint)
        train_tokenizer(corpus).save_pretrained(checkpoint)
        tasks = write_local_tasks(root / "tasks")
        yield {"checkpoint": checkpoint, "tasks": tasks}


@pytest.fixture
def harbour_alias(monkeypatch):
    """The recipe's one edit, ALIASES in merit_core/evaluation/tasks.py, for one test."""
    alias = TaskAlias("harbour", tuple(LOCAL_TASKS), "the harbour town: last-word prediction and page perplexity")
    monkeypatch.setitem(ALIASES, alias.name, alias)
    return alias


def test_alias_is_listed_expanded_and_evaluated(harbour, harbour_alias, tmp_path):
    assert expand_aliases(["Harbour", "harbour_wiki"]) == LOCAL_TASKS  # case-insensitive, no duplicates
    resolved = resolve_tasks("harbour", include_path=harbour["tasks"])
    assert resolved.names == LOCAL_TASKS and resolved.index == "include-path"

    listed = CliRunner().invoke(cli, ["eval", "--list-tasks"], catch_exceptions=False)
    assert listed.exit_code == 0 and "harbour" in listed.output and "page perplexity" in listed.output

    out = tmp_path / "eval.json"
    args = ["eval", str(harbour["checkpoint"]), "--tasks", "harbour", "--include-path", str(harbour["tasks"])]
    args += [
        "--trust-task-code",
        "--limit",
        "2",
        "--batch-size",
        "2",
        "--bootstrap-iters",
        "0",
        "--device",
        "cpu",
        "-o",
        str(out),
    ]
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    (checkpoint,) = json.loads(out.read_text())["checkpoints"]
    assert sorted(checkpoint["results"]) == LOCAL_TASKS
    assert checkpoint["meta"]["eval"]["tasks"] == LOCAL_TASKS  # the alias is recorded as what it stands for
    assert checkpoint["results"]["harbour_lambada"]["acc,none"] >= 0.0


def test_without_the_alias_the_name_is_unknown(harbour):
    from merit_core.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown task 'harbour'"):
        resolve_tasks("harbour", include_path=harbour["tasks"])
