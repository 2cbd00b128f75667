"""The reliability tables, through the `merit` command itself: for each family of failure, several
cases, each either refused (exit 2, at most two lines, no traceback) or done, and a decoy folder of
the user's beside the work byte-identical afterwards (tests/family_checks.py).

- prepare: two `merit prepare -o DIR` at once, the first a real process stopped at each step of its
  publish; or killed there, then prepared again. No user file in DIR is ever lost.
- resume: a crafted trainer state in the run's only checkpoint; nothing moved or truncated.
- printed names: markup, escapes and bidi overrides in names and paths reach the terminal as text.
- integrity: a damaged checkpoint file (a flipped byte, cut short, grown) is refused by resume,
  inspect and eval alike.

The tables for eval's results files and compare's vanished runs are in tests/eval/test_eval_families.py
and tests/compare/test_compare_families.py.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from merit_cli.main import cli
from merit_core.checkpoint.state import STATE_JSON
from merit_core.errors import printable
from tests.cli_runs import TINY_TRAIN, train_args
from tests.family_checks import (
    HOSTILE_NAMES,
    Decoy,
    assert_no_raw_controls,
    assert_ok,
    assert_refused,
    craft_trainer_state,
    tree_state,
)

DATA_SENTENCES = 400  # the data_dir fixture: small and quick; prepare uses only its tokenizer


def _invoke(args: list) -> object:
    return CliRunner().invoke(cli, [str(a) for a in args])


# == prepare: two at once, or one killed mid-publish ==============================================
# A `merit prepare` process whose publish stops at STAGE: it writes `reached` (its PID) into the
# signal folder and waits for `go` there. It is the real command, started as its own process.
HELD_PREPARE = """
import os, sys, time
from pathlib import Path
import merit_core.data.publish as publish
stage, flags = sys.argv[1], Path(sys.argv[2])
def pause(name):
    if name == stage and not (flags / "reached").exists():
        (flags / "reached").write_text(str(os.getpid()))
        while not (flags / "go").exists():
            time.sleep(0.02)
publish.pause = pause
from merit_cli.main import cli
cli(sys.argv[3:], prog_name="merit")
"""

STAGES = ("moved-in", "user-entries-moved", "swapped", "before-discard")
# How long a held prepare may take to reach its stage, or to finish once let go: a bound on a hang, not a
# measure of speed. The waits end as soon as the process gets there, so a generous bound costs a quiet
# machine nothing, and a loaded one (the suite on every core beside other work) is not failed for its load.
HELD_BOUND_S = 900


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("\n\n".join(f"document {i} tells of folder {i % 7} and lock {i * 13}." for i in range(200)))
    return path


def _prepare_args(corpus: Path, data_dir: Path, out: Path) -> list:
    return ["prepare", corpus, "-o", out, "--tokenizer", data_dir / "tokenizer", "--val-fraction", "0.1"]


USERS_ENTRIES = ("notes.txt", "mine", "meta.json.bak", "link-of-mine")  # what _users_files puts in DIR


def _users_files(target: Path) -> dict[str, tuple[str, str]]:
    """The user's own entries in a prepared folder (kept across a re-prepare): their state now."""
    (target / "notes.txt").write_text("my notes, keep them")
    (target / "mine").mkdir()
    (target / "mine" / "plot.png").write_bytes(bytes(range(256)))
    (target / "meta.json.bak").write_text("a backup of mine")
    os.symlink("notes.txt", target / "link-of-mine")
    return _only_users(tree_state(target))


def _only_users(state: dict[str, tuple[str, str]]) -> dict[str, tuple[str, str]]:
    return {k: v for k, v in state.items() if k.split("/")[0] in USERS_ENTRIES}


def _start_held(corpus: Path, data_dir: Path, target: Path, stage: str, flags: Path) -> subprocess.Popen:
    flags.mkdir()
    args = [str(a) for a in _prepare_args(corpus, data_dir, target)]
    proc = subprocess.Popen(
        [sys.executable, "-c", HELD_PREPARE, stage, str(flags), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    deadline = time.monotonic() + HELD_BOUND_S
    while not (flags / "reached").exists():
        if proc.poll() is not None:
            pytest.fail(f"the held prepare ended before {stage}: {proc.stdout.read() if proc.stdout else ''}")
        assert time.monotonic() < deadline, f"the held prepare never reached {stage}"
        time.sleep(0.05)
    return proc


@pytest.fixture
def prepared(corpus, data_dir, tmp_path) -> tuple[Path, dict[str, tuple[str, str]], Decoy]:
    """DIR prepared once by merit, holding the user's files too, and a decoy folder beside it."""
    target = tmp_path / "data"
    assert_ok(_invoke(_prepare_args(corpus, data_dir, target)))
    return target, _users_files(target), Decoy.plant(tmp_path)


@pytest.mark.parametrize("stage", STAGES)
def test_a_second_prepare_while_the_first_is_held_at_each_step_is_refused_and_loses_nothing(
    corpus, data_dir, tmp_path, prepared, stage
):
    target, mine, decoy = prepared
    held = _start_held(corpus, data_dir, target, stage, tmp_path / "flags")
    try:
        text = assert_refused(_invoke(_prepare_args(corpus, data_dir, target)), "being prepared by merit process")
        assert len(text.strip().splitlines()) == 1, text  # the refusal alone
    finally:
        (tmp_path / "flags" / "go").write_text("")
        out, _ = held.communicate(timeout=HELD_BOUND_S)
    assert held.returncode == 0, out
    assert _only_users(tree_state(target)) == mine
    assert (target / "train.bin").stat().st_size > 0 and (target / "meta.json").is_file()
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".merit-")], "nothing left beside DIR"
    decoy.assert_unchanged()


@pytest.mark.parametrize("stage", STAGES)
def test_a_prepare_killed_at_each_step_is_undone_by_the_next_and_loses_nothing(
    corpus, data_dir, tmp_path, prepared, stage
):
    target, mine, decoy = prepared
    held = _start_held(corpus, data_dir, target, stage, tmp_path / "flags")
    held.send_signal(signal.SIGKILL)
    held.communicate(timeout=HELD_BOUND_S)
    assert_ok(_invoke(_prepare_args(corpus, data_dir, target)))  # recovers what the killed one left
    assert _only_users(tree_state(target)) == mine
    assert (target / "train.bin").stat().st_size > 0
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".merit-")], "nothing left beside DIR"
    decoy.assert_unchanged()


def test_a_second_prepare_into_a_new_folder_while_the_first_is_held_is_refused(corpus, data_dir, tmp_path):
    decoy = Decoy.plant(tmp_path)
    target = tmp_path / "fresh"
    held = _start_held(corpus, data_dir, target, "moved-in", tmp_path / "flags")
    try:
        assert_refused(_invoke(_prepare_args(corpus, data_dir, target)), "being prepared by merit process")
    finally:
        (tmp_path / "flags" / "go").write_text("")
        out, _ = held.communicate(timeout=HELD_BOUND_S)
    assert held.returncode == 0, out
    assert (target / "meta.json").is_file()
    decoy.assert_unchanged()


# == resume and integrity: a run with one checkpoint, copied for each case ========================
SETTINGS = {**TINY_TRAIN, "save_every": 0, "eval_every": 0}  # one checkpoint, step_2: nothing to fall back to


@pytest.fixture(scope="module")
def trained(tmp_path_factory, model_cfg, data_dir) -> Path:
    run = tmp_path_factory.mktemp("families") / "run"
    assert_ok(_invoke(train_args(model_cfg, data_dir, run, "--steps", "2", settings=SETTINGS)))
    assert sorted(p.name for p in run.glob("step_*")) == ["step_2"]
    return run


@pytest.fixture
def run(trained, tmp_path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(trained, copy, symlinks=True)
    return copy


def _resume(model_cfg: Path, data_dir: Path, run: Path, *extra: str) -> object:
    return _invoke(train_args(model_cfg, data_dir, run, "--steps", "4", "--resume", *extra, settings=SETTINGS))


def _one_error(text: str) -> None:
    """One line of the output is the error (a note the user asked for, --no-verify's, may stand beside it)."""
    assert len([line for line in text.splitlines() if line.startswith("error:")]) == 1, text


def _group(state: dict) -> dict:
    return state["optimizer"]["param_groups"][0]


def _moments(state: dict) -> dict:
    return state["optimizer"]["state"][0]


# Crafted trainer states, each loadable with weights_only=True, so that with --no-verify the state's
# own checks must refuse it. A parameter with no state at all is not refused: in torch's contract it is
# one the optimizer has not stepped yet.
CRAFTED: dict[str, Callable[[dict], object]] = {
    "negative step": lambda s: s.update(step=-5),
    "text step": lambda s: s.update(step="2"),
    "vector step": lambda s: s.update(step=torch.tensor([2, 2])),
    "meta-device moment": lambda s: _moments(s).update(exp_avg=torch.zeros_like(_moments(s)["exp_avg"], device="meta")),
    "missing exp_avg_sq": lambda s: _moments(s).pop("exp_avg_sq"),
    "text betas": lambda s: _group(s).update(betas="(0.9, 0.99)"),
    "betas of three": lambda s: _group(s).update(betas=(0.9, 0.99, 0.5)),
    "negative clip": lambda s: _group(s).update(clip=-1.0),
    "text clip": lambda s: _group(s).update(clip="none"),
    "no rng": lambda s: s.pop("rng"),
    "step past the folder's": lambda s: s.update(step=99),
    "step 2.5": lambda s: s.update(step=2.5),
    "step True": lambda s: s.update(step=True),
    "step 2**70": lambda s: s.update(step=2**70),
    "step a NaN tensor": lambda s: s.update(step=torch.tensor(float("nan"))),
    "moment of the wrong shape": lambda s: _moments(s).update(exp_avg=torch.zeros(3)),
    "integer moments": lambda s: _moments(s).update(exp_avg_sq=torch.zeros_like(_moments(s)["exp_avg_sq"]).long()),
    "moment on a parameter's transpose": lambda s: _moments(s).update(exp_avg=_moments(s)["exp_avg"].t()),
    "no parameter groups": lambda s: s["optimizer"].update(param_groups=[]),
    "negative lr": lambda s: _group(s).update(lr=-1.0),
    "lr as text": lambda s: _group(s).update(lr="1e-3"),
    "optimizer is a number": lambda s: s.update(optimizer=5),
    "rng is text": lambda s: s.update(rng="seed"),
    "data position negative": lambda s: s["data"].update(next_batch=-3),
    "data position not the step": lambda s: s["data"].update(next_batch=7),
    "not a dict at all": lambda s: (s.clear(), s.update(x=[1, 2])),
}


@pytest.mark.parametrize("case", list(CRAFTED))
def test_resume_of_a_crafted_trainer_state_is_refused_and_moves_nothing(run, model_cfg, data_dir, tmp_path, case):
    """With checksums on the changed file is refused unread; with --no-verify the state's own checks
    refuse it."""
    craft_trainer_state(run / "step_2", CRAFTED[case])
    decoy = Decoy.plant(tmp_path)
    before = tree_state(run)
    _one_error(assert_refused(_resume(model_cfg, data_dir, run), "trainer_state.pt"))
    _one_error(assert_refused(_resume(model_cfg, data_dir, run, "--no-verify"), "step_2"))
    assert tree_state(run) == before  # no checkpoint moved aside, metrics.jsonl not cut back
    decoy.assert_unchanged()


def test_after_a_refused_resume_the_restored_state_resumes(run, trained, model_cfg, data_dir, tmp_path):
    craft_trainer_state(run / "step_2", CRAFTED["step past the folder's"])
    assert_refused(_resume(model_cfg, data_dir, run, "--no-verify"))
    shutil.copy(trained / "step_2" / "trainer_state.pt", run / "step_2" / "trainer_state.pt")
    decoy = Decoy.plant(tmp_path)
    assert_ok(_resume(model_cfg, data_dir, run))  # nothing was lost: the run goes on from step 2
    assert (run / "step_4" / "model.safetensors").is_file()
    decoy.assert_unchanged()


def _flip(raw: bytes, at: int) -> bytes:
    return raw[:at] + bytes([raw[at] ^ 0x01]) + raw[at + 1 :]


DAMAGES: dict[str, Callable[[bytes], bytes]] = {
    "first byte flipped": lambda raw: _flip(raw, 0),
    "middle byte flipped": lambda raw: _flip(raw, len(raw) // 2),
    "last byte flipped": lambda raw: _flip(raw, len(raw) - 1),
    "cut to half": lambda raw: raw[: len(raw) // 2],
    "one byte added": lambda raw: raw + b"\x00",
    "emptied": lambda raw: b"",
}
FILES = ["model.safetensors", "config.json", "trainer_state.pt", STATE_JSON, "tokenizer.json"]


@pytest.mark.parametrize("name", FILES)
@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_checkpoint_file_is_refused_by_resume_inspect_and_eval(
    run, model_cfg, data_dir, tmp_path, name, damage
):
    path = run / "step_2" / name
    path.write_bytes(DAMAGES[damage](path.read_bytes()))
    decoy = Decoy.plant(tmp_path)
    before = tree_state(run)
    _one_error(assert_refused(_resume(model_cfg, data_dir, run), name))
    _one_error(assert_refused(_invoke(["inspect", run, "--no-logits", "--no-updates"]), name))
    _one_error(assert_refused(_invoke(["eval", run, "--tasks", "lambada"]), name))
    assert tree_state(run) == before
    decoy.assert_unchanged()


# == printed names: what a user or a file names reaches the terminal as text ======================
def _under_a_file(t: Path, n: str) -> Path:
    """An output path below a file of the user's (so it cannot be written), the hostile name in both."""
    blocker = t / f"file{n}"
    blocker.parent.mkdir(parents=True, exist_ok=True)
    blocker.write_text("mine")
    return blocker / "results.json"


def _hostile_tensor(t: Path, n: str, trained: Path) -> Path:
    """A Hugging Face folder of the trained weights plus a tensor named `n`."""
    from safetensors.torch import load_file, save_file

    folder = t / "named"
    folder.mkdir(exist_ok=True)
    shutil.copy(trained / "step_2" / "config.json", folder / "config.json")
    weights = load_file(trained / "step_2" / "model.safetensors")
    weights[n] = torch.full((2, 3), 7.0)
    save_file(weights, str(folder / "model.safetensors"))
    return folder


# (argv builder, exit code): the builder gets (tmp_path, hostile name, fixtures) and returns argv; a
# refusal names the hostile path or name in its line.
PRINTED: dict[str, tuple[Callable[..., list], int]] = {
    "train --out": (
        lambda t, n, f: train_args(f["model_cfg"], f["data_dir"], t / f"run{n}", "--steps", "1", settings=SETTINGS),
        0,
    ),
    "train --model missing": (lambda t, n, f: ["train", "--model", t / f"m{n}.json", "--data", f["data_dir"]], 2),
    "train --optimizer": (
        lambda t, n, f: [*train_args(f["model_cfg"], f["data_dir"], t / "r"), "--optimizer", f"opt{n}"],
        2,
    ),
    "prepare -o": (lambda t, n, f: _prepare_args(f["corpus"], f["data_dir"], t / f"data{n}"), 0),
    "prepare missing source": (lambda t, n, f: ["prepare", t / f"src{n}.txt", "-o", t / "o"], 2),
    "inspect -o": (lambda t, n, f: ["inspect", "--no-logits", f["trained"], "-o", t / f"r{n}.json"], 0),
    "inspect --weights tensor names": (
        lambda t, n, f: ["inspect", "--no-logits", "--weights", _hostile_tensor(t, n, f["trained"])],
        0,
    ),
    "inspect missing": (lambda t, n, f: ["inspect", t / f"ckpt{n}"], 2),
    "inspect --json under a file": (
        lambda t, n, f: ["inspect", "--no-logits", f["trained"], "-o", _under_a_file(t, n)],
        2,
    ),
    "eval --tasks": (lambda t, n, f: ["eval", f["trained"], "--tasks", f"task{n}"], 2),
    "eval -o under a file": (
        lambda t, n, f: ["eval", f["trained"], "--tasks", "builtin", "-o", _under_a_file(t, n)],
        2,
    ),
    "compare --optimizers": (lambda t, n, f: ["compare", "--optimizers", f"o{n}", "--out", t / "c"], 2),
}


@pytest.mark.parametrize("what", list(PRINTED))
def test_names_with_markup_and_escapes_print_as_text(what, tmp_path, trained, model_cfg, data_dir, corpus):
    """Every hostile name in each place a user or a file names something: exit code as for a plain
    name, nothing a terminal would act on, rich markup shown, not applied."""
    build, code = PRINTED[what]
    fixtures = {"model_cfg": model_cfg, "data_dir": data_dir, "corpus": corpus, "trained": trained}
    decoy = Decoy.plant(tmp_path)
    cheap = code == 2 or what.startswith("inspect")
    names = (
        HOSTILE_NAMES if cheap else HOSTILE_NAMES[:2]
    )  # the runs that train or prepare cost time: markup and an escape
    for name in names:
        result = _invoke(build(tmp_path, name, fixtures))
        text = assert_refused(result) if code == 2 else assert_ok(result)
        assert_no_raw_controls(text)
        if what == "inspect --weights tensor names":
            assert printable(name) in text, (name, text)  # shown, escaped, never interpreted
        if code == 2:
            assert printable(name) in " ".join(text.split()), (name, text)
    decoy.assert_unchanged()
