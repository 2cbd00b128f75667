"""Sophia-G: the clipped diagonal second-order optimizer of Liu et al. (2023), "Sophia: A Scalable
Stochastic Second-order Optimizer for Language Model Pre-training" (arXiv 2305.14342), with the
Gauss-Newton-Bartlett (GNB) Hessian estimator. No library ships it, so it lives here.

One step, for each parameter w with gradient g (Algorithm 3 of the paper)::

    w <- w * (1 - lr * weight_decay)                      # decoupled weight decay
    m <- b1 * m + (1 - b1) * g
    w <- w - lr * clip(m / max(rho * h, eps), 1)          # clip(z, 1) = max(min(z, 1), -1)

Every element therefore moves by at most ``lr`` per step (plus the decay). ``h`` is zero until
the first :meth:`SophiaG.update_hessian`; until then every step is ``lr * sign(m)``.

The Hessian EMA is refreshed by the *training loop* every ``k = opt.hessian_interval`` steps,
after that step's ``opt.step()`` (the official script: when ``step % k == k - 1``)::

    opt.zero_grad()
    loss, n = sampled_label_loss(model(x).logits)   # labels drawn from the model's own softmax
    loss.backward()                                 # with accumulation: (loss / micro).backward(), sum the n
    opt.update_hessian(n)                           # h <- b2 * h + (1 - b2) * n * g_hat**2
    opt.zero_grad()

In `merit train` the refresh is :func:`hessian_refresh`, the ``sophiag`` registry spec's step hook
(:mod:`merit_core.optim.registry`); the Trainer keeps the cadence. In a loop of your own, either
call ``update_hessian`` as above or give the optimizer a ``hessian_closure``: a function that
returns the sampled-label loss of a batch and its label count (what :func:`sampled_label_loss`
returns), e.g. ``lambda: sampled_label_loss(model(x).logits)``; ``step`` then refreshes the
Hessian itself after every k-th update, keeping the gradients the loop holds. Without either,
``h`` stays zero and every step degrades to ``lr * sign(m)``, so a step taken more than k updates
after the last refresh warns once.

GNB batch-size scaling: ``g_hat`` is the gradient of the *mean* sampled-label loss over the
``n`` labels, so ``n * g_hat**2`` estimates the per-label Gauss-Newton diagonal (the cross terms
between labels vanish in expectation because sampled-label gradients have zero mean). Pass the
total number of sampled labels (tokens) behind ``g_hat``: summed over gradient-accumulation
micro-batches, and over ranks when gradients are all-reduced (averaged) across them. With this
per-token scaling ``h`` does not depend on the batch size. The official code instead multiplies
by a fixed ``bs=5120`` in the step and uses ``rho`` 0.03-0.05 with 480 x 1024-token batches; our
default ``rho=4e-4`` is its ``rho=0.04`` re-expressed per token (0.04 * 5120 / 491,520).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch.optim import Optimizer

from merit_core.optim.closure import closure_loss


class SampledLoss(NamedTuple):
    """The mean cross-entropy on sampled labels and how many labels it averaged over."""

    loss: torch.Tensor
    num_samples: int


def sampled_label_loss(
    logits: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> SampledLoss:
    """Draw labels from ``softmax(logits)`` (no gradient through the draw) and return their mean cross-entropy.

    ``logits`` is ``[..., vocab]``; ``mask`` (same shape without the vocab dim, bool) keeps only the
    positions that count (e.g. not padding). Backpropagate ``loss`` and pass ``num_samples`` to
    :meth:`SophiaG.update_hessian`.
    """
    flat = logits.reshape(-1, logits.shape[-1])
    if mask is not None:
        flat = flat[mask.reshape(-1).to(torch.bool)]
    with torch.no_grad():
        probs = torch.softmax(flat.detach().float(), dim=-1)
        labels = torch.multinomial(probs, 1, generator=generator).squeeze(1)
    loss = F.cross_entropy(flat.float(), labels)
    return SampledLoss(loss, int(labels.numel()))


def hessian_refresh(ctx: Any) -> None:
    """The refresh above as the training loop's step hook: ``ctx`` is the loop's
    :class:`~merit_core.train.step_hooks.StepContext` (its optimizer, a forward giving this
    process's logits, a seeded generator, the number of processes). The labels behind the
    gradient are counted over processes, since DDP and FSDP average the gradient."""
    loss, n_labels = sampled_label_loss(ctx.logits(), generator=ctx.generator)
    loss.backward()
    ctx.optimizer.update_hessian(n_labels * ctx.world_size)


def hessian_interval(opt: Optimizer) -> int:
    """The loop's cadence of :func:`hessian_refresh` for a :class:`SophiaG`: its ``hessian_interval``."""
    if not isinstance(opt, SophiaG):
        raise TypeError(f"hessian_interval: expected a SophiaG optimizer, got {type(opt).__name__}")
    return opt.hessian_interval


class SophiaG(Optimizer):
    """Sophia-G (see the module docstring for the exact update and the Hessian-refresh protocol).

    Args:
        params: tensors or param-group dicts; groups may override any hyperparameter but
            ``hessian_interval``, which is one cadence for the whole optimizer.
        lr: learning rate; also the largest per-element move of one step.
        betas: (b1, b2): EMA coefficients of the gradient (every step) and of the Hessian
            estimate (every ``update_hessian`` call).
        rho: scales the Hessian in the denominator (the paper's gamma / the code's rho).
        weight_decay: decoupled (AdamW-style) decay, ``w *= 1 - lr * weight_decay``.
        eps: floor of ``rho * h`` in the denominator.
        hessian_interval: k, how often (in steps) the loop should call ``update_hessian``;
            read it as ``opt.hessian_interval``.
        maximize: maximize the objective instead of minimizing it.
        hessian_closure: optional; returns ``(sampled-label loss, number of labels)`` of a batch
            (see :func:`sampled_label_loss`). When set (also later, as ``opt.hessian_closure``),
            ``step`` refreshes the Hessian itself after every k-th update. When not set and the
            loop calls ``update_hessian`` less often than every k steps, ``step`` warns once.

    State per parameter: ``step`` (float tensor), ``exp_avg`` (m) and ``hessian`` (h), both of the
    parameter's dtype.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.965, 0.99),
        rho: float = 4e-4,
        weight_decay: float = 0.1,
        eps: float = 1e-12,
        *,
        hessian_interval: int = 10,
        maximize: bool = False,
        hessian_closure: Callable[[], tuple[torch.Tensor, int]] | None = None,
    ) -> None:
        if not 0.0 <= lr:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {betas}")
        if not 0.0 < rho:
            raise ValueError(f"rho must be > 0, got {rho}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        if not 0.0 < eps:
            raise ValueError(f"eps must be > 0, got {eps}")
        if isinstance(hessian_interval, bool) or not isinstance(hessian_interval, int) or hessian_interval < 1:
            raise ValueError(f"hessian_interval must be an integer >= 1, got {hessian_interval!r}")
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            rho=rho,
            weight_decay=weight_decay,
            eps=eps,
            hessian_interval=hessian_interval,
            maximize=maximize,
        )
        super().__init__(params, defaults)
        if len({g["hessian_interval"] for g in self.param_groups}) != 1:
            raise ValueError("hessian_interval is one cadence for the whole optimizer; do not set it per group")
        self.hessian_closure = hessian_closure
        self._since_refresh = 0  # updates since the last update_hessian (not saved: a resumed loop restarts it)
        self._warned = False

    def __getstate__(self) -> dict:
        # torch's keeps defaults, state and param_groups only; a copy (deepcopy, pickle) also keeps
        # the refresh count, but not hessian_closure (often an unpicklable local function): set it again
        return {**super().__getstate__(), "_since_refresh": self._since_refresh, "_warned": self._warned}

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)  # also from load_state_dict, which keeps this optimizer's attributes
        self.__dict__.setdefault("_since_refresh", 0)
        self.__dict__.setdefault("_warned", False)
        self.__dict__.setdefault("hessian_closure", None)
        for st in self.state.values():  # a state dict that saved ``step`` as a number, as torch's optimizers accept
            if isinstance(st, dict) and isinstance(st.get("step"), (int, float)):
                st["step"] = torch.tensor(float(st["step"]))

    @property
    def hessian_interval(self) -> int:
        """k: the loop calls :meth:`update_hessian` every k steps (saved with the param groups)."""
        return int(self.param_groups[0]["hessian_interval"])

    def _state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["hessian"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def update_hessian(self, num_samples: int) -> None:
        """Fold the current gradients, taken on a sampled-label loss, into the Hessian EMA.

        ``h <- b2 * h + (1 - b2) * num_samples * grad**2`` for every parameter with a gradient;
        ``num_samples`` is the number of sampled labels the loss averaged over (see module docstring).
        """
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
            raise ValueError(f"num_samples must be a positive integer, got {num_samples!r}")
        self._since_refresh = 0
        for group in self.param_groups:
            beta2 = group["betas"][1]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("SophiaG does not support sparse gradients")
                hess = self._state(p)["hessian"]
                hess.mul_(beta2).addcmul_(p.grad, p.grad, value=(1.0 - beta2) * num_samples)

    @torch.no_grad()
    def step(self, closure=None):
        """One Sophia-G step on every parameter that has a gradient; returns the closure's loss.

        With a ``hessian_closure``, every k-th step is followed by a Hessian refresh; without one, a
        step more than k updates after the last ``update_hessian`` warns (once per optimizer).
        """
        loss = closure_loss(closure)
        if self._since_refresh >= self.hessian_interval and self.hessian_closure is None and not self._warned:
            self._warned = True
            warnings.warn(
                f"SophiaG: {self._since_refresh} step{'s' if self._since_refresh != 1 else ''} without a "
                "Hessian refresh (hessian_interval "
                f"{self.hessian_interval}); every step is lr * sign(m) until then. Call "
                "update_hessian every hessian_interval steps or pass hessian_closure= "
                "(see merit_core.optim.sophia)",
                RuntimeWarning,
                stacklevel=4,
            )
        self._update()
        self._since_refresh += 1
        if self.hessian_closure is not None and self._since_refresh >= self.hessian_interval:
            self._refresh_from_closure(self.hessian_closure)
        return loss

    def _refresh_from_closure(self, hessian_closure: Callable[[], tuple[torch.Tensor, int]]) -> None:
        """Backward through the hessian closure's sampled-label loss on fresh gradients, fold them into
        the Hessian, and give the parameters back the gradients they had."""
        params = [p for group in self.param_groups for p in group["params"]]
        saved = [p.grad for p in params]
        for p in params:
            p.grad = None
        try:
            with torch.enable_grad():
                sampled, num_samples = hessian_closure()
                sampled.backward()
            self.update_hessian(int(num_samples))
        finally:
            for p, grad in zip(params, saved):
                p.grad = grad

    @torch.no_grad()
    def _update(self) -> None:
        for group in self.param_groups:
            lr, (beta1, _), rho = group["lr"], group["betas"], group["rho"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("SophiaG does not support sparse gradients")
                grad = -p.grad if group["maximize"] else p.grad
                state = self._state(p)
                state["step"] += 1
                exp_avg, hess = state["exp_avg"], state["hessian"]
                if group["weight_decay"] != 0:
                    p.mul_(1.0 - lr * group["weight_decay"])
                exp_avg.lerp_(grad, 1.0 - beta1)
                # clip(m / d, 1) with d = max(rho * h, eps) > 0, i.e. sign(m) * min(|m| / d, 1)
                update = exp_avg.div((hess * rho).clamp_(min=group["eps"])).clamp_(-1.0, 1.0)
                p.add_(update, alpha=-lr)
