"""`merit prepare` into a folder that is not empty: whose folder it is, and what a kill leaves.

A folder is merit's only when it carries merit's mark (written by prepare); re-preparing such a
folder replaces merit's entries and keeps the user's. A SIGKILL at every file-system step of a
re-prepare leaves the target holding the old data or the new one, complete, and the user's files
either in place or moved back by the next prepare.
"""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest

import merit_core.data.publish as publish_mod
from merit_core.data import load_meta, open_tokens, prepare_corpus
from merit_core.data.meta import PREPARED_MARKER
from merit_core.data.prepare import remove_stale_temp
from merit_core.data.publish import staging_dir
from merit_core.durable_writes import STAGING_MARKER
from merit_core.errors import DataError
from tests.data.test_data import make_docs, write_txt

VOCAB = 320
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def snapshot(folder: Path) -> dict[str, bytes | None]:
    """Every entry under `folder` with its bytes (None for a folder): what 'byte-identical' compares."""
    out: dict[str, bytes | None] = {}
    for path in sorted(folder.rglob("*")):
        out[str(path.relative_to(folder))] = None if path.is_dir() else path.read_bytes()
    return out


def data_of(folder: Path) -> tuple[bytes, bytes]:
    """The token streams of a prepared folder, read through the loaders (they check the sizes)."""
    meta = load_meta(folder)
    return open_tokens(folder, "train").tobytes(), open_tokens(folder, "val").tobytes() + str(meta.vocab_size).encode()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("durable")
    src = write_txt(root / "c.txt", make_docs(120))
    old = data_of(prepare_corpus(str(src), root / "ref-old", vocab_size=VOCAB, seed=0).path)
    new = data_of(prepare_corpus(str(src), root / "ref-new", vocab_size=VOCAB + 16, seed=1).path)
    assert old != new
    return src, old, new


def add_user_files(folder: Path) -> dict[str, bytes | None]:
    (folder / "notes.txt").write_text("my notes about this data\n")
    (folder / "plots").mkdir()
    (folder / "plots" / "hist.csv").write_text("1,2,3\n")
    return {k: v for k, v in snapshot(folder).items() if k.split("/")[0] in ("notes.txt", "plots")}


@pytest.mark.parametrize(
    "entries",
    [
        {"meta.json": "{}", "thesis.tex": "keep me"},  # the user's own meta.json beside their files
        {"meta.json": '{"format": "merit-tokens-v1"}', "train.bin": "x", "val.bin": "y"},
        {PREPARED_MARKER: "not json", "a.txt": "a"},  # a mark merit did not write
        {PREPARED_MARKER + "/x": "a folder named like the mark"},
        {"sub/deep.txt": "nested"},
        {".hidden": "a dot file alone"},
    ],
)
def test_a_folder_without_merits_mark_is_refused_before_any_work(tmp_path, corpus, entries):
    src = corpus[0]
    target = tmp_path / "out"
    for name, text in entries.items():
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        (target / name).write_text(text)
    before = snapshot(tmp_path)
    with pytest.raises(DataError, match="refusing to overwrite") as err:
        prepare_corpus(str(src), target, vocab_size=VOCAB)
    assert "\n" not in str(err.value)
    assert snapshot(tmp_path) == before  # nothing written beside it either


def test_re_prepare_replaces_merits_entries_and_keeps_the_users(tmp_path, corpus):
    src, old, new = corpus
    target = tmp_path / "out"
    prepare_corpus(str(src), target, vocab_size=VOCAB, seed=0)
    assert (target / PREPARED_MARKER).is_file() and data_of(target) == old
    mine = add_user_files(target)
    prepare_corpus(str(src), target, vocab_size=VOCAB + 16, seed=1)
    assert data_of(target) == new
    assert {k: v for k, v in snapshot(target).items() if k in mine} == mine
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


class Killed(Exception):
    pass


def _kill_at(step: int, swap: bool) -> None:
    """In a forked child: SIGKILL this process just before its `step`-th file-system change of a publish."""
    count = {"n": 0}

    def wrap(fn):
        def inner(*args, **kwargs):
            if count["n"] == step:
                os.kill(os.getpid(), signal.SIGKILL)
            count["n"] += 1
            return fn(*args, **kwargs)

        return inner

    os.replace = wrap(os.replace)
    os.rmdir = wrap(os.rmdir)
    shutil.rmtree = wrap(shutil.rmtree)
    publish_mod.rename_new = wrap(publish_mod.rename_new)
    publish_mod.exchange_paths = wrap(publish_mod.exchange_paths if swap else lambda a, b: False)


def _run_killed(built: Path, target: Path, step: int, swap: bool) -> bool:
    """Re-prepare `target` in a child killed at `step`; True when the child was killed (not finished).

    The child stages the new copy the way prepare does (a copy of `built`, a prepared folder, with
    the staging marker) and publishes it: every file-system change of a re-prepare after the
    tokenizing happens in `publish` (a tokenizer in a forked child could deadlock)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 0
        try:
            _kill_at(step, swap)
            with staging_dir(target) as tmp:
                (tmp / STAGING_MARKER).write_text(f"{os.getpid()}\n")
                for entry in built.iterdir():
                    (shutil.copytree if entry.is_dir() else shutil.copy)(entry, tmp / entry.name)
                publish_mod.publish(tmp, target)
        except BaseException:
            code = 3
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        assert os.WTERMSIG(status) == signal.SIGKILL
        return True
    assert os.WEXITSTATUS(status) == 0
    return False


@pytest.mark.parametrize("swap", [True, False], ids=["atomic-swap", "two-renames"])
def test_a_kill_at_every_step_of_a_re_prepare_leaves_old_or_new_data_and_the_users_files(tmp_path, corpus, swap):
    src, old, new = corpus
    built = src.parent / "ref-new"
    decoy = tmp_path / "decoy"
    decoy.mkdir()
    (decoy / "meta.json").write_text('{"mine": true}\n')
    decoy_before = snapshot(decoy)
    step, killed_at = 0, []
    while True:
        target = tmp_path / f"out{step}"
        shutil.copytree(src.parent / "ref-old", target)
        mine = add_user_files(target)
        if not _run_killed(built, target, step, swap):
            break  # the re-prepare ran to its end: every step before it has been killed once
        killed_at.append(step)
        if swap:  # the target always holds complete data, with nothing else to do
            assert data_of(target) in (old, new)
        # the next prepare (here its first step alone) finishes or undoes what the kill left
        remove_stale_temp(target)
        assert data_of(target) in (old, new), step
        assert {k: v for k, v in snapshot(target).items() if k in mine} == mine, step
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".merit-tmp-")], step
        step += 1
    assert data_of(target) == new and {k: v for k, v in snapshot(target).items() if k in mine} == mine
    # every kind of step was killed: the move of the new copy, the user's entries, the swap, the clean-up
    assert len(killed_at) >= (5 if swap else 6)
    assert snapshot(decoy) == decoy_before
