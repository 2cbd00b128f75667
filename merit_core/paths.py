"""Where merit keeps files between runs (the prepared built-in corpus, compiled kernels)."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from merit_core.errors import ConfigError


def cache_dir(*parts: str) -> Path:
    """$MERIT_CACHE_DIR, else $XDG_CACHE_HOME/merit, else ~/.cache/merit; joined with `parts`, created.

    When that folder cannot be made or written (a read-only HOME, a cache path that runs through a
    file), a private folder of this user in the temp folder is used instead (`_fallback`)."""
    root = os.environ.get("MERIT_CACHE_DIR")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(xdg, "merit")
    path = Path(root, *parts)
    try:
        path.mkdir(parents=True, exist_ok=True)
        if os.access(path, os.W_OK | os.X_OK):
            return path
        problem = "not writable"
    except OSError as exc:
        problem = exc.strerror or str(exc)
    return _fallback(path, problem, parts)


def _fallback(wanted: Path, problem: str, parts: tuple[str, ...]) -> Path:
    """`<tmp>/merit-cache-<uid>/<parts>`: made private (0700) by this user; a folder there that is a
    link or another user's is refused (someone could have planted it), as is one that cannot be made."""
    base = Path(tempfile.gettempdir(), f"merit-cache-{os.getuid()}")
    try:
        base.mkdir(mode=0o700, exist_ok=True)
        info = os.lstat(base)
        if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            raise ConfigError(
                f"merit's cache folder {wanted} is unusable ({problem}) and {base} is not a folder of this user; "
                "set MERIT_CACHE_DIR to a writable folder"
            )
        path = base.joinpath(*parts)
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"merit's cache folder {wanted} is unusable ({problem}), nor can {base} be used "
            f"({exc.strerror or exc}); set MERIT_CACHE_DIR to a writable folder"
        ) from None
    return path
