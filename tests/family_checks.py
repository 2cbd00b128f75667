"""What every case of the reliability tables checks (tests/cli/test_reliability_families.py and its
kin for eval and compare): a command either succeeds or is refused with exit code 2 in at most two
lines and no traceback, and a decoy folder of the user's, beside what the command works on, is
byte-identical afterwards (every file's bytes and mode, every link's target, no entry added or
removed)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from merit_core.checkpoint.runs import STATE_PT


def tree_state(root: Path) -> dict[str, tuple[str, str]]:
    """Every entry under `root` (links not followed): ("file", sha256 and mode), ("link", target) or ("dir", mode)."""
    found: dict[str, tuple[str, str]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in sorted(dirnames + filenames):
            path = Path(dirpath) / name
            key = str(path.relative_to(root))
            if path.is_symlink():
                found[key] = ("link", os.readlink(path))
            elif path.is_dir():
                found[key] = ("dir", oct(path.stat().st_mode))
            else:
                digest = hashlib.sha256(path.read_bytes()).hexdigest()
                found[key] = ("file", f"{digest} {oct(path.stat().st_mode)}")
    return found


@dataclass
class Decoy:
    """A folder of the user's: notes, a plot, a nested folder, a link out and a file named like merit's."""

    root: Path
    before: dict[str, tuple[str, str]] = field(default_factory=dict)

    @classmethod
    def plant(cls, parent: Path, name: str = "users-own") -> Decoy:
        root = parent / name
        root.mkdir(parents=True)
        (root / "notes.txt").write_text("my notes, keep them\n")
        (root / "curves.png").write_bytes(bytes(range(256)) * 4)
        (root / "metrics.jsonl").write_text('{"mine": 1}\n')
        (root / "results.json").write_text('{"mine": true}\n')
        (root / "nested").mkdir()
        (root / "nested" / "model.safetensors").write_bytes(b"not merit's weights")
        (root / "read-only.txt").write_text("mode 0444")
        (root / "read-only.txt").chmod(0o444)
        os.symlink("notes.txt", root / "link-to-notes")
        decoy = cls(root)
        decoy.before = tree_state(root)
        return decoy

    def assert_unchanged(self) -> None:
        after = tree_state(self.root)
        changed = sorted(k for k in set(self.before) | set(after) if self.before.get(k) != after.get(k))
        assert not changed, f"the user's decoy folder changed: {changed}"


# Names a user or a file may give, each something a terminal or rich would act on: markup that closes
# a tag never opened, an erase-screen escape, a colour tag, a bidi override, a C1 CSI, a hyperlink.
HOSTILE_NAMES = ["[/bold]x", "a\x1b[2Jb", "[red]r[/red]", "c\u202ed", "e\x9b31mf", "[link=mailto:x]l[/link]"]


def assert_no_raw_controls(text: str) -> None:
    """Nothing the terminal would act on: no ESC, no C1 CSI, no bidi override, no stray tab."""
    bad = [ch for ch in text if ch in "\x1b\x9b\u202e\t"]
    assert not bad, repr(text)


def lines_of(result: Any) -> list[str]:
    return [line for line in result.output.splitlines() if line.strip()]


def assert_refused(result: Any, *words: str) -> str:
    """Exit 2, at most two non-empty lines, no traceback, no exception but SystemExit; `words` in the text."""
    text = result.output
    assert result.exit_code == 2, f"exit {result.exit_code}: {text}{result.exception!r}"
    assert "Traceback" not in text, text
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert len(lines_of(result)) <= 2, text
    flat = " ".join(text.split())  # rich wraps long lines
    for word in words:
        assert " ".join(word.split()) in flat, (word, text)
    return text


def assert_ok(result: Any) -> str:
    """Exit 0 with no traceback and no exception."""
    text = result.output
    assert result.exit_code == 0, f"exit {result.exit_code}: {text}{result.exception!r}"
    assert "Traceback" not in text, text
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    return text


def craft_trainer_state(checkpoint: Path, change: Callable[[dict], object]) -> None:
    """Rewrite `checkpoint`'s trainer_state.pt with `change` applied to it in place (what a crafted file
    holds: still loadable with weights_only=True, so the state's own checks are what must refuse it)."""
    import torch

    path = checkpoint / STATE_PT
    state = torch.load(path, weights_only=True)
    change(state)
    torch.save(state, path)
