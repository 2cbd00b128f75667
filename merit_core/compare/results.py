"""Typed results of a comparison: what `run_compare` hands back, one dataclass per summary.json part.

`CompareSummary.to_dict()` is summary.json (the keys scripts read stay stable: additions are
fine, renames are not); `CompareSummary.from_dict` reads one back. Keys a dataclass does not
name (added by a newer version) are kept in `extra` and written back unchanged.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


class _Record:
    """from_dict / to_dict over a dataclass's fields, with unnamed keys kept in `extra`."""

    @classmethod
    def from_dict(cls, data: dict[str, Any]):
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        known = {k: v for k, v in data.items() if k in names}
        return cls(**known, extra={k: v for k, v in data.items() if k not in names})

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        out.update(self.extra)
        return out


@dataclass
class RunResult(_Record):
    """One training run: its settings, state and final numbers (summary.json `runs[]`)."""

    name: str
    optimizer: str
    batch_size: int
    lr: float
    status: str  # 'finished' | 'diverged'
    final_val_loss: float | None = None
    max_attention_logit: float | None = None
    max_attention_logit_by_layer: list[float | None] | None = None
    seed: int = 0
    tokens: int = 0
    steps: int = 0
    run_dir: str = ""
    message: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class BestResult(_Record):
    """The best lr of one (optimizer, batch size), as the mean over its seeds (summary.json `best[]`).

    `<key>_std` / `<key>_values`: the spread and each seed's value; `hessian` and `zero_shot` are
    set with --hessian / --eval (see merit_core.compare.measures)."""

    optimizer: str
    batch_size: int
    lr: float
    status: str
    final_val_loss: float | None = None
    final_val_loss_std: float | None = None
    final_val_loss_values: list[float | None] = field(default_factory=list)
    max_attention_logit: float | None = None
    max_attention_logit_std: float | None = None
    max_attention_logit_values: list[float | None] = field(default_factory=list)
    seeds: list[int] = field(default_factory=list)
    run_names: list[str] = field(default_factory=list)
    grid: list[float] = field(default_factory=list)
    n_diverged: int = 0
    lr_at_edge: str | None = None
    lr_extended: list[float] = field(default_factory=list)
    edge_reason: str | None = None
    hessian: dict[str, Any] | None = None
    zero_shot: list[dict[str, Any]] | None = None
    environment: dict[str, Any] | None = None  # the environment re-run of the first seed (summary.environment_check)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class CompareSummary:
    """summary.json: the settings, every run, every (optimizer, batch, lr) cell and the best cells."""

    settings: dict[str, Any]
    runs: list[RunResult]
    best: list[BestResult]
    cells: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CompareSummary:
        return cls(
            settings=dict(data["settings"]),
            runs=[RunResult.from_dict(r) for r in data["runs"]],
            best=[BestResult.from_dict(b) for b in data["best"]],
            cells=list(data.get("cells", [])),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "settings": self.settings,
            "runs": [r.to_dict() for r in self.runs],
            "cells": self.cells,
            "best": [b.to_dict() for b in self.best],
        }

    def best_for(self, optimizer: str, batch_size: int) -> BestResult | None:
        return next((b for b in self.best if (b.optimizer, b.batch_size) == (optimizer, batch_size)), None)
