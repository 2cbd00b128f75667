"""More cases of the bad-input table (tests/cli/bad_input_cases.py): numbers in digits other than
ASCII, seeds out of range, config.json sizes given as text, output folders merit must not write
(a link to nothing, a name that is not UTF-8, a planted lock), and prepared-folder marks that are
not merit's. Each is exit 2 in at most two lines, nothing of the case's folder changed."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from merit_core.data.meta import PREPARED_MARKER
from tests.cli.bad_input_cases import COMPARE, INSPECT, World, add, model_json, user_folder
from tests.cli.hostile_file_cases import fifo, model_copy

NOT_UTF8 = os.fsdecode(b"out-\xff\xfe")  # a name with bytes that are not UTF-8, as Python lists it


def _eval(w: World, *extra: str) -> list[str]:
    return ["eval", str(w.gpt2), "--tasks", "lambada", *extra]


def _prepare(w: World, out: Path, *extra: str) -> list[str]:
    return ["prepare", str(w.text), "--out", str(out), *extra]


# -- numbers: ASCII digits only (int() reads '١٢' as 12; '²' passes isdigit() and fails int()) --------
for option, value in [
    ("--steps", "١٢"),
    ("--steps", "²"),
    ("--batch-size", "２"),
    ("--seq-len", "³²"),
    ("--lr", "١e-3"),
    ("--save-every-minutes", "٥"),
    ("--seed", "٧"),
]:
    add(
        "numbers: train",
        f"{option} {value}",
        lambda w, c, o=option, v=value: w.train(c / "run", o, v),
        f"{option} must be",
    )
for option, value in [("--vocab-size", "٣٠٠"), ("--seed", "١"), ("--max-documents", "⁵")]:
    add("numbers: prepare", f"{option} {value}", lambda w, c, o=option, v=value: _prepare(w, c / "o", o, v), option)
for option, value in [("--limit", "١٢"), ("--num-fewshot", "²"), ("--bootstrap-iters", "１０"), ("--batch-size", "٤")]:
    add("numbers: eval", f"{option} {value}", lambda w, c, o=option, v=value: _eval(w, o, v), option)
for option, value in [("--seq-len", "٣٢"), ("--heads", "²"), ("--seed", "١"), ("--top-k", "٣")]:
    add(
        "numbers: inspect",
        f"{option} {value}",
        lambda w, c, o=option, v=value: [*INSPECT, str(w.gpt2), o, v],
        option,
    )
for option, value in [("--batch-sizes", "²k"), ("--batch-sizes", "8,١٢"), ("--lrs", "١e-3"), ("--jobs", "١")]:
    add(
        "numbers: compare",
        f"{option} {value}",
        lambda w, c, o=option, v=value: [*COMPARE, o, v, "--out", str(c / "o")],
        option,
    )

# -- eval --seed: numpy and torch take 32 bits ---------------------------------------------------
for value in ["4294967296", "-1", "1,2,3,4294967296", "99999999999999999999999", "None,-5,1,2", "١"]:
    add("eval: --seed", value, lambda w, c, v=value: _eval(w, "--seed", v), "--seed")


# -- config.json sizes and rope_scaling: one line, before anything reads them ------------------------
def _spoiled(w: World, c: Path, **changes) -> Path:
    folder = model_copy(w, c)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    return folder


for name, changes, expect in [
    ("n_head '2'", {"n_head": "2"}, "n_head must be an integer"),
    ("n_head 2.5", {"n_head": 2.5}, "n_head must be an integer"),
    ("n_layer '2'", {"n_layer": "2"}, "n_layer must be an integer"),
    ("n_embd true", {"n_embd": True}, "n_embd must be an integer"),
    ("vocab_size '320'", {"vocab_size": "320"}, "vocab_size must be an integer"),
    ("head_dim [8]", {"head_dim": [8]}, "head_dim must be an integer"),
    ("rope_scaling text", {"rope_scaling": "garbage"}, "rope_scaling must be a table"),
    ("rope_scaling list", {"rope_scaling": [1, 2]}, "rope_scaling must be a table"),
    ("rope_scaling factor text", {"rope_scaling": {"rope_type": "linear", "factor": "x"}}, "factor"),
    ("rope_scaling type number", {"rope_scaling": {"type": 5, "factor": 2.0}}, "rope_type"),
]:
    add("inspect: config.json values", name, lambda w, c, ch=changes: [*INSPECT, str(_spoiled(w, c, **ch))], expect)
add(
    "inspect: config.json values",
    "n_head '2' with the probe",
    lambda w, c: ["inspect", str(_spoiled(w, c, n_head="2"))],
    "n_head must be an integer",
)
add(
    "inspect: config.json values",
    "rope_scaling text with the probe",
    lambda w, c: ["inspect", str(_spoiled(w, c, rope_scaling="garbage"))],
    "rope_scaling",
)
for name, changes, expect in [
    ("n_head '2'", {"n_head": "2"}, "n_head must be an integer"),
    ("n_embd '32'", {"n_embd": "32"}, "n_embd must be an integer"),
    ("rope_scaling text", {"rope_scaling": "garbage"}, "rope_scaling must be a table"),
    ("rope_scaling factor -1", {"rope_scaling": {"rope_type": "linear", "factor": -1}}, "factor"),
]:
    add(
        "train: model config values",
        name,
        lambda w, c, ch=changes: w.train(c / "run", "--model", model_json(c, **ch)),
        expect,
    )


# -- output folders: a link to nothing, a name that is not UTF-8, a planted lock ---------------------
def _dangling(c: Path, name: str = "o") -> Path:
    os.symlink(c / "nowhere", c / name)
    return c / name


def _lock_planted(c: Path, make) -> Path:
    """A folder merit prepared before (its mark only), with `make(lock path)` planted beside it."""
    target = c / "o"
    target.mkdir()
    (target / PREPARED_MARKER).write_text('{"format": "merit-tokens-v1"}\n')
    make(c / ".o.lock")
    return target


def _victim(c: Path) -> Path:
    victim = c / "victim.txt"
    victim.write_text("the user's, not a lock")
    return victim


add("prepare: output", "-o a link to nothing", lambda w, c: _prepare(w, _dangling(c)), "symbolic link")
add("prepare: output", "-o under a link to nothing", lambda w, c: _prepare(w, _dangling(c) / "sub"), "symbolic link")
add("prepare: output", "-o not UTF-8", lambda w, c: _prepare(w, c / NOT_UTF8), "not UTF-8")
add("prepare: output", "-o inside a folder not UTF-8", lambda w, c: _prepare(w, c / NOT_UTF8 / "o"), "not UTF-8")
add(
    "prepare: output",
    "lock file is a link to a user's file",
    lambda w, c: _prepare(w, _lock_planted(c, lambda p: os.symlink(_victim(c), p))),
    "symbolic link",
)
add(
    "prepare: output",
    "lock file is a link to nothing",
    lambda w, c: _prepare(w, _lock_planted(c, lambda p: os.symlink(c / "gone", p))),
    "symbolic link",
)
add("prepare: output", "lock file is a FIFO", lambda w, c: _prepare(w, _lock_planted(c, fifo)), "lock file")
add("prepare: output", "lock file is a folder", lambda w, c: _prepare(w, _lock_planted(c, Path.mkdir)), "lock file")
add(
    "train: non-UTF-8 paths",
    "--out not UTF-8",
    lambda w, c: w.train(c / NOT_UTF8),
    "not UTF-8",
)


def _data_copy(w: World, c: Path, name: str) -> str:
    shutil.copytree(w.data, c / name)
    return str(c / name)


add(
    "train: non-UTF-8 paths",
    "--data not UTF-8",
    lambda w, c: w.train(c / "run", "--data", _data_copy(w, c, NOT_UTF8)),
    "not UTF-8",
)
add(
    "train: non-UTF-8 paths",
    "--model config not UTF-8",
    lambda w, c: (
        shutil.copy(w.model_cfg, c / f"{NOT_UTF8}.json"),
        w.train(c / "run", "--model", str(c / f"{NOT_UTF8}.json")),
    )[1],
    "not UTF-8",
)


# -- a folder's mark that is not merit's: the folder is the user's, refused whole -----------------------
def _marked(c: Path, content: bytes | None) -> Path:
    folder = user_folder(c)
    marker = folder / PREPARED_MARKER
    if content is None:
        marker.mkdir()
    else:
        marker.write_bytes(content)
    return folder


for name, content in [
    ("binary", bytes(range(256))),
    ("a JSON list", b'["merit-tokens-v1"]'),
    ("format a number", b'{"format": 5}'),
    ("another format", b'{"format": "tokens-v9"}'),
    ("not UTF-8", b'{"format": "merit-tokens-\xff"}'),
    ("over 4 KiB", b'{"format": "merit-tokens-v1", "pad": "' + b"x" * 5000 + b'"}'),
    ("a folder", None),
]:
    add("prepare: folder marks", f"mark {name}", lambda w, c, m=content: _prepare(w, _marked(c, m)), "refusing")
add(
    "prepare: folder marks",
    "mark a FIFO",
    lambda w, c: (fifo(user_folder(c) / PREPARED_MARKER), _prepare(w, c / "mine"))[1],
    "refusing",
)
