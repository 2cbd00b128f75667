"""What every MERIT backend shares: the hyperparameter record, the rule for non-finite values
and the norm helpers.

The functional core builds one :class:`Hyper` per call (per param group and step) and hands it
to the backend (one signature for all, see :mod:`merit_core.optim.merit.functional`); the
norms of MERIT's ratios are computed by :func:`norm` (max-norm or l2, whole tensor or along one
dim) and turned into ratios by :func:`ratio_or_one`.

Shapes, as the authors' code does: a tensor with 2 or more dims uses element-wise ratios, rows
along dim 0 and columns along dim 1; for 3-D+ tensors every index of the trailing dims is its
own [dim0, dim1] matrix for the row and column norms, while the weight-wise ratio spans the
whole tensor. A tensor with fewer than 2 dims gets one ratio ``||w|| / ||u||`` (1 if either is 0).

Non-finite values (:data:`NONFINITE_RULE`, the same in every backend and for every ablation):
a parameter whose weight ``w`` or update direction ``u`` holds a NaN or an infinity (a NaN/inf
gradient, moment or weight entry) becomes NaN in *every* element after the step; its moments
are updated element by element as always, so they keep non-finite entries exactly where the
gradient had them. Other parameters of the group are unaffected. A backend detects it from the
tensor-wide norms of w and u (a max-norm computed with NaN counted as +inf, so that hardware
maxima that drop NaN cannot hide it; an l2 sum of squares propagates NaN and inf by itself).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeGuard

import torch
from torch import Tensor

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

NONFINITE_RULE = (
    "a parameter whose weight or update direction holds a NaN or an infinity becomes NaN in every element; "
    "its moments are updated element by element as usual"
)
LOW_PRECISION = (torch.float16, torch.bfloat16)


# Hyper's fields (less lr and norm) as a custom op's list arguments, which carry primitives only:
# the numbers (clip NaN for none) and the switches, in this order; Hyper.to_op writes them and
# Hyper.from_op reads them back.
_OP_NUMBERS = ("beta1", "beta2", "eps", "weight_decay", "clip")
_OP_SWITCHES = ("elementwise", "weight_bound", "bias_correction", "maximize")


@dataclass(frozen=True)
class Hyper:
    """One param group's MERIT hyperparameters, as every backend receives them."""

    lr: float | Tensor
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    norm: str  # "max" | "l2"
    elementwise: bool
    weight_bound: bool
    clip: float | None
    bias_correction: bool
    maximize: bool

    @classmethod
    def of(cls, *, lr, betas, eps, weight_decay, norm, elementwise, weight_bound, clip, bias_correction, maximize):
        """The record from the functional API's keyword arguments (``betas`` as a pair).

        Raises ValueError for a ``norm`` other than "max"/"l2" or a ``clip`` that is not > 0 (the
        optimizer class checks every hyperparameter before; this guards the functional API)."""
        if norm not in ("max", "l2"):
            raise ValueError(f"MERIT: norm must be 'max' or 'l2', got {norm!r}")
        if clip is not None and not clip > 0:
            raise ValueError(f"MERIT: clip must be > 0 or None, got {clip!r}")
        if isinstance(lr, Tensor) and lr.numel() != 1:
            raise ValueError(f"MERIT: a tensor lr must have one element, got shape {tuple(lr.shape)}")
        beta1, beta2 = betas
        return cls(
            lr=lr,
            beta1=float(beta1),
            beta2=float(beta2),
            eps=float(eps),
            weight_decay=float(weight_decay),
            norm=norm,
            elementwise=bool(elementwise),
            weight_bound=bool(weight_bound),
            clip=None if clip is None else float(clip),
            bias_correction=bool(bias_correction),
            maximize=bool(maximize),
        )

    @classmethod
    def of_group(cls, group: dict) -> Hyper:
        """The record of an optimizer param group (the keys of :meth:`of`)."""
        return cls.of(**hyper_values(group))

    @property
    def betas(self) -> tuple[float, float]:
        return self.beta1, self.beta2

    def to_op(self) -> tuple[list[float], str, list[bool]]:
        """The record less ``lr`` as a custom op's arguments (numbers, norm, switches; no clip is a
        NaN); see :meth:`from_op`."""
        numbers = [math.nan if (value := getattr(self, name)) is None else value for name in _OP_NUMBERS]
        return numbers, self.norm, [getattr(self, name) for name in _OP_SWITCHES]

    @classmethod
    def from_op(cls, lr: float | Tensor, numbers: list[float], norm: str, switches: list[bool]) -> Hyper:
        """The record back from :meth:`to_op`'s arguments and an ``lr``."""
        values: dict[str, Any] = {**dict(zip(_OP_NUMBERS, numbers)), **dict(zip(_OP_SWITCHES, switches))}
        if math.isnan(values["clip"]):
            values["clip"] = None
        return cls(lr=lr, norm=norm, **values)

    def corrections(self, step: Tensor | float) -> tuple[float, float]:
        """Adam's bias corrections (1 - beta1**t, 1 - beta2**t), or (1, 1) without bias correction.

        ``step`` is a parameter's step counter, already advanced for this step; MERIT keeps it
        on the CPU, so reading it is never a device sync."""
        if not self.bias_correction:
            return 1.0, 1.0
        t = float(step)
        return 1 - self.beta1**t, 1 - self.beta2**t

    def kernel_vector(self, step: Tensor | float) -> list[float]:
        """[lr, beta1, beta2, eps, weight_decay, 1/bc1, 1/sqrt(bc2), clip]: the fused kernels' layout
        (clip = inf for no clipping)."""
        bc1, bc2 = self.corrections(step)
        return [
            math.nan if isinstance(self.lr, Tensor) else float(self.lr),  # a tensor lr: the caller fills it in
            self.beta1,
            self.beta2,
            self.eps,
            self.weight_decay,
            1 / bc1,
            1 / math.sqrt(bc2),
            math.inf if self.clip is None else self.clip,
        ]


def norm(x: Tensor, kind: str, dim: int | None = None, dtype: torch.dtype | None = None) -> Tensor:
    """Max-norm (largest |entry|) or l2-norm of x, over one dim (kept, for broadcasting) or all of it.

    One kernel either way (``vector_norm(ord=inf)`` instead of abs + amax); ``dtype`` is the
    precision of the result (a max-norm is exact in any dtype)."""
    order = math.inf if kind == "max" else 2
    if dim is None:
        return torch.linalg.vector_norm(x, order, dtype=dtype)
    return torch.linalg.vector_norm(x, order, dim=dim, keepdim=True, dtype=dtype)


# MERIT's hyperparameters by their keyword names: the functional API's keywords, MERIT()'s arguments
# (less `implementation`) and the keys of its param groups, in the order of those signatures.
HYPER_KEYS = (
    "lr",
    "betas",
    "eps",
    "weight_decay",
    "norm",
    "elementwise",
    "weight_bound",
    "clip",
    "bias_correction",
    "maximize",
)


def hyper_values(named: Mapping[str, Any]) -> dict[str, Any]:
    """The :data:`HYPER_KEYS` entries of `named`, in that order: of a param group, or of the
    ``locals()`` of a function taking them as keywords (the functional API, MERIT's constructor)."""
    return {key: named[key] for key in HYPER_KEYS}


def finite_norms(wn: Tensor, un: Tensor) -> Tensor:
    """Whether a tensor's norms of w and u are both finite (else the tensor is poisoned, see
    :data:`NONFINITE_RULE`)."""
    return torch.isfinite(wn) & torch.isfinite(un)


def ratio_or_one(wn: Tensor, un: Tensor) -> Tensor:
    """||w|| / ||u||, or 1 where either norm is zero."""
    return torch.where((wn == 0) | (un == 0), torch.ones_like(wn), wn / un)


def state_dtype(p: Tensor) -> torch.dtype:
    """The moments' dtype for a parameter: fp32 for bf16/fp16 parameters, else the parameter's."""
    return torch.float32 if p.dtype in LOW_PRECISION else p.dtype


def moment_misfit(p: Tensor, exp_avg: object, exp_avg_sq: object) -> str | None:
    """What is wrong when a moment of `p`'s state has another shape than `p` (None when both fit):
    both sizes named, as torch's own size errors name them. Checked where a state comes in
    (``MERIT.load_state_dict``) and before every step changes anything (the functional core)."""
    for name, m in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if isinstance(m, Tensor) and m.shape != p.shape:
            return f"its {name} has shape {tuple(m.shape)}, the parameter has shape {tuple(p.shape)}"
    return None


def is_plain(t: Tensor) -> bool:
    """A plain tensor or Parameter (no DTensor or other subclass)."""
    return type(t) in (torch.Tensor, torch.nn.Parameter)


def is_dtensor(t: Tensor) -> TypeGuard[DTensor]:
    if is_plain(t) or not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


class BackendStep(Protocol):
    """The one signature of every backend (reference, foreach, cpu, compile, triton, sharded): one
    step, in place, of a group's parameters with AdamW-shaped state. The lists have equal length;
    ``state_steps`` are already incremented by the functional core, which alone advances them."""

    def __call__(
        self,
        params: list[Tensor],
        grads: list[Tensor],
        exp_avgs: list[Tensor],
        exp_avg_sqs: list[Tensor],
        state_steps: list[Tensor],
        h: Hyper,
    ) -> None: ...
