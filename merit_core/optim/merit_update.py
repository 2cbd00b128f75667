"""The MERIT update of one parameter, written with torch ops: a readable reference and a lean
eager variant. Both work on any device; the reference also works on DTensors (FSDP2 shards),
because it only uses reductions and broadcasts that DTensor knows how to distribute.

Shapes: a tensor with 2 or more dims uses element-wise ratios, with rows along dim 0 and columns
along dim 1 (as the authors' code does); for 3-D+ tensors every index of the trailing dims is its
own [dim0, dim1] matrix for the row and column norms, while the weight-wise ratio spans the whole
tensor. A tensor with fewer than 2 dims gets one ratio ``||w|| / ||u||`` (or 1 if either is 0).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

# Rows of the largest slice the eager path scales at once: its temporary is at most this many
# elements (4 MiB of fp32), far below one copy of a large parameter.
EAGER_CHUNK_NUMEL = 1 << 20


class Hyper(NamedTuple):
    """Everything one parameter's update needs, resolved from its param group and step."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    bias_correction1: float  # 1 - beta1**step, or 1.0 without bias correction
    bias_correction2: float  # 1 - beta2**step, or 1.0
    clip: float | None
    norm: str  # "max" | "l2"
    elementwise: bool
    weight_bound: bool
    maximize: bool


def _norm(x: torch.Tensor, kind: str, dim: int | None = None) -> torch.Tensor:
    """Max-norm (largest |entry|) or l2-norm of x, over one dim (kept) or all of it."""
    if kind == "max":
        return x.abs().amax() if dim is None else x.abs().amax(dim=dim, keepdim=True)
    return torch.linalg.vector_norm(x) if dim is None else torch.linalg.vector_norm(x, dim=dim, keepdim=True)


def _ratio(wn: torch.Tensor, un: torch.Tensor) -> torch.Tensor:
    """||w|| / ||u||, or 1 where either norm is zero."""
    return torch.where((wn == 0) | (un == 0), torch.ones_like(wn), wn / un)


def reference_update(
    p: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, h: Hyper
) -> None:
    """One MERIT step of p in place, transcribed directly from the algorithm."""
    g = grad.to(exp_avg.dtype)
    if h.maximize:
        g = -g
    exp_avg.mul_(h.beta1).add_(g, alpha=1 - h.beta1)
    exp_avg_sq.mul_(h.beta2).addcmul_(g, g, value=1 - h.beta2)
    w = p.to(exp_avg.dtype)  # a copy only for bf16/fp16 parameters (fp32 math)
    m_hat = exp_avg / h.bias_correction1
    v_hat = exp_avg_sq / h.bias_correction2
    u = m_hat / (v_hat.sqrt() + h.eps) + h.weight_decay * w

    b = _ratio(_norm(w, h.norm), _norm(u, h.norm))  # weight-wise ratio
    if p.dim() >= 2 and h.elementwise:
        rw, ru = _norm(w, h.norm, dim=1), _norm(u, h.norm, dim=1)  # one per row
        cw, cu = _norm(w, h.norm, dim=0), _norm(u, h.norm, dim=0)  # one per column
        s = torch.maximum(rw / ru, cw / cu)
        if h.weight_bound:
            s = torch.maximum(s, b)
        zero = (rw == 0) | (ru == 0) | (cw == 0) | (cu == 0)
        s = torch.where(zero, torch.ones_like(s), s)
    else:
        s = b
    d = s * u
    if h.clip is not None:
        d = d.clamp(-h.clip, h.clip)
    if w is p:
        p.sub_(d, alpha=h.lr)
    else:
        p.copy_(w.sub_(d, alpha=h.lr))  # rounded to p's dtype once


def _abs_max(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    # max|x| = max(max x, -min x): two plain reductions, no |x| temporary of x's size. (On CPU
    # this is several times faster than amax(|x|), aminmax or vector_norm(ord=inf).)
    if dim is None:
        return torch.maximum(x.amax(), x.amin().neg())
    return torch.maximum(x.amax(dim=dim, keepdim=True), x.amin(dim=dim, keepdim=True).neg())


def _norms(x: torch.Tensor, kind: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row, column and whole-tensor norms of x (x has 2+ dims), in `dtype`."""
    if kind == "max":
        rows, cols = _abs_max(x, 1).to(dtype), _abs_max(x, 0).to(dtype)
        return rows, cols, rows.amax()
    rows = torch.linalg.vector_norm(x, dim=1, keepdim=True, dtype=dtype)
    cols = torch.linalg.vector_norm(x, dim=0, keepdim=True, dtype=dtype)
    return rows, cols, torch.linalg.vector_norm(rows)


def _global_norm(x: torch.Tensor, kind: str, dtype: torch.dtype) -> torch.Tensor:
    return _abs_max(x).to(dtype) if kind == "max" else torch.linalg.vector_norm(x, dtype=dtype)


def _nan_where_zero(wn: torch.Tensor, un: torch.Tensor) -> torch.Tensor:
    # NaN marks "a feeding norm is zero"; torch.maximum propagates it and nan_to_num_ turns it into 1.
    return torch.where((wn == 0) | (un == 0), torch.full_like(wn, math.nan), wn / un)


def eager_update(
    p: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, h: Hyper
) -> None:
    """The same step as `reference_update` with fewer passes and one temporary of p's size (u);
    the element-wise scale is applied in row slices of at most EAGER_CHUNK_NUMEL elements."""
    sign = -1.0 if h.maximize else 1.0
    exp_avg.mul_(h.beta1).add_(grad, alpha=sign * (1 - h.beta1))
    exp_avg_sq.mul_(h.beta2).addcmul_(grad, grad, value=1 - h.beta2)
    u = exp_avg_sq.sqrt()
    if h.bias_correction2 != 1.0:
        u.mul_(1 / math.sqrt(h.bias_correction2))
    torch.div(exp_avg, u.add_(h.eps), out=u)
    if h.bias_correction1 != 1.0:
        u.mul_(1 / h.bias_correction1)
    if h.weight_decay != 0:
        u.add_(p, alpha=h.weight_decay)

    if p.dim() >= 2 and h.elementwise:
        rw, cw, bw = _norms(p, h.norm, u.dtype)
        ru, cu, bu = _norms(u, h.norm, u.dtype)
        r, c = _nan_where_zero(rw, ru), _nan_where_zero(cw, cu)
        if h.weight_bound:
            c = torch.maximum(c, _ratio(bw, bu))  # the floor b, folded into the column ratios
        step_rows = max(1, EAGER_CHUNK_NUMEL // max(1, u[0].numel()))
        for lo in range(0, p.shape[0], step_rows):
            uc = u[lo : lo + step_rows]
            uc.mul_(torch.maximum(r[lo : lo + step_rows], c).nan_to_num_(nan=1.0, posinf=math.inf))
    else:
        u.mul_(_ratio(_global_norm(p, h.norm, u.dtype), _global_norm(u, h.norm, u.dtype)))
    if h.clip is not None:
        u.clamp_(-h.clip, h.clip)
    p.add_(u, alpha=-h.lr)  # in fp32 for bf16/fp16 p, rounded once
