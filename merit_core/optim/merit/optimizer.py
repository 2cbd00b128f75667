"""MERIT: Maximum-normalized Element-wise Ratio for large-batch training (Luo et al., ICML 2025).

The optimizer class: it validates hyperparameters, creates state lazily and collects each param
group's tensor lists for the functional core (:func:`merit_core.optim.merit.functional.merit`).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from numbers import Real

import torch
from torch.optim import Optimizer

from merit_core.optim.merit import cpu
from merit_core.optim.merit.common import (
    HYPER_KEYS,
    LOW_PRECISION,
    Hyper,
    hyper_values,
    is_plain,
    moment_misfit,
    state_dtype,
)
from merit_core.optim.merit.functional import IMPLEMENTATIONS, merit
from merit_core.optim.merit.reference import zero_gradient_update

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
        lr: learning rate, >= 0. No single value serves every model size and batch: choose it
            with :func:`merit_core.optim.registry.default_lr` (measured lrs per model and batch,
            square-root scaled in between; e.g. 2e-3 for GPT-2 small at batch 64 x 1024) or a
            `merit compare` lr grid. The constructor's defaults (lr 1e-3, betas (0.9, 0.999),
            weight_decay 0) are the reference code's, so ``MERIT(params)`` behaves as it does;
            the registry (``build_optimizer("merit", ...)``, `merit train`) uses a measured lr
            and the reference README's language-model betas (0.9, 0.95) and weight_decay 1e-2.
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
        implementation: the backend; None picks the best available one per param group:
            ``"triton"`` on CUDA when triton imports (grouped kernels), ``"cpu"`` on CPU (fused
            two-pass C++/OpenMP kernel, built once per machine and cached in
            ``~/.cache/merit/kernels``), ``"foreach"`` elsewhere (eager multi-tensor torch ops).
            Or one of those names, ``"reference"`` (readable single-tensor torch code; any
            tensor) or ``"compile"`` (torch.compile of two passes per tensor; opt-in: the first
            step compiles every distinct parameter shape). ``"eager"`` and ``"cpp"`` are
            accepted aliases of ``"foreach"`` and ``"cpu"``. An explicit backend that cannot
            take a group's tensors raises ``ValueError`` saying why; ``"triton"`` on CPU
            tensors needs ``TRITON_INTERPRET=1``. Other tensor subclasses take the reference
            backend. The default choice also avoids a fused backend that ``merit check``'s
            short form (:func:`merit_core.optim.merit.verify.verify_backend`, which
            `merit train` runs) found wrong on this device: foreach instead.
        foreach, fused: torch's spellings, mapped onto the backends (give them or
            ``implementation``, not both): ``fused=True`` is the fused kernel of each group's
            device (``"cpu"`` on CPU, ``"triton"`` on CUDA; ``ValueError`` elsewhere);
            ``foreach=True`` or ``fused=False`` is ``"foreach"``; ``foreach=False`` is
            ``"reference"`` (a for-loop over tensors, as torch's); both True is refused.
        capturable: accepted; every backend already keeps the step free of host syncs (step
            counters on the CPU, a tensor lr read on the device). True with
            ``bias_correction=True`` is refused: the correction reads the step on the host.
        differentiable: only False; True raises ``ValueError`` (the step is not differentiable).

    DTensor parameters (FSDP2's ``Shard(0)``, HSDP, tensor-parallel ``Shard(d)``, ``Replicate``)
    take the sharded path (:func:`merit_core.optim.merit.dtensor_step.merit_sharded`): the C++
    kernel's two passes (or torch ops off the CPU, or with ``implementation="foreach"``) on each
    local shard, exact on the global tensors with one small all-reduce per group and step.
    Other placements (``Partial``, ``_StridedShard``) raise ``NotImplementedError`` naming the
    placement, before any state changes.

    Non-finite values, one rule in every backend and for every ablation: a parameter whose
    weight or update direction holds a NaN or an infinity (a NaN/inf gradient, moment or weight
    entry) becomes NaN in every element after the step, so the next loss shows it; its moments
    are updated element by element as usual (non-finite exactly where the gradient was). Other
    parameters are unaffected. (For ``norm="l2"`` a tensor-wide sum of squares that overflows
    counts as non-finite too; where it overflows depends on the backend's accumulator.)

    ``lr`` may be a 0-d tensor, as in AdamW (the compiled-optimizer recipe): changing its
    value never recompiles a kernel.

    State per parameter, exactly AdamW's: ``step`` (a CPU scalar tensor, also after
    ``load_state_dict`` of a state dict loaded with ``map_location``), ``exp_avg``,
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
        foreach: bool | None = None,
        fused: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
    ):
        implementation = _torch_flags(implementation, foreach, fused, capturable, differentiable, bias_correction)
        defaults = {**hyper_values(locals()), "implementation": implementation}
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
        super().__setstate__(state)  # (torch's adds "differentiable" to the defaults, never to a group here)
        for group in self.param_groups:  # state dicts of other optimizers lack our keys
            for key in (*HYPER_KEYS, "implementation"):
                group.setdefault(key, self.defaults[key])
        for st in self.state.values():  # a state dict of an old torch or a hand-made one: step as a number
            if isinstance(st, dict) and isinstance(st.get("step"), Real):
                st["step"] = torch.tensor(float(st["step"]), dtype=_step_dtype())

    def load_state_dict(self, state_dict: dict) -> None:
        """As torch's, but moments of bf16/fp16 parameters stay fp32 (torch would cast them) and
        ``step`` stays on the CPU whatever ``map_location`` put it on (on a GPU each step would
        cost a launch per parameter, and a sync with bias correction); a ``step`` saved as a number
        becomes a CPU tensor. Load pre-hooks run first, as in torch; post-hooks run after these
        fix-ups, so a hook sees the state the next step will use."""
        pre_hooks, post_hooks = self._optimizer_load_state_dict_pre_hooks, self._optimizer_load_state_dict_post_hooks
        state_dict = state_dict.copy()
        for pre_hook in pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        saved_groups = state_dict["param_groups"]
        same_layout = len(saved_groups) == len(self.param_groups) and all(
            len(s["params"]) == len(g["params"]) for s, g in zip(saved_groups, self.param_groups)
        )  # otherwise torch's own check below names what differs
        saved_ids = [i for g in saved_groups for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        group_of = [k for k, g in enumerate(self.param_groups) for _ in g["params"]]
        keep = {}
        for index, (saved_id, p) in enumerate(zip(saved_ids, params)):
            st = state_dict["state"].get(saved_id)
            misfit = moment_misfit(p, st.get("exp_avg"), st.get("exp_avg_sq")) if isinstance(st, dict) else None
            if misfit and same_layout:  # refused before any state changes (torch's step would fail later)
                raise ValueError(
                    f"MERIT.load_state_dict: the loaded state of parameter {index} (param group {group_of[index]}) "
                    f"does not fit it: {misfit}"
                )
            if isinstance(st, dict) and p.dtype in LOW_PRECISION:
                keep[p] = {k: st[k] for k in ("exp_avg", "exp_avg_sq") if isinstance(st.get(k), torch.Tensor)}
        self._optimizer_load_state_dict_pre_hooks, self._optimizer_load_state_dict_post_hooks = (
            OrderedDict(),
            OrderedDict(),
        )
        try:
            super().load_state_dict(state_dict)
        finally:
            self._optimizer_load_state_dict_pre_hooks = pre_hooks
            self._optimizer_load_state_dict_post_hooks = post_hooks
        for p, moments in keep.items():
            for k, t in moments.items():
                self.state[p][k] = t.to(device=p.device, dtype=torch.float32)
        for st in self.state.values():
            step = st.get("step") if isinstance(st, dict) else None
            if isinstance(step, torch.Tensor) and step.device.type != "cpu":
                st["step"] = step.to("cpu")
        for post_hook in post_hooks.values():
            post_hook(self)

    def _init_group(self, group, params, grads, exp_avgs, exp_avg_sqs, state_steps) -> None:
        """Collect the group's parameters that have gradients, creating their state on first use.

        Named as in torch's optimizers: torch.compile runs this method eagerly and guards on its
        result instead of tracing it, so a compiled training step does not recompile per parameter."""
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError(
                    "MERIT does not support sparse gradients; use dense gradients (e.g. nn.Embedding(sparse=False))"
                )
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=_step_dtype())  # on the CPU: reading it is no device sync
                state["exp_avg"] = torch.zeros_like(p, dtype=state_dtype(p), memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, dtype=state_dtype(p), memory_format=torch.preserve_format)
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            state_steps.append(state["step"])
        if not cpu.kernel_loaded() and group["implementation"] in (None, "cpu", "cpp"):
            if any(p.device.type == "cpu" for p in params):
                cpu.load_kernel()  # build or load it here: torch.compile runs _init_group eagerly

    @torch.no_grad()
    def step(self, closure=None):
        """One optimization step; `closure` re-evaluates the model and returns the loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, exp_avgs, exp_avg_sqs, state_steps = [], [], [], [], []
            self._init_group(group, params, grads, exp_avgs, exp_avg_sqs, state_steps)
            hyper = hyper_values(group)  # the functional API's keywords
            merit(params, grads, exp_avgs, exp_avg_sqs, state_steps, **hyper, backend=group["implementation"])
        return loss

    @torch.no_grad()
    def update_ratios(self) -> list[tuple[torch.Tensor, float]]:
        """(parameter, RMS(update) / RMS(weight)) of the next step with a zero gradient, at the groups'
        current lr, for each parameter with state (plain tensors only; a DTensor shard is skipped).

        The update is the reference step's (``zero_gradient_update``), computed one parameter at a
        time on temporaries: nothing in the parameters or the state changes. It is the quantity
        ``merit inspect`` reports from a checkpoint (docs/DIAGNOSTICS.md), measured live."""
        out = []
        for group in self.param_groups:
            h = Hyper.of_group(group)
            for p in group["params"]:
                state = self.state.get(p)
                if not state or not is_plain(p):
                    continue
                update = zero_gradient_update(p, state["exp_avg"], state["exp_avg_sq"], state["step"], h)
                w = p.to(update.dtype)
                w_rms = float(w.double().pow(2).mean().sqrt())
                out.append((p, float(update.double().pow(2).mean().sqrt()) / w_rms if w_rms > 0 else math.inf))
        return out


def _step_dtype() -> torch.dtype:
    """The step counter's dtype, as torch's optimizers choose it (float64 under a float64 default)."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _torch_flags(
    implementation: str | None,
    foreach: bool | None,
    fused: bool | None,
    capturable: bool,
    differentiable: bool,
    bias_correction: bool,
) -> str | None:
    """The backend that torch's ``foreach=``/``fused=``/``capturable=``/``differentiable=`` ask for
    (see MERIT's docstring), or ``implementation`` when none of them is set.

    Raises ValueError for combinations torch refuses too and for what merit cannot honour."""
    if differentiable:
        raise ValueError(
            "MERIT: differentiable=True is not supported (its steps run under torch.no_grad, and the fused kernels "
            "have no backward); use differentiable=False"
        )
    for name, value in (("foreach", foreach), ("fused", fused)):
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"MERIT: {name} must be True, False or None, got {value!r}")
    if not isinstance(capturable, bool):
        raise ValueError(f"MERIT: capturable must be True or False, got {capturable!r}")
    if capturable and bias_correction:
        raise ValueError(
            "MERIT: capturable=True needs bias_correction=False (the bias correction reads the step counter, "
            "which MERIT keeps on the CPU, on the host)"
        )
    if foreach is None and fused is None:
        return implementation
    if implementation is not None:
        raise ValueError("MERIT: give implementation= or torch's foreach=/fused=, not both")
    if foreach and fused:
        raise ValueError("MERIT: `fused` and `foreach` cannot be `True` together.")
    if fused:
        return "fused"
    if foreach:
        return "foreach"
    return "reference" if foreach is False else "foreach"  # foreach=False: a for-loop over tensors


def _is_number(x) -> bool:
    return isinstance(x, Real) and not isinstance(x, bool) and math.isfinite(x)


def _validate(g: dict, where: str = "") -> None:
    """Raise ValueError naming the first hyperparameter outside its valid range."""

    def bad(name: str, valid: str):
        raise ValueError(f"MERIT: {name} must be {valid}, got {g[name]!r}{where}")

    lr = g["lr"]
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError(f"MERIT: Tensor lr must be 1-element, got shape {tuple(lr.shape)}{where}")
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1 or not lr.is_floating_point() or not (math.isfinite(float(lr)) and float(lr) >= 0):
            bad("lr", "a finite float >= 0 or a 0-d float tensor holding one")
    elif not (_is_number(lr) and lr >= 0):
        bad("lr", "a finite float >= 0 or a 0-d float tensor holding one")
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
    if clip is not None and not (isinstance(clip, Real) and not isinstance(clip, bool) and float(clip) > 0):
        bad("clip", "a float > 0 or None")
    if g["implementation"] is not None and g["implementation"] not in IMPLEMENTATIONS:
        bad("implementation", "None or one of " + ", ".join(repr(i) for i in IMPLEMENTATIONS))
