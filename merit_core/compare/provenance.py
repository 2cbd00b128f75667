"""summary.json `settings.provenance`: which code made a comparison, where, when and how long it took.

The git commit and whether the working tree had uncommitted changes to tracked files (None for
both when merit does not run from a git checkout, e.g. an installed wheel), merit's version, the
start and end time (UTC, ISO 8601), the wall time and the host's CPU and the ISA torch dispatches
to. A result is reproducible from its commit only when `git_dirty` is false.
"""

from __future__ import annotations

import subprocess
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from merit_core.version import __version__

_ROOT = Path(__file__).resolve().parents[2]  # the checkout merit_core lives in, when it is one


def utc_now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def git_state(root: Path = _ROOT) -> tuple[str | None, bool | None]:
    """(commit SHA, dirty) of the git checkout at `root`; (None, None) when it is not one or git fails."""
    if not (root / ".git").exists():
        return None, None
    try:
        sha = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=30, check=True
        ).stdout.strip()
        changes = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None, None
    return sha or None, bool(changes.strip())


class Provenance:
    """Taken at a comparison's start (the commit, the host), finished at its end (`record`)."""

    def __init__(self, environment: dict[str, Any]) -> None:
        self.started = utc_now()
        self._clock = time.perf_counter()
        self.sha, self.dirty = git_state()
        self.environment = environment

    def record(self) -> dict[str, Any]:
        """The settings.provenance mapping, with the end time and wall time as of now."""
        return {
            "git_sha": self.sha,
            "git_dirty": self.dirty,
            "merit_version": __version__,
            "started": self.started,
            "finished_at": utc_now(),
            "wall_time_s": round(time.perf_counter() - self._clock, 1),
            "host_cpu": self.environment.get("cpu"),
            "host_isa": self.environment.get("cpu_capability"),
            "host_isa_flags": self.environment.get("isa_flags"),
        }
