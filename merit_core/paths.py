"""Where merit keeps files between runs (the prepared built-in corpus, compiled kernels)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(*parts: str) -> Path:
    """$MERIT_CACHE_DIR, else $XDG_CACHE_HOME/merit, else ~/.cache/merit; joined with `parts`, created."""
    root = os.environ.get("MERIT_CACHE_DIR")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(xdg, "merit")
    path = Path(root, *parts)
    path.mkdir(parents=True, exist_ok=True)
    return path


def special_file(path: str | os.PathLike) -> str | None:
    """What `path` is when it exists but is neither a regular file nor a folder ('a FIFO', 'a socket',
    'a device'); None otherwise (absent, dangling link, file or folder). Reading a FIFO blocks until
    someone writes to it, a device may never end: merit reads neither as a checkpoint, a config or text."""
    import stat

    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return None
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def special_entries(folder: str | os.PathLike) -> list[tuple[str, str]]:
    """(name, what) of every entry of `folder` that is neither a regular file nor a folder (see
    `special_file`); [] when the folder cannot be listed."""
    try:
        names = sorted(os.listdir(folder))
    except (OSError, ValueError):
        return []
    found = []
    for name in names:
        what = special_file(os.path.join(folder, name))
        if what is not None:
            found.append((name, what))
    return found


def display(path: str | os.PathLike) -> str:
    """A path as text that can always be printed: bytes a file system name holds that are not
    UTF-8 (kept by Python as surrogates) are shown as \\xNN escapes instead of failing to encode."""
    text = os.fspath(path)
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
