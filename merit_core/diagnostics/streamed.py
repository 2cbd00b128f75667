"""What `merit inspect` takes from the weights as the layer-at-a-time probe reads them, so that each
stored tensor is read once for the probe, the weight statistics and the logit bounds together.

The probe's model (merit_core.models.layered_forward) hands each unit's stored tensors to a tap as
it reads them (upcast to float32 where that is exact: the model's own weights); `WeightReads` is
that tap. From each unit it takes the one-line summary of every 2-D weight (`weights.other_weights`)
and, for a decoder layer, its W_Q / W_K statistics (`weights.layer_stats`) and the weights' part of
its logit bounds (`logit_bounds.bound_terms`), both from one float64 Gram product per head
(`weights.layer_grams`): the same numbers, computed on the same values, without a second pass over
the files.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from merit_core.diagnostics.layout import AttentionLayout
from merit_core.diagnostics.logit_bounds import BoundTerms, bound_terms
from merit_core.diagnostics.weights import LayerStats, WeightSummary, layer_grams, layer_stats, other_weights


class WeightReads:
    """A tap for `layered_model` over the checkpoint `tensors` (the lazy reader the model reads from)
    with attention layout `layout`: the weight table, the layers' statistics and bound terms."""

    def __init__(self, tensors: Mapping, layout: AttentionLayout, top_k: int = 3) -> None:
        self.tensors, self.layout, self.top_k = tensors, layout, top_k
        self.found: dict[str, WeightSummary] = {}
        self.layer_of = {layout.q_name(i): i for i in range(layout.n_layers)}  # W_Q's stored name -> layer
        self.layers: dict[int, LayerStats] = {}
        self.terms: dict[int, BoundTerms | None] = {}
        self.scratch: dict = {}  # the float64 copy of W_Q / W_K, reused from layer to layer (`head_grams`)

    def __call__(self, unit: str, tensors: dict[str, torch.Tensor]) -> None:
        fresh = {name: t for name, t in tensors.items() if name not in self.found}  # a tied head: its embedding again
        for summary in other_weights(fresh):
            self.found[summary.name] = summary
        # the layer's W_Q / W_K, biases and QK-norm gains from this read (on the CPU, as the whole-model
        # path computes them); a name this unit does not hold is read from the checkpoint
        held = _Held(tensors, self.tensors)
        for name in tensors:
            layer = self.layer_of.get(name)
            if layer is not None and layer not in self.layers:
                grams = layer_grams(held, self.layout, layer, self.scratch)  # one float64 product for both
                stats = self.layers[layer] = layer_stats(held, self.layout, layer, self.top_k, grams)
                self.terms[layer] = bound_terms(held, self.layout, layer, stats, grams)

    def weights(self) -> list[WeightSummary]:
        """Every 2-D weight's summary, in name order (as `other_weights(tensors)` lists them): those the
        probe read, and the stored tensors no module of the model holds, read now."""
        rest = [name for name in self.tensors if name not in self.found]
        for summary in other_weights(_Subset(self.tensors, rest)):
            self.found[summary.name] = summary
        return [self.found[name] for name in sorted(self.found)]

    def layer_stats(self) -> list[LayerStats]:
        """Every layer's W_Q / W_K statistics (a layer the probe did not read is read now)."""
        return [
            self.layers.get(i)
            or layer_stats(self.tensors, self.layout, i, self.top_k, layer_grams(self.tensors, self.layout, i))
            for i in range(self.layout.n_layers)
        ]

    def bound_terms(self) -> list[BoundTerms | None]:
        """Every layer's bound terms (a layer the probe did not read is read now)."""
        return [
            self.terms[i] if i in self.terms else bound_terms(self.tensors, self.layout, i, layer)
            for i, layer in enumerate(self.layer_stats())
        ]


class _Held(Mapping):
    """The tensors of a unit as read (handed out on the CPU, moved when asked), and where a name is
    not among them, the checkpoint's."""

    def __init__(self, tensors: Mapping, checkpoint: Mapping):
        self.tensors, self.checkpoint = tensors, checkpoint

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name].cpu() if name in self.tensors else self.checkpoint[name]

    def __contains__(self, name: object) -> bool:
        return name in self.tensors or name in self.checkpoint

    def __iter__(self):
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)


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
