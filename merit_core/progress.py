"""The one progress event of long work (data preparation, training's data, evaluation, inspection, compare).

Core code reports progress by calling a `ProgressFn` with `Progress` events; the front end (merit_cli's
render.ProgressView, or any caller's function) draws them. Core code never draws anything itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Progress:
    """`done` of `total` units of `stage` (total None: unknown, e.g. a stage that only starts).

    `stage` is readable text ('tokenizing', 'loading model', 'loglikelihood requests'): a front end
    shows it as it is. `unit` names what is counted ('bytes', 'requests') where that helps. When the
    same stages repeat for several items (eval's checkpoints), `item` names the one in work and
    `index` / `count` place it among them.
    """

    stage: str
    done: int = 0
    total: int | None = None
    unit: str | None = None
    item: str | None = None
    index: int = 0
    count: int = 1

    def describe(self) -> str:
        """`stage`, after '[2/3] item: ' when there are several items, or 'item: ' for one."""
        if self.item is None:
            return self.stage
        prefix = f"[{self.index + 1}/{self.count}] " if self.count > 1 else ""
        return f"{prefix}{self.item}: {self.stage}"


ProgressFn = Callable[[Progress], None]


def report_to(progress: ProgressFn | None) -> ProgressFn:
    """`progress`, or a function that drops the events when there is none."""
    return progress if progress is not None else _drop


def _drop(event: Progress) -> None:
    pass
