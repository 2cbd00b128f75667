"""The reliability family of `merit compare` whose run folder is deleted or spoiled mid-grid, through the
CLI: the run is trained again (or, when it stays gone, reported 'missing', never 'diverged'), compare exits
0 with REPORT.md and compare.png from what finished, and a decoy folder of the user's is byte-identical.

The grid is one optimizer, one batch and two lrs at two steps each. The spoiling happens when the second
run starts training, to the first (finished) run's folder; a 'persistent' spoiling is done again after
that run trained a second time."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner

from merit_cli.main import cli
from merit_core.compare.runner import STATUS_FILE
from merit_core.metrics import METRICS_FILE
from merit_core.train import training_run
from tests.family_checks import Decoy, assert_ok, assert_refused

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TRAIN = dict(eval_batches=1, eval_batch_size=4, eval_every=2, log_every=1, save_every=2, keep_checkpoints=0)
FIRST, SECOND = "adamw-b4-lr0.001", "adamw-b4-lr0.01"


def compare_args(model_cfg: Path, data_dir: Path, out: Path) -> list[str]:
    args = ["compare", "--model", str(model_cfg), "--data", str(data_dir), "--seq-len", "32"]
    args += ["--optimizers", "adamw", "--batch-sizes", "4", "--lrs", "1e-3,1e-2", "--tokens", "256"]
    args += ["--jobs", "1", "--device", "cpu", "--best-seeds", "1", "--no-environment-check", "--out", str(out)]
    return args + [a for k, v in TRAIN.items() for a in ("--set", f"{k}={v}")]


# -- spoilings of a finished run's folder ----------------------------------------------------------------
def removed(run: Path, decoy: Decoy) -> None:
    shutil.rmtree(run)


def plain_file(run: Path, decoy: Decoy) -> None:
    shutil.rmtree(run)
    run.write_text("not a run folder\n")


def link_to_decoy(run: Path, decoy: Decoy) -> None:
    shutil.rmtree(run)
    os.symlink(decoy.root, run)


def checkpoints_removed(run: Path, decoy: Decoy) -> None:
    for step in run.glob("step_*"):
        shutil.rmtree(step)


def metrics_emptied(run: Path, decoy: Decoy) -> None:
    (run / METRICS_FILE).write_bytes(b"")


def metrics_cut(run: Path, decoy: Decoy) -> None:
    """Its first line kept: the final evaluation lost."""
    lines = (run / METRICS_FILE).read_bytes().splitlines(keepends=True)
    (run / METRICS_FILE).write_bytes(lines[0])


def metrics_removed(run: Path, decoy: Decoy) -> None:
    (run / METRICS_FILE).unlink()


def metrics_foreign(run: Path, decoy: Decoy) -> None:
    """Lines merit never wrote: a record without a step, then a list."""
    (run / METRICS_FILE).write_text('{"mine": 1}\n[1, 2]\n')


def metrics_stepless(run: Path, decoy: Decoy) -> None:
    (run / METRICS_FILE).write_text('{"mine": 1}\n{"val_loss": 1.0}\n')


def marker_garbage(run: Path, decoy: Decoy) -> None:
    (run / STATUS_FILE).write_bytes(b"\xff\xfe not a marker")


@dataclass(frozen=True)
class Case:
    name: str
    spoil: Callable[[Path, Decoy], None]
    again: bool = False  # spoiled again after it trained a second time
    expect: str = "finished"  # the spoiled run's status in summary.json
    why: str = ""  # in its message when it is 'missing'


CASES = [
    Case("folder removed", removed),
    Case("folder replaced by a plain file", plain_file, expect="missing", why="replaced by something"),
    Case("folder replaced by a link to the decoy", link_to_decoy, expect="missing", why="symbolic link"),
    Case("checkpoints removed, metrics kept", checkpoints_removed),
    Case("metrics.jsonl emptied", metrics_emptied, expect="missing", why="holds no metrics"),
    Case("metrics.jsonl cut before the final evaluation", metrics_cut, expect="missing", why="at its last step"),
    Case("metrics.jsonl removed", metrics_removed, expect="missing", why="holds no metrics"),
    Case("metrics.jsonl holds lines merit never wrote", metrics_foreign, expect="missing", why="not one merit"),
    Case("metrics.jsonl holds records without a step", metrics_stepless, expect="missing", why="at its last step"),
    Case("compare_status.json garbage", marker_garbage, expect="missing", why="not a comparison run marker"),
    Case("folder removed again after it trained again", removed, again=True, expect="missing", why="no metrics"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_a_run_folder_spoiled_mid_grid(case, tmp_path, model_cfg, data_dir, monkeypatch):
    decoy = Decoy.plant(tmp_path)
    out = tmp_path / "cmp"
    first = out / "runs" / FIRST
    real = training_run.run_training
    started: list[str] = []

    def run_training(config, callbacks=None):
        name = Path(config.out).name
        started.append(name)
        if name == SECOND:
            case.spoil(first, decoy)
        result = real(config, callbacks)
        if case.again and name == FIRST and started.count(FIRST) == 2:
            case.spoil(first, decoy)
        return result

    monkeypatch.setattr(training_run, "run_training", run_training)
    result = CliRunner().invoke(cli, compare_args(model_cfg, data_dir, out))
    assert_ok(result)
    decoy.assert_unchanged()
    assert (out / "REPORT.md").is_file() and (out / "compare.png").read_bytes()[:8] == PNG_MAGIC
    summary = json.loads((out / "summary.json").read_text())
    status = {r["name"]: r["status"] for r in summary["runs"]}
    assert "diverged" not in status.values() and "diverged" not in {c["status"] for c in summary["cells"]}
    assert status == {FIRST: case.expect, SECOND: "finished"}, (status, started)
    report = (out / "REPORT.md").read_text()
    (row,) = [line for line in report.splitlines() if line.startswith("| adamw | 4 | 0.001 |")]
    assert row.endswith(f"| 0 of 1 | {case.expect} |") and "| diverged |" not in report, row  # no diverged seed
    (spoiled,) = [r for r in summary["runs"] if r["name"] == FIRST]
    # trained, spoiled, trained again; a folder replaced by a link or a file is neither trained nor read
    assert started.count(FIRST) == (2 if case.again or case.expect == "finished" else 1), started
    if case.expect == "missing":
        assert case.why in spoiled["message"], spoiled["message"]
        assert "\n" not in spoiled["message"] and spoiled["final_val_loss"] is None
        assert f"Missing runs (their folder no longer held the run; not counted): {FIRST}." in report
        assert f"missing: {FIRST}" in result.output


# -- refused before anything trains: exit 2 in at most two lines, the decoy untouched ---------------------
def out_linked(out: Path, decoy: Decoy) -> Path:
    os.symlink(decoy.root, out)
    return out


def runs_linked(out: Path, decoy: Decoy) -> Path:
    out.mkdir()
    os.symlink(decoy.root, out / "runs")
    return out


def run_linked(out: Path, decoy: Decoy) -> Path:
    (out / "runs").mkdir(parents=True)
    os.symlink(decoy.root, out / "runs" / FIRST)
    return out


def run_is_a_file(out: Path, decoy: Decoy) -> Path:
    (out / "runs").mkdir(parents=True)
    (out / "runs" / FIRST).write_text("not a run folder\n")
    return out


REFUSED = [
    ("--out is a link to the decoy", out_linked, "a merit comparison"),
    ("runs/ is a link to the decoy", runs_linked, "symbolic link"),
    ("a run folder is a link to the decoy", run_linked, "symbolic link"),
    ("a run folder is a plain file", run_is_a_file, FIRST),
]


@pytest.mark.parametrize(("name", "plant", "words"), REFUSED, ids=[r[0] for r in REFUSED])
def test_a_planted_run_folder_is_refused(name, plant, words, tmp_path, model_cfg, data_dir, monkeypatch):
    decoy = Decoy.plant(tmp_path)
    out = plant(tmp_path / "cmp", decoy)

    def refuse(config, callbacks=None):
        raise AssertionError(f"trained {config.out}")

    monkeypatch.setattr(training_run, "run_training", refuse)
    result = CliRunner().invoke(cli, compare_args(model_cfg, data_dir, out))
    assert_refused(result, words)
    decoy.assert_unchanged()
    assert not (out / "REPORT.md").exists() and not (decoy.root / "REPORT.md").exists()
