"""What `merit inspect` takes from the weights as the layer-at-a-time probe reads them, so that each
stored tensor is read once for the probe and the weight table together.

The probe's model (merit_core.models.layered_forward) hands each unit's stored tensors to a tap as
it reads them; `WeightSummaries` is that tap for the table of every 2-D weight
(`weights.other_weights`): the same numbers, computed on the same stored tensors, without a
second pass over the files.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from merit_core.diagnostics.weights import WeightSummary, other_weights


class WeightSummaries:
    """A tap for `layered_model`: the one-line summaries of the 2-D weights of each unit it reads."""

    def __init__(self) -> None:
        self.found: dict[str, WeightSummary] = {}

    def __call__(self, unit: str, tensors: dict[str, torch.Tensor]) -> None:
        fresh = {name: t for name, t in tensors.items() if name not in self.found}  # a tied head: its embedding again
        for summary in other_weights(fresh):
            self.found[summary.name] = summary

    def result(self, tensors: Mapping) -> list[WeightSummary]:
        """Every 2-D weight's summary, in name order (as `other_weights(tensors)` lists them): those the
        probe read, and the stored tensors no module of the model holds, read now."""
        rest = [name for name in tensors if name not in self.found]
        for summary in other_weights(_Subset(tensors, rest)):
            self.found[summary.name] = summary
        return [self.found[name] for name in sorted(self.found)]


class _Subset(Mapping):
    """The named entries of a (lazy) name -> tensor mapping, read when asked."""

    def __init__(self, tensors: Mapping, names: list[str]):
        self.tensors, self.names = tensors, names

    def shape(self, name: str) -> tuple[int, ...]:
        shape = getattr(self.tensors, "shape", None)
        return tuple(shape(name)) if callable(shape) else tuple(self.tensors[name].shape)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)
