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
