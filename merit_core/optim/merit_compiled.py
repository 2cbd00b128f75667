"""MERIT's two passes as torch.compile'd functions (the ``implementation="compile"`` path).

Opt-in, because the first step compiles each distinct (shape, dtype, switches) combination:
on a 2-core CPU with a cold Inductor cache, 38 s for GPT-2 small's 9 shapes (18 graphs), much
less with a warm one (``TORCHINDUCTOR_CACHE_DIR``). Hyperparameters travel as a tensor, so a
changing learning rate never recompiles. On CPU it is ~4x slower than the C++ kernel (Inductor
materializes u and reduces rows and columns in separate loops); it is meant for accelerators.

The update is split into two compiled functions (moments + norms; then the scaled, clipped
write) because Inductor in torch 2.13 fails on the single in-place function on CPU
(``KeyError: 'buf14'`` in its outer-loop fusion).
"""

from __future__ import annotations

import math

import torch

from merit_core.optim.merit_update import Hyper

RECOMPILE_LIMIT = 256  # one graph per distinct shape; torch's default (8) is below GPT-2's 9


def _abs_norm(x: torch.Tensor, kind: str, dim: int | None):
    if kind == "max":
        return x.abs().amax() if dim is None else x.abs().amax(dim=dim, keepdim=True)
    return torch.linalg.vector_norm(x) if dim is None else torch.linalg.vector_norm(x, dim=dim, keepdim=True)


def _direction(m, v, w, hp):
    # hp = [lr, beta1, beta2, eps, weight_decay, 1/bc1, 1/sqrt(bc2), clip]
    return (m * hp[5]) / (v.sqrt() * hp[6] + hp[3]) + hp[4] * w


def _pass1(g, w, m, v, hp, norm: str, per_element: bool, maximize: bool):
    g = g.to(m.dtype)
    if maximize:
        g = -g
    m.mul_(hp[1]).add_((1 - hp[1]) * g)
    v.mul_(hp[2]).add_((1 - hp[2]) * g * g)
    w = w.to(m.dtype)
    u = _direction(m, v, w, hp)
    if per_element:
        return (
            _abs_norm(w, norm, 1),
            _abs_norm(u, norm, 1),
            _abs_norm(w, norm, 0),
            _abs_norm(u, norm, 0),
            _abs_norm(w, norm, None),
            _abs_norm(u, norm, None),
        )
    return _abs_norm(w, norm, None), _abs_norm(u, norm, None)


def _ratio(a, b):
    return torch.where((a == 0) | (b == 0), torch.ones_like(a), a / b)


def _pass2(w, m, v, hp, stats, per_element: bool, bound: bool, clip: bool):
    w32 = w.to(m.dtype)
    u = _direction(m, v, w32, hp)
    if per_element:
        rw, ru, cw, cu, bw, bu = stats
        s = torch.maximum(rw / ru, cw / cu)
        if bound:
            s = torch.maximum(s, _ratio(bw, bu))
        s = torch.where((rw == 0) | (ru == 0) | (cw == 0) | (cu == 0), torch.ones_like(s), s)
    else:
        s = _ratio(*stats)
    d = s * u
    if clip:
        d = torch.minimum(torch.maximum(d, -hp[7]), hp[7])
    w.copy_(w32 - hp[0] * d)


_compiled: dict = {}


def _get(name: str):
    if name not in _compiled:
        _compiled[name] = torch.compile({"pass1": _pass1, "pass2": _pass2}[name], dynamic=False)
    return _compiled[name]


def compiled_update(
    p: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, h: Hyper
) -> None:
    """One MERIT step of a plain tensor p in place, through the two compiled passes."""
    hp = torch.tensor(
        [
            h.lr,
            h.beta1,
            h.beta2,
            h.eps,
            h.weight_decay,
            1 / h.bias_correction1,
            1 / math.sqrt(h.bias_correction2),
            math.inf if h.clip is None else h.clip,
        ],
        dtype=exp_avg.dtype,
    ).to(p.device, non_blocking=True)
    per_element = p.dim() >= 2 and h.elementwise
    with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT, accumulated_recompile_limit=RECOMPILE_LIMIT * 4):
        stats = _get("pass1")(grad, p, exp_avg, exp_avg_sq, hp, h.norm, per_element, h.maximize)
        _get("pass2")(p, exp_avg, exp_avg_sq, hp, stats, per_element, h.weight_bound, h.clip is not None)
