"""Two reliability families of `merit eval`, case by case through the command line (tests/family_checks.py
says what every case checks: success or exit 2 in at most two lines, and a decoy folder of the user's
byte-identical afterwards).

Results file: two `merit eval -o DIR/` in the same second never write one file. The name
`results-<date>T<time>.json` is taken as the file is written (merit_core/evaluation/results.py), so a
second eval that finished meanwhile, a user's file, a link or a folder at the name each keep theirs.

lm-eval's layout: `--output_path DIR` never writes through a link planted at `DIR/<model>/`
(merit_core/evaluation/lm_eval_output.py). `<model>` is lm-eval's folder for the `pretrained=` value as
typed, `lm_eval.utils.sanitize_model_name` of it: `models/a` is `models__a`.
"""

from __future__ import annotations

import datetime
import json
import os
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from merit_cli.main import cli
from tests.eval.local_tasks import HARBOUR_TEXT, eval_gpt2, set_offline, train_tokenizer, write_local_tasks
from tests.family_checks import Decoy, assert_ok, assert_refused, lines_of, tree_state

NOW = datetime.datetime(2026, 1, 2, 3, 4, 5, 678901)
STAMP = "results-20260102T030405"  # merit's name for a results file written at NOW
LM_STAMP = "2026-01-02T03-04-05.678901"  # lm-eval's date in its file names at NOW
A, B = "models/a", "models/b"  # two checkpoints, typed relative to the world's folder
MODEL_FOLDER = "models__a"  # lm-eval's DIR/<model> for A


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Offline HF env, two tiny GPT-2 model folders sharing a BPE, and the local lm-eval tasks."""
    import torch

    root = tmp_path_factory.mktemp("evalfam")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: one thread is fastest
    with pytest.MonkeyPatch.context() as mp:
        set_offline(mp, root)
        corpus = root / "harbour.txt"
        corpus.write_text(HARBOUR_TEXT * 8, encoding="utf-8")
        tokenizer = train_tokenizer(corpus)
        for name, seed in ((A, 0), (B, 1)):
            eval_gpt2(seed).save_pretrained(root / name)
            tokenizer.save_pretrained(root / name)
        tasks = write_local_tasks(root / "tasks")
        yield {"root": root, "tasks": tasks}
    torch.set_num_threads(threads)


@pytest.fixture
def at_world(world, monkeypatch):
    """In the world's folder (checkpoints typed as models/a, as a user types them), merit's and lm-eval's
    clocks fixed at NOW: every eval of a case finishes in the same second."""
    from lm_eval.loggers import evaluation_tracker

    from merit_core.evaluation import results

    class Fixed(datetime.datetime):
        @classmethod
        def now(cls, tz: Any = None) -> Fixed:
            return cls.combine(NOW.date(), NOW.time(), tz)

    monkeypatch.chdir(world["root"])
    monkeypatch.setattr(results, "datetime", types.SimpleNamespace(datetime=Fixed))
    monkeypatch.setattr(evaluation_tracker, "datetime", Fixed)
    return world


def _eval(world, ckpt: str, *args: str):
    """A whole `merit eval` of one local task on two documents, in this process."""
    common = ["--tasks", "harbour_lambada", "--include-path", str(world["tasks"]), "--trust-task-code"]
    common += ["--limit", "2", "--bootstrap-iters", "0", "--device", "cpu", "--batch-size", "2"]
    return CliRunner().invoke(cli, ["eval", ckpt, *common, *args])


def _record_of(path: Path) -> str:
    """The checkpoint a results file's one record names, relative to the world's folder."""
    (record,) = json.loads(path.read_text())["checkpoints"]
    return os.path.relpath(record["path"])


def _users_files(folder: Path) -> None:
    """A user's own files in the folder merit writes into."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "mine.txt").write_text("the user's, not merit's\n")
    (folder / "results.json").write_text('{"theirs": true}\n')


def _unchanged_but(before: dict, after: dict, added: set[str]) -> None:
    """The folder's entries as they were, but for `added` (what merit is expected to write)."""
    changed = sorted(k for k in set(before) | set(after) if k not in added and before.get(k) != after.get(k))
    assert not changed, f"the output folder's own entries changed: {changed}"
    assert added <= set(after), (added, sorted(after))


# ------------------------------------------------------------ the results file's name is taken when written
@dataclass(frozen=True)
class NameCase:
    plant: Callable[[Path, Decoy], None]  # what is in DIR before the eval(s) run
    expect: dict[str, str]  # file name in DIR -> the checkpoint its record names
    runs: str = "one"  # "one" eval of A, two run "after" one another (A then B), or B "inside" A's write
    output: str = ""  # -o DIR/<output>: "" for the folder itself


def _nothing(out: Path, decoy: Decoy) -> None:
    pass


NAME_CASES = {
    "two evals in one second, one after the other": NameCase(
        _nothing, {f"{STAMP}.json": A, f"{STAMP}-2.json": B}, runs="after"
    ),
    "a second whole eval runs while the first one's write is held": NameCase(
        _nothing, {f"{STAMP}.json": B, f"{STAMP}-2.json": A}, runs="inside"
    ),
    "the name is a user's file": NameCase(
        lambda out, decoy: (out / f"{STAMP}.json").write_text('{"my": "earlier results"}\n'),
        {f"{STAMP}-2.json": A},
    ),
    "the name is a link to the user's file": NameCase(
        lambda out, decoy: os.symlink(decoy.root / "results.json", out / f"{STAMP}.json"), {f"{STAMP}-2.json": A}
    ),
    "the name is a link to the user's folder": NameCase(
        lambda out, decoy: os.symlink(decoy.root, out / f"{STAMP}.json"), {f"{STAMP}-2.json": A}
    ),
    "the name and the next are links to nothing": NameCase(
        lambda out, decoy: [os.symlink(out / f"gone{n}", out / f"{STAMP}{n}.json") for n in ("", "-2")],
        {f"{STAMP}-3.json": A},
    ),
    "the name is a folder of the user's": NameCase(
        lambda out, decoy: _users_files(out / f"{STAMP}.json"), {f"{STAMP}-2.json": A}
    ),
    # -o FILE.json names the file itself: merit writes it there, replacing it whole (atomically); a
    # link there is replaced, its target never written through
    "-o FILE.json names the user's earlier file": NameCase(
        lambda out, decoy: (out / "scores.json").write_text('{"earlier": true}\n'),
        {"scores.json": A},
        output="scores.json",
    ),
    "-o FILE.json is a link to the user's file": NameCase(
        lambda out, decoy: os.symlink(decoy.root / "results.json", out / "scores.json"),
        {"scores.json": A},
        output="scores.json",
    ),
}


@pytest.mark.parametrize("case", NAME_CASES.values(), ids=NAME_CASES.keys())
def test_evals_into_one_folder_never_share_or_replace_a_file(case, at_world, tmp_path, monkeypatch):
    from merit_cli import eval_cmd

    decoy = Decoy.plant(tmp_path)
    out = tmp_path / "out"
    _users_files(out)
    case.plant(out, decoy)
    before = tree_state(out)
    target = f"{out}{os.sep}{case.output}"  # DIR/ as a user types it, or DIR/FILE.json
    inner: list[Any] = []
    if case.runs == "inside":  # B starts, scores and writes while A holds its write
        real = eval_cmd.write_results_json

        def held(path, records, now=None):
            if not inner:  # A's write (B's own write, inside, goes straight through)
                inner.append(None)
                inner[0] = _eval(at_world, B, "-o", target)
                assert_ok(inner[0])
                assert sorted(p.name for p in out.glob("results-*")) == [f"{STAMP}.json"]  # B's, written
            return real(path, records, now)

        monkeypatch.setattr(eval_cmd, "write_results_json", held)
    results = [_eval(at_world, A, "-o", target)]
    if case.runs == "after":
        results.append(_eval(at_world, B, "-o", target))
    for result in results + inner:
        assert_ok(result)
    assert len(inner) == (case.runs == "inside")
    decoy.assert_unchanged()
    _unchanged_but(before, tree_state(out), set(case.expect))
    for name, ckpt in case.expect.items():
        assert not (out / name).is_symlink() and (out / name).is_file(), name
        assert _record_of(out / name) == ckpt, name
    wrote = [line for result in results + inner for line in lines_of(result) if line.startswith("wrote ")]
    assert sorted(wrote) == sorted(f"wrote {out / name}" for name in case.expect)
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temp file left behind


# ------------------------------------------------------------ lm-eval's DIR/<model>/ is never written through
@dataclass(frozen=True)
class LinkCase:
    plant: Callable[[Path, Decoy], None]  # DIR given as --output_path, before the eval
    says: tuple[str, ...] = ()  # refused (exit 2) saying these; () when the eval succeeds
    args: tuple[str, ...] = ()
    added: frozenset[str] = field(default_factory=frozenset)  # what DIR gains (on success, or at a late refusal)
    late: bool = False  # refused as the file is written (the scores are shown first), not before scoring


def _model_folder(out: Path) -> Path:
    (out / MODEL_FOLDER).mkdir(parents=True)
    return out / MODEL_FOLDER


def _users_model_folder(out: Path, decoy: Decoy) -> None:
    _users_files(_model_folder(out))
    (out / MODEL_FOLDER / "results_2025-12-31T23-59-59.000001.json").write_text('{"an": "earlier run"}\n')


def _users_folder_linked(out: Path, decoy: Decoy) -> None:
    _users_files(out.parent / "linked-evals")
    os.symlink(out.parent / "linked-evals", out)


def _link(where: str, to: Callable[[Path, Decoy], Path]) -> Callable[[Path, Decoy], None]:
    def plant(out: Path, decoy: Decoy) -> None:
        if "/" in where:
            _model_folder(out)
        else:
            out.mkdir()
        os.symlink(to(out, decoy), out / where)

    return plant


ALL_SAMPLES = ("--log_samples",)
MERIT_JSON = f"{STAMP}.json"  # merit's own results file, written into DIR too

LINK_CASES = {
    "DIR/<model> is a link to the user's folder": LinkCase(
        _link(MODEL_FOLDER, lambda out, decoy: decoy.root), ("models__a is a symbolic link", "remove it")
    ),
    "DIR/<model> is a link to the user's file": LinkCase(
        _link(MODEL_FOLDER, lambda out, decoy: decoy.root / "notes.txt"), ("models__a is a symbolic link",)
    ),
    "DIR/<model> is a link to nothing": LinkCase(
        _link(MODEL_FOLDER, lambda out, decoy: out.parent / "gone"), ("models__a is a symbolic link",)
    ),
    "DIR/<model> is a user's file": LinkCase(
        lambda out, decoy: (out.mkdir(), (out / MODEL_FOLDER).write_text("mine")), ("models__a", "not a folder")
    ),
    "DIR is a link to nothing": LinkCase(
        lambda out, decoy: os.symlink(out.parent / "gone", out), ("symbolic link to a missing target",)
    ),
    "DIR/<model>/results_<time>.json is a link to the user's file": LinkCase(
        _link(f"{MODEL_FOLDER}/results_{LM_STAMP}.json", lambda out, decoy: decoy.root / "results.json"),
        ("is a symbolic link", "remove it"),
        added=frozenset({MERIT_JSON}),
        late=True,
    ),
    "DIR/<model>/results_<time>.json is a user's file": LinkCase(
        lambda out, decoy: (_model_folder(out) / f"results_{LM_STAMP}.json").write_text('{"mine": 1}\n'),
        ("already exists", "remove it"),
        added=frozenset({MERIT_JSON}),
        late=True,
    ),
    "DIR/<model>/samples_<task>_<time>.jsonl is a link to the user's file": LinkCase(
        _link(f"{MODEL_FOLDER}/samples_harbour_lambada_{LM_STAMP}.jsonl", lambda out, decoy: decoy.root / "notes.txt"),
        ("is a symbolic link", "remove it"),
        args=ALL_SAMPLES,
        added=frozenset({MERIT_JSON}),
        late=True,
    ),
    "DIR/<model>/ is the user's folder with their files": LinkCase(
        _users_model_folder,
        args=ALL_SAMPLES,
        added=frozenset(
            {
                MERIT_JSON,
                f"{MODEL_FOLDER}/results_{LM_STAMP}.json",
                f"{MODEL_FOLDER}/samples_harbour_lambada_{LM_STAMP}.jsonl",
            }
        ),
    ),
    "DIR is a link to the user's folder": LinkCase(  # written into, as `-o DIR` is
        _users_folder_linked,
        added=frozenset({MERIT_JSON, MODEL_FOLDER, f"{MODEL_FOLDER}/results_{LM_STAMP}.json"}),
    ),
}


@pytest.mark.parametrize("case", LINK_CASES.values(), ids=LINK_CASES.keys())
def test_output_path_never_writes_through_a_planted_link(case, at_world, tmp_path):
    decoy = Decoy.plant(tmp_path)
    out = tmp_path / "evals"
    case.plant(out, decoy)
    seen = out.resolve()  # a DIR that links to a folder: the folder it names
    before = tree_state(seen) if seen.is_dir() else {}
    result = _eval(at_world, A, "--output_path", str(out), *case.args)
    if not case.says:
        assert_ok(result)
    elif not case.late:
        assert_refused(result, *case.says)
    else:  # refused as the file is written: the scores table stays on screen, then the refusal
        table, _, tail = result.output.rpartition("┘\n")
        assert "zero-shot results" in table, result.output
        assert_refused(types.SimpleNamespace(output=tail, exit_code=result.exit_code, exception=result.exception))
        assert_refused(types.SimpleNamespace(output=tail, exit_code=2, exception=None), *case.says)
        assert f"wrote {out / MERIT_JSON}" in " ".join(tail.split())
    decoy.assert_unchanged()
    _unchanged_but(before, tree_state(seen) if seen.is_dir() else {}, set(case.added))
    assert not (tmp_path / "gone").exists()  # a link's missing target is not made either
    for name in case.added:
        if name.startswith(f"{MODEL_FOLDER}/results_"):  # lm-eval's own file for this run
            data = json.loads((seen / name).read_text())
            assert data["model_name"] == A and data["config"]["model_args"] == {"pretrained": A}
    if seen.is_dir():
        assert not [p.name for p in seen.rglob(".*")]  # no staging folder or temp file left
