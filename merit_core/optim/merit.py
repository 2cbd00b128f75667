"""MERIT: Maximum-normalized Element-wise Ratio for large-batch training (Luo et al., ICML 2025)."""

from __future__ import annotations

import ctypes
import math
from numbers import Real

import torch
from torch.optim import Optimizer

from merit_core.optim import merit_kernels
from merit_core.optim.merit_update import Hyper, eager_update, reference_update

IMPLEMENTATIONS = ("reference", "eager", "cpp", "compile")
_LOW_PRECISION = (torch.float16, torch.bfloat16)
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class MERIT(Optimizer):
    r"""MERIT, a drop-in ``torch.optim.Optimizer``.

    For each parameter ``w`` with gradient ``g`` (no bias correction by default)::

        m <- b1*m + (1-b1)*g ;  v <- b2*v + (1-b2)*g^2
        u <- m / (sqrt(v) + eps) + weight_decay*w           (decay enters before the ratios)
        2+ dims:  s_ij = max(||w_i,:||/||u_i,:||, ||w_:,j||/||u_:,j||, ||w||/||u||)
                  and s_ij = 1 where any of the four row/column norms feeding it is zero
        < 2 dims: s = ||w||/||u||, or 1 if either is zero
        w <- w - lr * clamp(s*u, -clip, clip)

    so no element moves by more than ``lr*clip`` per step. ``||.||`` is the max-norm (largest
    absolute entry) or the l2-norm. Tensors with 3+ dims follow the authors' code: rows along
    dim 0, columns along dim 1, each index of the trailing dims being its own matrix for the row
    and column norms; the weight-wise ratio spans the whole tensor.

    Args:
        params: parameters or param groups; a group may override any keyword below.
        lr: learning rate, >= 0.
        betas: decay rates of the first and second moments, each in [0, 1).
        eps: added to sqrt(v), > 0.
        weight_decay: coefficient of the L2 term added to the update direction, >= 0.
        norm: ``"max"`` (MERIT) or ``"l2"`` (LAMB-style) norms in every ratio.
        elementwise: per-element ratios for 2+ dim tensors; False = one weight-wise ratio per
            tensor (``max-LAMB`` with ``norm="max"``, LAMB with ``norm="l2"``, ``clip=None``).
        weight_bound: floor the element-wise ratio by the weight-wise ratio.
        clip: bound on ``|s*u|`` (> 0), or None for no element-wise clipping.
        bias_correction: Adam's bias correction of m and v (off, as in the reference code).
        maximize: maximize the objective instead of minimizing it.
        implementation: None picks the best available path per parameter; or one of
            ``"reference"`` (readable single-tensor torch code; any device),
            ``"eager"`` (same math in fewer passes, one temporary of the parameter's size;
            default on non-CPU devices), ``"cpp"`` (fused two-pass C++/OpenMP CPU kernel; the
            default on CPU; built once per machine, ~2 s, cached in ``~/.cache/merit/kernels``),
            ``"compile"`` (torch.compile of the two passes; opt-in: the first step compiles
            every distinct parameter shape, ~40 s for GPT-2 small on a 2-core CPU with a cold
            Inductor cache, a few seconds with a warm one). Other tensor subclasses take
            the reference path; tensors the chosen path cannot take (e.g. 3+ dims or
            non-contiguous for ``"cpp"``) take the eager path.

    DTensor parameters (FSDP2's ``Shard(0)``, HSDP, tensor-parallel ``Shard(d)``, ``Replicate``)
    ignore ``implementation``: all of a group's DTensor parameters take one batched call of
    :func:`merit_core.optim.merit_sharded.merit_step_sharded`, exact on the global tensors
    with about one small all-reduce per step. Other placements (``Partial``,
    ``_StridedShard``) raise ``NotImplementedError`` naming the placement, before any state
    changes.

    State per parameter, exactly AdamW's: ``step`` (a CPU scalar tensor), ``exp_avg``,
    ``exp_avg_sq``. For bf16/fp16 parameters the moments are kept in fp32, all math is fp32,
    and the new weight is rounded to the parameter's dtype once.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        *,
        norm: str = "max",
        elementwise: bool = True,
        weight_bound: bool = True,
        clip: float | None = 1.0,
        bias_correction: bool = False,
        maximize: bool = False,
        implementation: str | None = None,
    ):
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            norm=norm,
            elementwise=elementwise,
            weight_bound=weight_bound,
            clip=clip,
            bias_correction=bias_correction,
            maximize=maximize,
            implementation=implementation,
        )
        _validate(defaults)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        """As torch's, but the group's hyperparameters and dtypes are checked before it is added."""
        where = f" (param group {len(self.param_groups)})"
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        _validate({**self.defaults, **{k: v for k, v in param_group.items() if k != "params"}}, where)
        for p in params:
            if isinstance(p, torch.Tensor) and p.dtype not in _SUPPORTED_DTYPES:
                raise TypeError(
                    f"MERIT supports float16, bfloat16, float32 and float64 parameters, "
                    f"got one of dtype {p.dtype}{where}"
                )
        super().add_param_group({**param_group, "params": params})

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        for group in self.param_groups:  # state dicts of other optimizers lack our keys
            for key, value in self.defaults.items():
                group.setdefault(key, value)

    def load_state_dict(self, state_dict: dict) -> None:
        """As torch's, but moments of bf16/fp16 parameters stay fp32 (torch would cast them)."""
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        keep = {}
        for saved_id, p in zip(saved_ids, params):
            st = state_dict["state"].get(saved_id)
            if st is not None and p.dtype in _LOW_PRECISION:
                keep[p] = {k: st[k] for k in ("exp_avg", "exp_avg_sq") if k in st}
        super().load_state_dict(state_dict)
        for p, moments in keep.items():
            for k, t in moments.items():
                self.state[p][k] = t.to(device=p.device, dtype=torch.float32)

    def _init_state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            dtype = torch.float32 if p.dtype in _LOW_PRECISION else p.dtype
            scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
            state["step"] = torch.tensor(0.0, dtype=scalar)
            state["exp_avg"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        """One optimization step; `closure` re-evaluates the model and returns the loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            sharded = []
            for p in group["params"]:
                grad = p.grad
                if grad is None:
                    continue
                if grad.is_sparse:
                    raise RuntimeError(
                        "MERIT does not support sparse gradients; use dense gradients (e.g. nn.Embedding(sparse=False))"
                    )
                state = self._init_state(p)
                if not _is_plain(p) and _is_dtensor(p):
                    sharded.append((p, grad, state))  # one batched step below; it counts the steps
                    continue
                state["step"] += 1  # a CPU tensor: reading it below is not a device sync
                h = _hyper(group, state["step"])
                _update(group["implementation"], p, grad, state["exp_avg"], state["exp_avg_sq"], h)
            if sharded:
                _sharded_update(group, sharded)
        return loss


def _hyper(group: dict, step_t: torch.Tensor) -> Hyper:
    beta1, beta2 = group["betas"]
    bc1 = bc2 = 1.0
    if group["bias_correction"]:
        step = float(step_t)
        bc1, bc2 = 1 - beta1**step, 1 - beta2**step
    return Hyper(
        lr=float(group["lr"]),
        beta1=float(beta1),
        beta2=float(beta2),
        eps=float(group["eps"]),
        weight_decay=float(group["weight_decay"]),
        bias_correction1=bc1,
        bias_correction2=bc2,
        clip=None if group["clip"] is None else float(group["clip"]),
        norm=group["norm"],
        elementwise=group["elementwise"],
        weight_bound=group["weight_bound"],
        maximize=group["maximize"],
    )


def _sharded_update(group: dict, items: list) -> None:
    """MERIT on a group's DTensor parameters: one call, statistics completed across shards."""
    from merit_core.optim.merit_sharded import merit_step_sharded

    beta1, beta2 = group["betas"]
    merit_step_sharded(
        [p for p, _, _ in items],
        [g for _, g, _ in items],
        [s["exp_avg"] for _, _, s in items],
        [s["exp_avg_sq"] for _, _, s in items],
        [s["step"] for _, _, s in items],
        lr=float(group["lr"]),
        beta1=float(beta1),
        beta2=float(beta2),
        eps=float(group["eps"]),
        weight_decay=float(group["weight_decay"]),
        norm=group["norm"],
        elementwise=group["elementwise"],
        weight_bound=group["weight_bound"],
        clip=None if group["clip"] is None else float(group["clip"]),
        bias_correction=group["bias_correction"],
        maximize=group["maximize"],
    )


def _is_dtensor(t: torch.Tensor) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _is_plain(t: torch.Tensor) -> bool:
    return type(t) in (torch.Tensor, torch.nn.Parameter)


def _update(impl: str | None, p, grad, exp_avg, exp_avg_sq, h: Hyper) -> None:
    if impl == "reference" or not (_is_plain(p) and type(grad) is torch.Tensor):
        return reference_update(p, grad, exp_avg, exp_avg_sq, h)  # other tensor subclasses land here
    if impl == "compile":
        from merit_core.optim.merit_compiled import compiled_update

        return compiled_update(p, grad, exp_avg, exp_avg_sq, h)
    if impl == "cpp" or (impl is None and p.device.type == "cpu"):
        lib = merit_kernels.load_kernel()
        if lib is None and impl == "cpp":
            raise RuntimeError(
                "MERIT(implementation='cpp'): the C++ CPU kernel is unavailable: "
                f"{merit_kernels.kernel_info()['error']}"
            )
        if lib is not None and merit_kernels.supports(lib, p, grad, exp_avg, exp_avg_sq):
            return _kernel_update(lib, p, grad, exp_avg, exp_avg_sq, h)
    return eager_update(p, grad, exp_avg, exp_avg_sq, h)


def _kernel_update(lib, p, grad, exp_avg, exp_avg_sq, h: Hyper) -> None:
    hyper = (ctypes.c_double * 8)(
        h.lr,
        h.beta1,
        h.beta2,
        h.eps,
        h.weight_decay,
        1 / h.bias_correction1,
        1 / math.sqrt(h.bias_correction2),
        math.inf if h.clip is None else h.clip,
    )
    flags = (
        (merit_kernels.FLAG_MAXIMIZE if h.maximize else 0)
        | (merit_kernels.FLAG_L2 if h.norm == "l2" else 0)
        | (merit_kernels.FLAG_ELEMENTWISE if h.elementwise else 0)
        | (merit_kernels.FLAG_BOUND if h.weight_bound else 0)
    )
    merit_kernels.kernel_step(lib, p, grad, exp_avg, exp_avg_sq, hyper, flags)


def _is_number(x) -> bool:
    return isinstance(x, Real) and not isinstance(x, bool) and math.isfinite(x)


def _validate(g: dict, where: str = "") -> None:
    """Raise ValueError naming the first hyperparameter outside its valid range."""

    def bad(name: str, valid: str):
        raise ValueError(f"MERIT: {name} must be {valid}, got {g[name]!r}{where}")

    if not (_is_number(g["lr"]) and g["lr"] >= 0):
        bad("lr", "a finite float >= 0")
    betas = g["betas"]
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2 and all(_is_number(b) and 0 <= b < 1 for b in betas)):
        bad("betas", "a pair of floats, each in [0, 1)")
    if not (_is_number(g["eps"]) and g["eps"] > 0):
        bad("eps", "a finite float > 0")
    if not (_is_number(g["weight_decay"]) and g["weight_decay"] >= 0):
        bad("weight_decay", "a finite float >= 0")
    if g["norm"] not in ("max", "l2"):
        bad("norm", "'max' or 'l2'")
    for flag in ("elementwise", "weight_bound", "bias_correction", "maximize"):
        if not isinstance(g[flag], bool):
            bad(flag, "True or False")
    clip = g["clip"]
    if clip is not None and not (isinstance(clip, Real) and not isinstance(clip, bool) and clip > 0):
        bad("clip", "a float > 0 or None")
    if g["implementation"] is not None and g["implementation"] not in IMPLEMENTATIONS:
        bad("implementation", "None or one of " + ", ".join(repr(i) for i in IMPLEMENTATIONS))
