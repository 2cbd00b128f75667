"""Loss-landscape curvature: top Hessian eigenvalue (power iteration) and trace (Hutchinson).

Both use Hessian-vector products by double backward: with g = dL/dθ built with
`create_graph=True`, H·v = d(g·v)/dθ. The gradient graph is built once and reused for every
product. Everything is generic over a `loss_fn() -> scalar tensor` and a list of parameters, so it
can be checked on a quadratic 0.5·xᵀAx whose Hessian is A. The MERIT paper reports these two
numbers on GPT-2 small (top eigenvalue 37.2 under AdamW vs 12.3 under MERIT).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass
class HessianEstimate:
    """Top (largest) eigenvalue and Hutchinson trace, with how they were obtained."""

    top_eigenvalue: float | None
    eigen_iters: int  # power iterations actually run
    eigen_converged: bool
    trace: float | None
    trace_stderr: float | None  # standard error of the Hutchinson mean
    trace_samples: int

    def to_dict(self) -> dict:
        return dict(self.__dict__)


class HessianVectorProduct:
    """H·v for the Hessian of `loss_fn()` w.r.t. `params`, reusing one gradient graph."""

    def __init__(self, loss_fn: Callable[[], torch.Tensor], params: Sequence[torch.Tensor]):
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("no parameter requires grad")
        loss = loss_fn()
        self.loss = float(loss.detach())
        self.grads = torch.autograd.grad(loss, self.params, create_graph=True)

    def __call__(self, vec: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        dot = sum((g * v).sum() for g, v in zip(self.grads, vec))
        hv = torch.autograd.grad(dot, self.params, retain_graph=True, allow_unused=True)
        return [torch.zeros_like(p) if h is None else h.detach() for h, p in zip(hv, self.params)]


def _dot(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    return float(sum((x.double() * y.double()).sum() for x, y in zip(a, b)))


def _generator(seed: int, device: torch.device) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def power_iteration(
    hvp: HessianVectorProduct, iters: int = 20, tol: float = 1e-3, seed: int = 0, shift: float = 0.0
) -> tuple[float, int, bool]:
    """Power iteration on H - shift·I: its eigenvalue of largest magnitude, the iterations run, and
    whether it converged (the Rayleigh quotient changed by less than `tol`, relative, in one step)."""
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    gen = _generator(seed, hvp.params[0].device)
    v = [torch.randn(p.shape, generator=gen, device=p.device, dtype=p.dtype) for p in hvp.params]
    norm = math.sqrt(_dot(v, v))
    v = [x / norm for x in v]
    eig = None
    for it in range(1, iters + 1):
        hv = hvp(v)
        if shift:
            hv = [h - shift * x for h, x in zip(hv, v)]
        new = _dot(v, hv)  # Rayleigh quotient, v has unit norm
        norm = math.sqrt(_dot(hv, hv))
        if norm == 0.0:
            return 0.0, it, True
        v = [x / norm for x in hv]
        if eig is not None and abs(new - eig) <= tol * max(abs(new), 1e-12):
            return new, it, True
        eig = new
    return eig, iters, False


def top_eigenvalue(
    hvp: HessianVectorProduct, iters: int = 20, tol: float = 1e-3, seed: int = 0
) -> tuple[float, int, bool]:
    """The largest (algebraic) Hessian eigenvalue, the power iterations run, whether they converged.

    Power iteration finds the eigenvalue of largest magnitude. Away from a minimum that can be a
    negative one (a direction of negative curvature larger than any positive curvature); the
    "top eigenvalue" of the sharpness literature is the largest positive curvature, so then a
    second power iteration on H - λ·I (whose eigenvalues λ_i - λ are all >= 0) finds
    λ_max - λ, and λ_max follows. Converged means both iterations did.
    """
    eig, n_it, converged = power_iteration(hvp, iters, tol, seed)
    if eig >= 0:
        return eig, n_it, converged
    gap, more, gap_converged = power_iteration(hvp, iters, tol, seed + 1, shift=eig)
    return eig + gap, n_it + more, converged and gap_converged


def hutchinson_trace(hvp: HessianVectorProduct, samples: int = 10, seed: int = 0) -> tuple[float, float | None]:
    """Hutchinson's estimate E[vᵀHv] with Rademacher v: (mean, standard error of the mean)."""
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    gen = _generator(seed, hvp.params[0].device)
    values = []
    for _ in range(samples):
        v = [
            torch.randint(0, 2, p.shape, generator=gen, device=p.device).to(p.dtype).mul_(2).sub_(1) for p in hvp.params
        ]
        values.append(_dot(v, hvp(v)))
    t = torch.tensor(values, dtype=torch.float64)
    stderr = float(t.std(unbiased=True) / math.sqrt(samples)) if samples > 1 else None
    return float(t.mean()), stderr


def hessian_estimate(
    loss_fn: Callable[[], torch.Tensor],
    params: Sequence[torch.Tensor],
    iters: int = 20,
    samples: int = 10,
    seed: int = 0,
    tol: float = 1e-3,
) -> HessianEstimate:
    """Top eigenvalue (iters > 0) and trace (samples > 0) of the Hessian of `loss_fn` at `params`."""
    hvp = HessianVectorProduct(loss_fn, params)
    eig, n_it, conv = top_eigenvalue(hvp, iters, tol, seed) if iters > 0 else (None, 0, False)
    trace, stderr = hutchinson_trace(hvp, samples, seed + 1) if samples > 0 else (None, None)
    return HessianEstimate(eig, n_it, conv, trace, stderr, samples)


def model_hessian(
    model, input_ids: torch.Tensor, iters: int = 20, samples: int = 10, seed: int = 0, tol: float = 1e-3
) -> HessianEstimate:
    """Hessian estimates of a causal LM's next-token loss on `input_ids`, over all its parameters.

    Runs with eager attention (double backward through fused SDPA kernels is not guaranteed) and
    in eval mode (no dropout, so every product sees the same function); both are restored.
    """
    previous_attn = model.config._attn_implementation
    was_training = model.training
    model.set_attn_implementation("eager")
    model.eval()
    params = list({id(p): p for p in model.parameters() if p.requires_grad}.values())  # tied weights once
    try:
        with torch.enable_grad():
            return hessian_estimate(
                lambda: model(input_ids=input_ids, labels=input_ids, use_cache=False).loss,
                params,
                iters,
                samples,
                seed,
                tol,
            )
    finally:
        model.set_attn_implementation(previous_attn)
        model.train(was_training)
