"""Max-norm statistics of the query/key weights (and every other 2-D weight) of a checkpoint.

MERIT's argument: the max attention logit grows with ||W_Q||_m * ||W_K||_m (the largest entries of
the query and key weights), so these max-norms, per layer and per head, are what to watch.
Everything here works on any name -> tensor mapping: a lazily-read safetensors checkpoint (one
tensor in memory at a time, no model built, no transformers import) or a live model's state dict.

Where W_Q / W_K live and how they split into heads is the model family's knowledge
(`merit_core.models.family`): GPT-2 stores a Conv1D [in, 3d] whose columns are output features,
the other families nn.Linear [out, in] weights whose rows are; fused QKV matrices (GPT-2 c_attn,
Phi-3 qkv_proj, GPT-NeoX query_key_value with its per-head [q_h | k_h | v_h] rows) are split by
`diagnostics/layout.py` into W_Q and W_K in the stored orientation, head h owning output features h*hd:(h+1)*hd. With
grouped query heads, query head h reads key head h // (H / Hkv). Row / column indices reported
for outliers are indices into that W_Q or W_K.

Results are dataclasses (`WeightStats`, `LayerStats`, `HeadStats`, ...); `to_dict()` gives the
JSON shape `merit inspect --json` writes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NotRequired, TypedDict

import torch

from merit_core.checkpoint.resolve import Checkpoint, SafetensorsReader, find_checkpoints
from merit_core.diagnostics.layout import (
    AttentionLayout,
    detect_layout,
    query_key,
    read_config,
    tensor_shape,
)
from merit_core.errors import CheckpointError, MeritError
from merit_core.metric_names import (
    ACTIVATION_MAX,
    ACTIVATION_MAX_DIM,
    ACTIVATION_MAX_POSITION,
    ACTIVATION_MEDIAN,
    ACTIVATION_RATIO,
    ATTENTION_ENTROPY_MEAN,
    ATTENTION_ENTROPY_MIN,
    MAX_ATTENTION_LOGIT,
    NORMALIZED_ENTROPY_MEAN,
    NORMALIZED_ENTROPY_MIN,
)
from merit_core.models.family import FamilySpec
from merit_core.precursors import Measured, Precursors, ProbedAttention

PERCENTILES = (50, 90, 99)


# -- typed results ---------------------------------------------------------------------------
@dataclass
class Outlier:
    """One of the largest rows (or columns) of a weight by max-norm."""

    index: int
    max_norm: float
    x_median: float | None  # ratio to the median row (column) max-norm
    head: int | None = None  # the head owning it, for output-feature rows (columns)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index, "max_norm": self.max_norm, "x_median": self.x_median}
        if self.head is not None:
            out["head"] = self.head
        return out


# The four norms every head and layer record carries, in their JSON order.
NORM_FIELDS = ("q_max_norm", "k_max_norm", "q_l2_norm", "k_l2_norm")
# The probe's attention entropy (nats; mean / min over positions, plain and normalised), per head and
# per layer (mean over heads of the means, min over heads of the minima), and the residual stream
# after each layer: attribute names are the JSON names (docs/DIAGNOSTICS.md).
ENTROPY_FIELDS = (ATTENTION_ENTROPY_MEAN, ATTENTION_ENTROPY_MIN, NORMALIZED_ENTROPY_MEAN, NORMALIZED_ENTROPY_MIN)
ACTIVATION_FIELDS = (ACTIVATION_MAX, ACTIVATION_MEDIAN, ACTIVATION_RATIO, ACTIVATION_MAX_POSITION, ACTIVATION_MAX_DIM)


def record_fields(record: Any, *names: str) -> dict[str, Any]:
    """{name: record.name} for the given attribute names, in that order: the plain fields of a JSON
    record of inspect (the typed results here, in inspect_report.py and update_size.py)."""
    return {name: getattr(record, name) for name in names}


@dataclass
class Distribution:
    """Percentiles of the per-row (or per-column) max-norms of a weight, and its top rows (columns)."""

    p50: float
    p90: float
    p99: float
    min: float
    max: float
    outliers: list[Outlier]

    def to_dict(self) -> dict[str, Any]:
        return {
            **record_fields(self, "p50", "p90", "p99", "min", "max"),
            "outliers": [o.to_dict() for o in self.outliers],
        }


@dataclass
class HeadStats(ProbedAttention):
    """One query head: its W_Q rows' and its key head's W_K max-norms and l2 norms, its logit bounds
    and what the probe measured of it (read from `probe`, the checkpoint's precursors record).

    Without a head count the weight fields are None and only the measured logit is known.
    """

    head: int
    kv_head: int | None = None
    q_max_norm: float | None = None
    k_max_norm: float | None = None
    q_l2_norm: float | None = None
    k_l2_norm: float | None = None
    bound: float | None = None  # q_max_norm * k_max_norm of this head (the name is kept for the JSON)
    logit_bound: float | None = None  # a true upper bound on the logit, see `logit_bounds`
    spectral_logit_bound: float | None = None  # a tighter bound from spectral norms (`spectral_logit_bounds`)
    layer: int = 0  # the layer it belongs to (not in its JSON record: the layer's holds it)
    probe: Precursors | None = field(default=None, repr=False, compare=False)

    def measured(self, name: str) -> float | None:
        return None if self.probe is None else self.probe.of_head(name, self.layer, self.head)

    def to_dict(self) -> dict[str, Any]:
        if self.kv_head is None:
            return {
                "head": self.head,
                MAX_ATTENTION_LOGIT: self.max_attention_logit,
                **record_fields(self, *ENTROPY_FIELDS),
            }
        return record_fields(
            self,
            "head",
            "kv_head",
            *NORM_FIELDS,
            "bound",
            MAX_ATTENTION_LOGIT,
            "logit_bound",
            "spectral_logit_bound",
            *ENTROPY_FIELDS,
        )


@dataclass
class LayerStats(ProbedAttention):
    """One layer's W_Q / W_K statistics, its logit bounds and what the probe measured of it (read
    from `probe`, the checkpoint's precursors record: max attention logit, entropies, activations).

    `bound` is the product ||W_Q||_m * ||W_K||_m, the term of MERIT's bound that the weights alone
    give; it is not itself a bound on the logit. `logit_bound` is one (max over heads), from the
    max-norms and the measured input norms of the layer (`logit_bounds`), once probed;
    `spectral_logit_bound` a tighter one from spectral norms (`spectral_logit_bounds`).
    """

    layer: int
    q_max_norm: float
    k_max_norm: float
    q_l2_norm: float
    k_l2_norm: float
    q_max_over_l2: float | None
    k_max_over_l2: float | None
    bound: float
    heads: list[HeadStats]
    q_rows: Distribution
    q_cols: Distribution
    k_rows: Distribution
    k_cols: Distribution
    input_max_l1: float | None = None  # largest l1 norm of an attention input token on the probe batch
    logit_bound: float | None = None
    input_max_l2: float | None = None  # largest l2 norm of an attention input token on the probe batch
    spectral_logit_bound: float | None = None
    probe: Precursors | None = field(default=None, repr=False, compare=False)

    activation_max = Measured("max_abs")
    activation_median = Measured("median_abs")
    activation_ratio = Measured("ratio")
    activation_max_position = Measured("position")
    activation_max_dim = Measured("dim")

    def measured(self, name: str) -> Any:
        return None if self.probe is None else self.probe.of_layer(name, self.layer)

    def attach(self, probe: Precursors) -> None:
        """Read what the probe measured of this layer and its heads from `probe` (a layer without a
        head count gets one head record per probed head)."""
        if not self.heads:
            self.heads = [HeadStats(h, layer=self.layer) for h in range(len(probe.heads_max_logit[self.layer]))]
        self.probe = probe
        for head in self.heads:
            head.probe = probe

    def to_dict(self) -> dict[str, Any]:
        return {
            **record_fields(
                self, "layer", *NORM_FIELDS, "q_max_over_l2", "k_max_over_l2", "bound", MAX_ATTENTION_LOGIT
            ),
            "heads": [h.to_dict() for h in self.heads],
            "q_rows": self.q_rows.to_dict(),
            "q_cols": self.q_cols.to_dict(),
            "k_rows": self.k_rows.to_dict(),
            "k_cols": self.k_cols.to_dict(),
            "input_max_l1": self.input_max_l1,
            "logit_bound": self.logit_bound,
            "input_max_l2": self.input_max_l2,
            "spectral_logit_bound": self.spectral_logit_bound,
            **record_fields(self, *ENTROPY_FIELDS, *ACTIVATION_FIELDS),
        }


@dataclass
class WeightSummary:
    """A one-line summary of a 2-D tensor."""

    name: str
    shape: list[int]
    max_norm: float
    l2_norm: float

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "max_norm": self.max_norm, "l2_norm": self.l2_norm}


@dataclass
class WeightStats:
    """Statistics of one set of weights. `path`, `label`, `step` are set for a checkpoint on disk."""

    architecture: str  # the family's model_type
    n_layers: int
    n_heads: int | None
    n_kv_heads: int | None
    head_dim: int | None
    d_model: int
    row_axis: str  # what a stored row of W_Q / W_K indexes: 'input' (Conv1D) or 'output' (Linear)
    layers: list[LayerStats]
    weights: list[WeightSummary] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    path: str | None = None
    label: str | None = None
    step: int | None = None
    layout: AttentionLayout | None = field(default=None, repr=False, compare=False)  # not in the JSON

    def to_dict(self) -> dict[str, Any]:
        where = {"path": self.path, "label": self.label, "step": self.step} if self.path is not None else {}
        return {**where, **self.body_dict()}

    def body_dict(self) -> dict[str, Any]:
        """The fields every weight statistic has (without path / label / step)."""
        return {
            **record_fields(
                self, "architecture", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_model", "row_axis"
            ),
            "layers": [layer.to_dict() for layer in self.layers],
            "weights": [w.to_dict() for w in self.weights],
            "notes": list(self.notes),
        }


# -- statistics ------------------------------------------------------------------------------
def _distribution(maxes: torch.Tensor, top_k: int, head_dim: int | None) -> Distribution:
    """Percentiles of per-row (or per-column) max-norms and the top-k entries with their ratio to the median."""
    qs = torch.quantile(maxes.float(), torch.tensor([p / 100 for p in PERCENTILES]))
    p50, p90, p99 = (float(v) for v in qs)
    k = min(top_k, maxes.numel())
    vals, idx = torch.topk(maxes, k)
    outliers = [
        Outlier(int(i), float(v), float(v) / p50 if p50 > 0 else None, int(i) // head_dim if head_dim else None)
        for v, i in zip(vals, idx)
    ]
    return Distribution(p50, p90, p99, float(maxes.min()), float(maxes.max()), outliers)


class MatrixStats(TypedDict):
    """:func:`matrix_stats`' record; the per-head lists only with a head axis and ``head_dim``."""

    max_norm: float
    l2_norm: float
    max_over_l2: float | None
    rows: Distribution
    cols: Distribution
    head_max_norm: NotRequired[list[float]]
    head_l2_norm: NotRequired[list[float]]


def matrix_stats(
    w: torch.Tensor,
    top_k: int = 3,
    head_axis: int | None = None,
    head_dim: int | None = None,
    feature_sq: torch.Tensor | None = None,
) -> MatrixStats:
    """max-norm, l2 norm, their ratio, and row / column max-norm distributions of a 2-D weight.

    `head_axis` (0 rows, 1 columns) is the output-feature axis, split into heads of `head_dim`:
    outliers along it are tagged with their head, and "head_max_norm" / "head_l2_norm" list the
    per-head norms. Per-head numbers come from per-feature vectors: `feature_sq`, the squared l2
    norm of each output feature in float64 where the caller has it (the diagonals of the heads'
    Gram matrices, `head_grams`), else computed here. No temporary the size of the weight is made
    for the max-norms (reductions of it only).
    """
    w = w.detach().float().contiguous()  # GPT-2's Q / K are column slices of c_attn
    row_max, col_max = _abs_max(w, 1), _abs_max(w, 0)
    max_norm = float(row_max.max())
    rows = _distribution(row_max, top_k, head_dim if head_axis == 0 else None)
    cols = _distribution(col_max, top_k, head_dim if head_axis == 1 else None)
    per_head: tuple[list[float], list[float]] | None = None
    if head_axis is None:
        l2 = float(torch.linalg.vector_norm(w))
    else:
        if feature_sq is None:  # squared l2 per output feature
            feature_sq = (w * w).sum(dim=1 - head_axis, dtype=torch.float64)
        l2 = float(feature_sq.sum().sqrt())
        if head_dim:
            per_head_max = (row_max if head_axis == 0 else col_max).view(-1, head_dim).amax(dim=1)
            per_head = per_head_max.tolist(), feature_sq.view(-1, head_dim).sum(dim=1).sqrt().tolist()
    stats: MatrixStats = {
        "max_norm": max_norm,
        "l2_norm": l2,
        "max_over_l2": max_norm / l2 if l2 > 0 else None,
        "rows": rows,
        "cols": cols,
    }
    if per_head is not None:
        stats["head_max_norm"], stats["head_l2_norm"] = per_head
    return stats


def _abs_max(w: torch.Tensor, dim: int) -> torch.Tensor:
    """max |w| along `dim`, as the larger of the max and minus the min (the same values as
    |w|.amax(dim), without a |w| temporary the size of w; abs: +0.0 for a row of zeros)."""
    return torch.maximum(w.amax(dim=dim), w.amin(dim=dim).neg()).abs()


def head_grams(
    w: torch.Tensor, axis: int, heads: int, hd: int, scratch: dict[Any, torch.Tensor] | None = None
) -> torch.Tensor:
    """W_h W_h^T in float64 for each head h of a stored weight (the head's hd output features, out
    features on `axis`): [heads, hd, hd], all heads in one batched product. Products of float32
    (and narrower) values are exact in float64. Its diagonals are the heads' squared feature norms
    (`matrix_stats`' feature_sq), its largest eigenvalues their squared spectral norms
    (merit_core.diagnostics.logit_bounds). `scratch` keeps the float64 copy's buffer per shape, for
    the next weight of the same shape to be copied into (no fresh pages to fault in per layer)."""
    if scratch is None:
        wd = w.double()
    else:
        key = (tuple(w.shape), w.device)
        buffer = scratch.get(key)
        if buffer is None:
            buffer = scratch[key] = torch.empty(w.shape, dtype=torch.float64, device=w.device)
        wd = buffer.copy_(w)
    blocks = wd.reshape(heads, hd, -1) if axis == 0 else wd.reshape(-1, heads, hd).permute(1, 2, 0)
    return blocks @ blocks.transpose(1, 2)


def layer_grams(
    tensors: Mapping, layout: AttentionLayout, layer: int, scratch: dict[Any, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`head_grams` of the layer's W_Q and W_K, where its spectral logit bound needs them: None
    where the heads are not known or the family normalises q and k (QK-norm)."""
    split = layout.head_split
    if split is None or layout.spec.qk_norm:
        return None
    n_heads, n_kv_heads, hd = split
    q, k = query_key(tensors, layout, layer)
    return head_grams(q, layout.out_axis, n_heads, hd, scratch), head_grams(k, layout.out_axis, n_kv_heads, hd, scratch)


def layer_stats(
    tensors: Mapping,
    layout: AttentionLayout,
    layer: int,
    top_k: int = 3,
    grams: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> LayerStats:
    """One layer's W_Q / W_K statistics, per head when the head count is known; `grams`: the layer's
    `layer_grams`, where taken already (their diagonals give the l2 norms)."""
    q, k = query_key(tensors, layout, layer)
    axis, hd = layout.out_axis, layout.head_dim
    fq, fk = (None, None) if grams is None else (g.diagonal(dim1=1, dim2=2).reshape(-1) for g in grams)
    qs, ks = matrix_stats(q, top_k, axis, hd, fq), matrix_stats(k, top_k, axis, hd, fk)
    heads = []
    if (split := layout.head_split) is not None:
        n_heads, n_kv_heads, _ = split
        qm, ql, km, kl = qs["head_max_norm"], qs["head_l2_norm"], ks["head_max_norm"], ks["head_l2_norm"]
        group = n_heads // n_kv_heads
        for h in range(n_heads):
            kv = h // group
            heads.append(HeadStats(h, kv, qm[h], km[kv], ql[h], kl[kv], qm[h] * km[kv], layer=layer))
    return LayerStats(
        layer=layer,
        q_max_norm=qs["max_norm"],
        k_max_norm=ks["max_norm"],
        q_l2_norm=qs["l2_norm"],
        k_l2_norm=ks["l2_norm"],
        q_max_over_l2=qs["max_over_l2"],
        k_max_over_l2=ks["max_over_l2"],
        bound=qs["max_norm"] * ks["max_norm"],
        heads=heads,
        q_rows=qs["rows"],
        q_cols=qs["cols"],
        k_rows=ks["rows"],
        k_cols=ks["cols"],
    )


_REDUCIBLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _max_abs(w: torch.Tensor) -> float:
    lo, hi = torch.aminmax(w)  # one pass, no |w| temporary (matters for embeddings)
    return max(-float(lo), float(hi))


def other_weights(tensors: Mapping) -> list[WeightSummary]:
    """A one-line summary (shape, max-norm, l2 norm) of every 2-D tensor, in name order."""
    out = []
    for name in sorted(tensors.keys()):
        if len(tensor_shape(tensors, name)) != 2:
            continue
        w = tensors[name].detach()
        if not w.is_floating_point() or w.numel() == 0:  # an empty matrix has no max-norm
            continue
        if w.dtype not in _REDUCIBLE:  # float8 (F8_E4M3, F8_E5M2): no min/max/norm kernels; exact in float32
            w = w.float()
        out.append(
            WeightSummary(name, list(w.shape), _max_abs(w), float(torch.linalg.vector_norm(w, dtype=torch.float32)))
        )
        del w
    return out


def family_notes(spec: FamilySpec, config: dict | None) -> list[str]:
    """What a reader of the numbers should know about this family's attention."""
    notes = []
    if spec.qk_norm and config is not None:
        notes.append(
            f"{spec.label} normalises queries and keys (QK-norm) after W_Q / W_K: the max-norms do not bound "
            "the logit, the norm layers' gains do"
        )
    cap = spec.softcap(config) if config is not None else None
    if cap:
        notes.append(
            f"{spec.label} soft-caps attention logits at {cap:g} (cap*tanh(logit/cap)); "
            "the max attention logit reported is the logit before the cap"
        )
    return notes


def attention_weight_stats(
    tensors: Mapping,
    config: dict | None = None,
    n_heads: int | None = None,
    top_k: int = 3,
    include_other: bool = True,
    include_layers: bool = True,
    grams: bool = False,
) -> WeightStats:
    """Statistics of one set of weights (a lazy checkpoint reader or a state dict). Without
    `include_other` / `include_layers` the weight table / the layers' W_Q / W_K statistics are left
    empty, for a caller that takes them from a read of its own (merit_core.diagnostics.streamed).
    `grams`: the layers' l2 norms from their heads' Gram matrices (`layer_grams`), as a caller that
    bounds the logits takes them (the same numbers as the layer-at-a-time read's)."""
    layout = detect_layout(tensors, config, n_heads)
    notes = []
    if not layout.n_heads:
        notes.append("per-head statistics need the head count: no config.json next to the weights (pass --heads N)")
    notes += family_notes(layout.spec, config)
    return WeightStats(
        architecture=layout.family,
        n_layers=layout.n_layers,
        n_heads=layout.n_heads,
        n_kv_heads=layout.n_kv_heads,
        head_dim=layout.head_dim,
        d_model=layout.d_model,
        row_axis=layout.row_axis,
        layers=[
            layer_stats(tensors, layout, i, top_k, layer_grams(tensors, layout, i) if grams else None)
            for i in range(layout.n_layers)
        ]
        if include_layers
        else [],
        weights=other_weights(tensors) if include_other else [],
        notes=notes,
        layout=layout,
    )


@contextlib.contextmanager
def checkpoint_context(path):
    """Prefix user errors raised inside the block with the checkpoint they concern."""
    try:
        yield
    except MeritError as exc:
        if str(path) in str(exc):
            raise
        raise type(exc)(f"{path}: {exc}") from None


def model_weight_stats(model, top_k: int = 3, include_other: bool = False) -> WeightStats:
    """The same statistics for a live transformers model (e.g. from a training loop), no copies."""
    for wrapper in ("_orig_mod", "module"):  # torch.compile / DDP wrappers
        model = getattr(model, wrapper, model)
    with torch.no_grad():
        return attention_weight_stats(
            model.state_dict(), model.config.to_dict(), top_k=top_k, include_other=include_other
        )


def weight_stats(path, n_heads: int | None = None, top_k: int = 3, include_other: bool = True) -> WeightStats:
    """Weight statistics of one checkpoint (safetensors file, sharded index or HF folder), lazily read.

    Sets `path`, `label` and `step` of `attention_weight_stats`'s result. A run folder with several step_*
    checkpoints is a CheckpointError here: use `find_checkpoints` and call this per checkpoint.
    """
    if isinstance(path, Checkpoint):
        ckpt = path
    else:
        found = find_checkpoints(path)
        if len(found) != 1:
            raise CheckpointError(f"{path} holds {len(found)} checkpoints; pass one of its step_* folders")
        ckpt = found[0]
    with checkpoint_context(ckpt.path):
        stats = attention_weight_stats(
            SafetensorsReader(ckpt), read_config(ckpt.config_path), n_heads, top_k, include_other
        )
    stats.notes = ckpt.notes + stats.notes
    stats.path, stats.label, stats.step = str(ckpt.path), ckpt.label, ckpt.step
    return stats
