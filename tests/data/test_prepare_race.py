"""Two prepares into one folder at once: a user's file is never lost, whatever the interleaving.

`merit prepare` takes the folder's writer lock, so a second prepare is refused while the first
runs. `publish` itself must still never delete a user's file when two run at once (a process
that does not take the lock, a lock on a file system that ignores it): the tests below stop one
publish at each of its steps (the `publish.pause` hook) while the other runs to its end, then let
the first finish, so every interleaving of the two is forced, not left to timing.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import threading
from pathlib import Path

import pytest

from merit_core.data import publish as publish_mod
from merit_core.data.meta import PREPARED_MARKER, marker_text
from merit_core.data.prepare import batched, prepare_documents
from merit_core.durable_writes import STAGING_MARKER
from merit_core.errors import MeritError, RunBusy

DATA_SENTENCES = 400  # the data_dir fixture: only its tokenizer is used

STAGES = ("moved-in", "user-entries-moved", "swapped", "before-discard")
# 4 x 4 pauses of the first publish at one step and of the second at another, plus the second run
# whole inside each pause of the first: 20 interleavings.
PLANS = [(a, b) for a in STAGES for b in STAGES] + [(a, None) for a in STAGES]


def _prepared(folder: Path, tag: str) -> Path:
    """A folder shaped like prepared data (merit's entries only), its files saying `tag`."""
    folder.mkdir(parents=True)
    for name in ("train.bin", "val.bin"):
        (folder / name).write_bytes(tag.encode() * 64)
    (folder / "meta.json").write_text(json.dumps({"tag": tag}))
    (folder / "tokenizer").mkdir()
    (folder / "tokenizer" / "tokenizer.json").write_text(json.dumps({"tag": tag}))
    (folder / PREPARED_MARKER).write_text(marker_text())
    return folder


def _staged(parent: Path, target: Path, tag: str) -> Path:
    tmp = _prepared(parent / f"{publish_mod.TMP_PREFIX}{target.name}-build-{tag}", tag)
    (tmp / STAGING_MARKER).write_text("1\n")
    return tmp


def _user_files(target: Path) -> dict[str, bytes]:
    (target / "notes.txt").write_text("my notes, keep them")
    (target / "mine").mkdir()
    (target / "mine" / "plot.png").write_bytes(bytes(range(256)))
    (target / "meta.json.bak").write_text("a backup of mine")
    names = ("notes.txt", "mine/plot.png", "meta.json.bak")
    return {name: (target / name).read_bytes() for name in names}


def _tag(target: Path) -> str:
    return json.loads((target / "meta.json").read_text())["tag"]


class Interleaving:
    """Runs two publishes in threads; each stops at its planned step until told to go on."""

    def __init__(self, monkeypatch, plan: tuple[str, str | None]):
        self.stops = dict(zip(("a", "b"), plan))
        self.reached = {who: threading.Event() for who in "ab"}
        self.go = {who: threading.Event() for who in "ab"}
        self.errors: dict[str, BaseException] = {}
        self.local = threading.local()
        monkeypatch.setattr(publish_mod, "pause", self.pause)

    def pause(self, stage: str) -> None:
        who = getattr(self.local, "who", None)
        if who is not None and self.stops[who] == stage and not self.reached[who].is_set():
            self.reached[who].set()
            assert self.go[who].wait(20), f"{who} was never released"

    def thread(self, who: str, tmp: Path, target: Path) -> threading.Thread:
        def run() -> None:
            self.local.who = who
            try:
                publish_mod.publish(tmp, target)
            except BaseException as exc:  # a publish may fail; the user's files must survive it
                self.errors[who] = exc
            finally:
                self.reached[who].set()  # a publish that ended before its stop releases the waiter

        return threading.Thread(target=run, daemon=True)


@pytest.mark.parametrize("swap", [True, False], ids=["atomic-swap", "two-renames"])
def test_two_publishes_at_once_never_lose_a_users_file(tmp_path, monkeypatch, swap):
    if not swap:
        monkeypatch.setattr(publish_mod, "exchange_paths", lambda a, b: False)
    # durability is test_prepare_durability's: here only the order of the renames matters
    monkeypatch.setattr(publish_mod, "fsync_tree", lambda folder: None)
    monkeypatch.setattr(publish_mod, "fsync_dir", lambda folder: None)
    decoy = _prepared(tmp_path / "decoy", "decoy")
    (decoy / "mine.txt").write_text("the user's, beside the target")
    decoy_before = {p: p.read_bytes() for p in decoy.rglob("*") if p.is_file()}
    for n, plan in enumerate(PLANS):
        root = tmp_path / f"try{n}"
        target = _prepared(root / "out", "old")
        mine = _user_files(target)
        tmp_a, tmp_b = _staged(root, target, "a"), _staged(root, target, "b")
        run = Interleaving(monkeypatch, plan)
        first, second = run.thread("a", tmp_a, target), run.thread("b", tmp_b, target)
        first.start()
        assert run.reached["a"].wait(20)  # a stopped at its step (or finished)
        second.start()
        assert run.reached["b"].wait(20)  # b stopped at its own step, or ran to its end
        run.go["a"].set()
        first.join(20)
        run.go["b"].set()
        second.join(20)
        assert not first.is_alive() and not second.is_alive(), plan
        found = {p.relative_to(target).as_posix(): p.read_bytes() for p in target.rglob("*") if p.is_file()}
        assert {k: found.get(k) for k in mine} == mine, (plan, run.errors)  # every user file, byte-identical
        assert _tag(target) in ("a", "b"), plan  # complete data of one of the two prepares
        assert all(isinstance(e, (OSError, MeritError)) for e in run.errors.values()), run.errors
        leftovers = [p.name for p in root.iterdir() if p.name.startswith(publish_mod.TMP_PREFIX)]
        assert not leftovers, (plan, leftovers)
    assert {p: p.read_bytes() for p in decoy.rglob("*") if p.is_file()} == decoy_before


def test_discarding_a_copy_hands_a_users_entry_back_and_deletes_only_merits(tmp_path):
    target = _prepared(tmp_path / "out", "new")
    old = _prepared(tmp_path / "old-copy", "old")
    (old / "notes.txt").write_text("moved here by another publish")
    (target / "taken.txt").write_text("the target's")
    (old / "taken.txt").write_text("a second one of that name")
    assert publish_mod.discard_copy(old, target) == ["taken.txt"]
    assert (target / "notes.txt").read_text() == "moved here by another publish"
    assert (target / "taken.txt").read_text() == "the target's"
    assert sorted(p.name for p in old.iterdir()) == ["taken.txt"]  # kept, never deleted
    assert _tag(target) == "new"


# -- the writer lock: a second prepare of the folder is refused while the first runs ---------------
def _docs(n: int = 120) -> list[str]:
    return [f"document {i} tells of lock number {i * 7} and folder {i % 5}." for i in range(n)]


def _digest(folder: Path) -> dict[str, str]:
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in folder.rglob("*")
        if p.is_file()
    }


@pytest.mark.parametrize("stage", ["moved-in", "user-entries-moved", "swapped"])
def test_a_second_prepare_of_the_same_folder_is_refused_while_the_first_runs(tmp_path, data_dir, monkeypatch, stage):
    target = tmp_path / "out"
    tokenizer = str(data_dir / "tokenizer")  # a local tokenizer: no BPE training
    kwargs = dict(source="test docs", tokenizer=tokenizer, val_fraction=0.2, seed=0)
    prepare_documents(lambda: batched(_docs()), target, **kwargs)
    mine = {"notes.txt": b"keep me"}
    (target / "notes.txt").write_bytes(mine["notes.txt"])
    reached, go = threading.Event(), threading.Event()
    owner = {}

    def pause(name: str) -> None:
        if name == stage and threading.get_ident() == owner.get("first"):
            reached.set()
            assert go.wait(20)

    monkeypatch.setattr(publish_mod, "pause", pause)
    errors: list[BaseException] = []

    def first() -> None:
        owner["first"] = threading.get_ident()
        try:
            prepare_documents(lambda: batched(_docs(150)), target, **kwargs)
        except BaseException as exc:
            errors.append(exc)
            reached.set()

    thread = threading.Thread(target=first, daemon=True)
    thread.start()
    assert reached.wait(60) and not errors, errors
    with pytest.raises(RunBusy, match="being prepared by merit process"):
        prepare_documents(lambda: batched(_docs(130)), target, **kwargs)
    go.set()
    thread.join(60)
    assert not errors, errors
    assert (target / "notes.txt").read_bytes() == mine["notes.txt"]
    assert json.loads((target / "meta.json").read_text())["documents"] == 150
    assert not [p for p in tmp_path.iterdir() if p.name != "out"], "no lock file or side folder left behind"
    shutil.rmtree(target)
