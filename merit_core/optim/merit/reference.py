"""The readable MERIT backend: one parameter at a time, transcribed directly from the algorithm.

It is the definition the other backends are tested against (non-finite values included: a
NaN/inf in w or u makes the whole parameter NaN, see ``common.py``), and the path for tensor subclasses
the fast backends cannot take (its ops are plain reductions and broadcasts, which DTensor and
most subclasses support). Any device, any float dtype; bf16/fp16 parameters are updated in fp32
and rounded once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from merit_core.optim.merit.common import Hyper, finite_norms, norm, ratio_or_one


@dataclass
class TrustRatios:
    """MERIT's ratios for one tensor: weight-wise ``b = ||w|| / ||u||``, and for element-wise
    tensors the row ratios [rows, 1, ...] and column ratios [1, cols, ...] (None otherwise), and
    ``s``, the ratio each element's update is scaled by (a tensor of w's shape, or b)."""

    w_norm: Tensor
    u_norm: Tensor
    weight: Tensor
    row: Tensor | None
    col: Tensor | None
    forced_one: Tensor | None  # where a zero row / column norm sets the ratio to 1
    s: Tensor


def direction(w: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, step: Tensor | float, h: Hyper) -> Tensor:
    """The update direction ``u = m_hat / (sqrt(v_hat) + eps) + weight_decay * w`` from already updated
    moments and w in the moments' dtype; ``step`` is the (already advanced) step counter."""
    bc1, bc2 = h.corrections(step)
    m_hat = exp_avg / bc1
    v_hat = exp_avg_sq / bc2
    return m_hat / (v_hat.sqrt() + h.eps) + h.weight_decay * w


def trust_ratios(w: Tensor, u: Tensor, h: Hyper) -> TrustRatios:
    """MERIT's ratios of w and its update direction u (see :class:`TrustRatios`)."""
    wn, un = norm(w, h.norm), norm(u, h.norm)  # NaN or inf if any entry is (torch's reductions propagate NaN)
    b = ratio_or_one(wn, un)  # weight-wise ratio
    if w.dim() >= 2 and h.elementwise:
        rw, ru = norm(w, h.norm, dim=1), norm(u, h.norm, dim=1)  # one per row (and trailing index)
        cw, cu = norm(w, h.norm, dim=0), norm(u, h.norm, dim=0)  # one per column
        row, col = rw / ru, cw / cu
        s = torch.maximum(row, col)
        if h.weight_bound:
            s = torch.maximum(s, b)
        zero = (rw == 0) | (ru == 0) | (cw == 0) | (cu == 0)
        s = torch.where(zero, torch.ones_like(s), s)
        return TrustRatios(wn, un, b, row, col, zero, s)
    return TrustRatios(wn, un, b, None, None, None, b)


def reference_step(p: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, step: Tensor, h: Hyper) -> None:
    """One MERIT step of p in place; ``step`` is p's (already advanced) step counter."""
    g = grad.to(exp_avg.dtype)
    if h.maximize:
        g = -g
    exp_avg.mul_(h.beta1).add_(g, alpha=1 - h.beta1)
    exp_avg_sq.mul_(h.beta2).addcmul_(g, g, value=1 - h.beta2)
    w = p.to(exp_avg.dtype)  # a copy only for bf16/fp16 parameters (fp32 math)
    u = direction(w, exp_avg, exp_avg_sq, step, h)
    r = trust_ratios(w, u, h)
    d = r.s * u
    if h.clip is not None:
        d = d.clamp(-h.clip, h.clip)
    new_w = w - d * h.lr if isinstance(h.lr, Tensor) else w.sub(d, alpha=h.lr)
    new_w = torch.where(finite_norms(r.w_norm, r.u_norm), new_w, torch.nan)  # the non-finite rule, without a host sync
    p.copy_(new_w)  # rounded to p's dtype once


@torch.no_grad()
def zero_gradient_update(p: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, step: Tensor | float, h: Hyper) -> Tensor:
    """What :func:`reference_step` would subtract from p with a zero gradient (lr included), leaving p,
    the moments and ``step`` (p's step counter before that step) unchanged: the moments decay to
    ``beta1 * m`` and ``beta2 * v`` and the counter advances by one."""
    w = p.to(exp_avg.dtype)
    u = direction(w, exp_avg * h.beta1, exp_avg_sq * h.beta2, float(step) + 1, h)
    d = trust_ratios(w, u, h).s * u
    if h.clip is not None:
        d = d.clamp(-h.clip, h.clip)
    return d * h.lr


@torch.no_grad()
def merit_reference(params, grads, exp_avgs, exp_avg_sqs, state_steps, h: Hyper) -> None:
    """The reference backend: :func:`reference_step` on each parameter (the signature:
    :class:`~merit_core.optim.merit.common.BackendStep`)."""
    for p, g, m, v, step in zip(params, grads, exp_avgs, exp_avg_sqs, state_steps):
        if p.numel():
            reference_step(p, g, m, v, step, h)
