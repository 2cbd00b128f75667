"""Upper bounds on the attention logits of each layer and head on the probed batch: what the weights
allow given the largest attention input the probe measured in the layer.

A bound is the weights' part (per head: the max-norm and bias norm of W_Q / W_K, their spectral
norms, or the limit a QK-norm's gain sets) times the measured input norm. The weights' part of a
layer (`BoundTerms`) is taken from the layer's tensors alone by `bound_terms`, so the layer-at-a-time
probe takes it as it reads the layer (merit_core.diagnostics.streamed) and no second read of W_Q /
W_K is needed; `logit_bounds` and `spectral_logit_bounds` combine it with the measured norms.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from merit_core.diagnostics.layout import AttentionLayout, query_key, query_key_bias
from merit_core.diagnostics.weights import LayerStats, layer_grams

# Where the effective gain of a QK-norm is (1 + weight) rather than the weight (Gemma's RMSNorm).
QK_NORM_GAIN_OFFSET = {"gemma3_text": 1.0}


@dataclass
class BoundTerms:
    """The weights' part of one layer's logit bounds, per query head and per key head.

    Without QK-norm: `bias` the l2 norms of the heads' query / key biases (zeros without biases),
    `spectral` ||W_Q,h||_2 and ||W_K,h||_2 (NaN where a head's block is not finite) with the same bias
    norms, and `notes` what is not finite. With QK-norm: `fixed` the largest ||q_h||_2 / ||k_h||_2
    the norm lets through, whatever the input."""

    bias: tuple[list[float], list[float]] | None = None  # the max-norm bound's, from the [heads, hd] view
    spectral: tuple[list[float], list[float], list[float], list[float]] | None = None  # q norm, q bias, k norm, k bias
    fixed: tuple[list[float], list[float]] | None = None
    head_dim: int = 0
    notes: list[str] = field(default_factory=list)


def bound_terms(
    tensors: Mapping,
    layout: AttentionLayout | None,
    layer: int,
    stats: LayerStats | None = None,
    grams: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> BoundTerms | None:
    """The weights' part of layer `layer`'s bounds, read from `tensors`; None where the heads are not
    known (no head count: no per-head bound). `stats`: the layer's statistics, when taken already:
    W_Q / W_K are finite exactly when their max-norms are (a NaN or an infinity reaches the
    maximum), so they are not scanned again. `grams`: the layer's `layer_grams`, where taken already."""
    split = None if layout is None else layout.head_split
    if layout is None or split is None:
        return None
    n_heads, n_kv_heads, hd = split
    if layout.spec.qk_norm:
        return BoundTerms(fixed=_qk_norm_limits(tensors, layout, layer), head_dim=hd)
    qb, kb = query_key_bias(tensors, layout, layer)
    if stats is not None:
        finite = (math.isfinite(stats.q_max_norm), math.isfinite(stats.k_max_norm))
    else:
        wq, wk = query_key(tensors, layout, layer)
        finite = (bool(torch.isfinite(wq).all()), bool(torch.isfinite(wk).all()))
    bad = [name for name, ok in zip(("W_Q", "W_K"), finite) if not ok]
    notes = []
    if bad:
        notes.append(
            f"layer {layer}: {' and '.join(bad)} {'hold' if len(bad) > 1 else 'holds'} non-finite values (NaN or infinite): "
            "no spectral bound for it"
        )
    found = grams if grams is not None else layer_grams(tensors, layout, layer)
    assert found is not None  # heads known, no QK-norm: layer_grams gives them
    gq, gk = found
    return BoundTerms(
        bias=(_view_norms(qb, hd), _view_norms(kb, hd)),
        spectral=(
            spectral_norms(gq),
            _slice_norms(qb, n_heads, hd),
            spectral_norms(gk),
            _slice_norms(kb, n_kv_heads, hd),
        ),
        head_dim=hd,
        notes=notes,
    )


def _view_norms(bias: torch.Tensor, hd: int) -> list[float]:
    """The l2 norm of each head's hd-slice of a bias, as one [heads, hd] reduction (a bias of zeros,
    the families without one: exact zeros, computed without a kernel)."""
    if not bool(bias.any()):
        return [0.0] * (bias.numel() // hd)
    return bias.view(-1, hd).norm(dim=1).tolist()


def _slice_norms(bias: torch.Tensor, heads: int, hd: int) -> list[float]:
    """The l2 norm of each head's hd-slice of a bias, one slice at a time (zeros: as `_view_norms`)."""
    if not bool(bias.any()):
        return [0.0] * heads
    return [float(bias[h * hd : (h + 1) * hd].norm()) for h in range(heads)]


def spectral_norms(grams: torch.Tensor) -> list[float]:
    """||W_h||_2 of each head from its float64 Gram matrix W_h W_h^T (`head_grams`): the square root
    of the largest eigenvalue, all heads in one batched eigenvalue call (an SVD of each hd x d block
    is many small parallel steps, slow on a loaded CPU). NaN for a head whose block holds a value
    that is not finite (its Gram's diagonal then does: no norm of it is meaningful, and the
    eigenvalue routine is not handed it)."""
    finite = torch.isfinite(grams.diagonal(dim1=1, dim2=2)).all(dim=1)
    out = torch.full((grams.shape[0],), math.nan, dtype=torch.float64)
    if bool(finite.any()):
        kept = grams if bool(finite.all()) else grams[finite]
        with _one_thread(kept.device):
            out[finite] = torch.linalg.eigvalsh(kept)[:, -1].clamp(min=0).sqrt().cpu()
    return out.tolist()


@contextlib.contextmanager
def _one_thread(device: torch.device) -> Iterator[None]:
    """torch on one CPU thread within the block (restored after): hd x hd eigenvalue problems gain
    nothing from threads, and the threaded LAPACK path under torch's own threads can spin for
    seconds on a CPU other processes load (benchmarks/README.md, inspect_large.py)."""
    if device.type != "cpu":
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def layers_bound_terms(
    tensors: Mapping, layout: AttentionLayout | None, layers: list[LayerStats]
) -> list[BoundTerms | None]:
    """`bound_terms` of every layer, read from `tensors` (the whole-model path)."""
    return [bound_terms(tensors, layout, layer.layer, layer) for layer in layers]


def logit_bounds(
    terms: Sequence[BoundTerms | None], layers: list[LayerStats], input_max_l1: list[float], scaling: list[float]
) -> None:
    """Fill `logit_bound` of every layer and head: an upper bound on |scaled q.k| on the probed batch.

    With x the attention input of a token (X = the largest ||x||_1 measured in the layer), each of
    the hd features of head h's query is at most ||W_Q,h||_m * X + |b| in size, so
    ||q_h||_2 <= sqrt(hd) * ||W_Q,h||_m * X + ||b_Q,h||_2; rotary embeddings are rotations and keep
    that norm; the same for keys; then |logit| <= scaling * ||q_h||_2 * ||k_h||_2 (Cauchy-Schwarz),
    with each layer's own scaling (as its attention module passed it to the probe).
    Families with QK-norm rescale q and k after W_Q / W_K, so no such bound holds: left None.
    """
    for layer, x in zip(layers, input_max_l1):
        layer.input_max_l1 = x
    for layer, x, scale, term in zip(layers, input_max_l1, scaling, terms):
        if term is None or term.bias is None:
            continue
        qb, kb = term.bias
        root = term.head_dim**0.5
        bounds = []
        for head in layer.heads:
            q = root * head.q_max_norm * x + qb[head.head]
            k = root * head.k_max_norm * x + kb[head.head if head.kv_head is None else head.kv_head]
            head.logit_bound = bound = scale * q * k
            bounds.append(bound)
        layer.logit_bound = max(bounds)


def spectral_logit_bounds(
    terms: Sequence[BoundTerms | None], layers: list[LayerStats], input_max_l2: list[float], scaling: list[float]
) -> list[str]:
    """Fill `spectral_logit_bound` of every layer and head: an upper bound on |scaled q.k| on the
    probed batch, from spectral norms. Returns notes naming the weights that are not finite (what a
    diverged run leaves): their heads' bounds, and their layer's, are NaN (no bound holds), and the
    other layers are bounded as before.

    Without QK-norm, with X the largest ||x||_2 of a token's attention input in the layer,
    ||q_h||_2 <= ||W_Q,h||_2 * X + ||b_Q,h||_2 (W_Q,h: the head's hd output rows), rotary
    embeddings (full or partial) rotate q and k and keep their norms, and |logit| <= scaling *
    ||q_h||_2 * ||k_h||_2. Since ||W x||_2 <= ||W||_2 ||x||_2 is the tightest bound from a norm
    of W and of x alone, this is never looser than what `logit_bounds` derives from max-norms up
    to the norms' ratio, and on trained weights (far from rank one) much tighter.
    With QK-norm, q = g * v / rms(v) whatever W_Q and x are: rms over the head ('head') gives
    ||q_h||_2 <= sqrt(hd) * max|g_h|; over all heads ('full', OLMo 2) ||q_h||_2 <= sqrt(H * hd) *
    max|g_h| (g_h: the head's slice of the gain; Gemma's gain is 1 + weight); the same for keys.
    The bound is on the logit before Gemma 2's soft-capping (what the probe measures).
    """
    for layer, x in zip(layers, input_max_l2):
        layer.input_max_l2 = x
    notes: list[str] = []
    for layer, x, scale, term in zip(layers, input_max_l2, scaling, terms):
        if term is None:
            continue
        if term.fixed is not None:
            q, k = term.fixed
        else:
            assert term.spectral is not None
            notes += term.notes
            qs, qb, ks, kb = term.spectral
            q = [s * x + b for s, b in zip(qs, qb)]
            k = [s * x + b for s, b in zip(ks, kb)]
        bounds = [scale * q[head.head] * k[head.head if head.kv_head is None else head.kv_head] for head in layer.heads]
        for head, bound in zip(layer.heads, bounds):
            head.spectral_logit_bound = bound
        layer.spectral_logit_bound = max(bounds) if all(math.isfinite(b) for b in bounds) else math.nan
    return notes


def _qk_norm_limits(tensors: Mapping, layout: AttentionLayout, layer: int) -> tuple[list[float], list[float]]:
    """The largest ||q_h||_2 and ||k_h||_2 a QK-norm lets through, per query and key head."""
    split = layout.head_split
    assert split is not None  # the caller measures only layouts whose heads are known
    n_heads, n_kv_heads, hd = split
    offset = QK_NORM_GAIN_OFFSET.get(layout.family, 0.0)
    out = []
    for name, heads in ((layout.q_name(layer), n_heads), (layout.k_name(layer), n_kv_heads)):
        gain = (tensors[name.replace("_proj.weight", "_norm.weight")].float() + offset).abs()
        width = hd if layout.spec.qk_norm == "head" else heads * hd  # what the rms is taken over
        if gain.numel() == hd:  # one gain shared by every head
            gain = gain.repeat(heads)
        out.append([width**0.5 * float(gain[h * hd : (h + 1) * hd].max()) for h in range(heads)])
    return out[0], out[1]
