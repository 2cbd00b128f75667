"""The functional MERIT step: one function, one backend chosen per call (per param group).

Like ``torch.optim.adam.adam``: the :class:`~merit_core.optim.merit.MERIT` optimizer validates
its hyperparameters and collects each group's tensor lists, then calls :func:`merit`, which
advances the step counters (the only place they move) and hands the lists to one backend.
It builds the one hyperparameter record of the call, :class:`~merit_core.optim.merit.common.Hyper`,
and every backend has the same signature::

    backend(params, grads, exp_avgs, exp_avg_sqs, state_steps, h)

with ``state_steps`` already advanced and ``h`` that record. Every backend follows the same rule
for NaN and infinities (:data:`~merit_core.optim.merit.common.NONFINITE_RULE`). The backends:

================  ==========================================================================
``"reference"``   readable single-tensor transcription (``reference.py``); any tensor
``"foreach"``     eager multi-tensor torch ops (``foreach.py``); the fallback on GPUs without
                  Triton, MPS and XPU; alias ``"eager"``
``"cpu"``         fused C++/OpenMP kernel as a custom op (``cpu.py``); the CPU default; alias
                  ``"cpp"``
``"compile"``     torch.compile of two passes per tensor (``compiled.py``); opt-in
``"triton"``      grouped Triton kernels; the CUDA default when triton imports
================  ==========================================================================

DTensor parameters (FSDP2 and friends) take the sharded path (``dtensor_step.py``), which runs the
``"cpu"`` kernel's two passes or torch ops on each local shard and completes the statistics
with one all-reduce per group. Other tensor subclasses take the reference backend.

``"fused"`` (what ``MERIT(fused=True)`` selects) is the fused kernel of the group's device:
``"cpu"`` on CPU tensors, ``"triton"`` on CUDA tensors.

Everything a backend needs of the group's tensors (device, dtype, contiguity, the moments'
dtype and layout) is checked before it is chosen and before the step counters move: an
explicit backend that cannot take the tensors raises ``ValueError`` saying why with nothing
changed; the default choice falls back (foreach) instead. The default also avoids a backend
that :func:`merit_core.optim.merit.verify.verify_backend` found to disagree with the reference on this
device (:func:`replace_default`).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from merit_core.optim.merit import cpu
from merit_core.optim.merit.common import BackendStep, Hyper, hyper_values, is_dtensor, is_plain, moment_misfit
from merit_core.optim.merit.compiled import merit_compiled
from merit_core.optim.merit.cpu import merit_cpu
from merit_core.optim.merit.dtensor_step import merit_sharded
from merit_core.optim.merit.foreach import merit_foreach
from merit_core.optim.merit.reference import merit_reference

ALIASES = {"eager": "foreach", "cpp": "cpu"}
_LOADED: dict[str, BackendStep] = {}
_TRITON: dict[str, bool] = {}


@dataclass(frozen=True)
class Backend:
    """A backend: its function (or "module:function", imported on first use) and what it cannot take."""

    name: str
    function: BackendStep | str  # or "module:function", imported on first use
    unavailable: Callable[[list[Tensor], list[Tensor]], str | None]

    def load(self) -> BackendStep:
        if callable(self.function):
            return self.function
        if self.name not in _LOADED:
            module, function = self.function.split(":")
            _LOADED[self.name] = getattr(importlib.import_module(module), function)
        return _LOADED[self.name]


def _plain(params, grads) -> str | None:
    if not all(is_plain(p) and type(g) is torch.Tensor for p, g in zip(params, grads)):
        return "it takes plain tensors, not DTensors or other tensor subclasses"
    return None


def _anything(params, grads) -> str | None:
    return None


def _cpu(params, grads) -> str | None:
    return cpu.unavailable(params, grads)


def _triton(params, grads) -> str | None:
    reason = _plain(params, grads)
    if reason:
        return reason
    if not _triton_installed():
        return "triton is not installed"
    devices = {p.device.type for p in params}
    if devices - {"cuda", "cpu"} or len(devices) != 1:
        return f"it runs on CUDA tensors (one device type per group), got {', '.join(sorted(devices))}"
    if devices == {"cpu"} and os.environ.get("TRITON_INTERPRET") != "1":
        return "CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1 before triton is imported"
    if any(p.dtype == torch.float64 for p in params):
        return "it does not support float64 parameters"
    shape = next((tuple(p.shape) for p in params if not p.is_contiguous()), None)
    if shape is not None:
        return f"its kernels address parameters as dense row-major arrays, got a non-contiguous one of shape {shape}"
    return None


def _triton_states(exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor]) -> str | None:
    """What the triton backend needs of the moments (fp32, contiguous), checked before a step runs."""
    for m, v in zip(exp_avgs, exp_avg_sqs):
        if m.dtype != torch.float32 or v.dtype != torch.float32:
            return f"its moments must be float32, got {m.dtype}, {v.dtype}"
        if not (m.is_contiguous() and v.is_contiguous()):
            return f"its moments must be contiguous, got a non-contiguous one of shape {tuple(m.shape)}"
    return None


def _triton_installed() -> bool:
    if "installed" not in _TRITON:
        _TRITON["installed"] = importlib.util.find_spec("triton") is not None  # does not import triton
    return _TRITON["installed"]


BACKENDS: dict[str, Backend] = {
    "reference": Backend("reference", merit_reference, _anything),
    "foreach": Backend("foreach", merit_foreach, _plain),
    "cpu": Backend("cpu", merit_cpu, _cpu),
    "compile": Backend("compile", merit_compiled, _plain),
    # a "module:function" string: triton is imported on first use only
    "triton": Backend("triton", "merit_core.optim.merit.triton.step:merit_triton", _triton),
}
IMPLEMENTATIONS = tuple(BACKENDS) + tuple(ALIASES) + ("fused",)
_warned: set = set()
# The default's replacement of a backend that verify.verify_backend found wrong on this device
# ({"triton": "foreach"}); empty unless it did.
_VERIFIED: dict[str, str] = {}


def _default(params: list[Tensor], grads: list[Tensor], states: tuple[list[Tensor], list[Tensor]] | None) -> str:
    devices = {p.device.type for p in params}
    if devices == {"cpu"}:
        if BACKENDS["cpu"].unavailable(params, grads) is None:
            return _VERIFIED.get("cpu", "cpu")  # (foreach where verify_backend found the kernel wrong)
    elif devices == {"cuda"}:
        reason = BACKENDS["triton"].unavailable(params, grads) or (states and _triton_states(*states))
        if reason is None:
            return _VERIFIED.get("triton", "triton")
        if reason != "triton is not installed" and reason not in _warned:
            _warned.add(reason)
            warnings.warn(f"MERIT: the triton backend cannot be used ({reason}); using foreach", stacklevel=4)
    return "foreach"


def replace_default(backend: str, instead: str | None) -> None:
    """Make the default choice use ``instead`` where it would pick ``backend`` (None: undo).

    Only the default choice changes; an explicit ``implementation=backend`` still runs it.
    :func:`merit_core.optim.merit.verify.verify_backend` calls this when ``backend`` disagrees with the
    reference step on this device."""
    if instead is None:
        _VERIFIED.pop(backend, None)
    else:
        _VERIFIED[backend] = instead


def choose(
    backend: str | None,
    params: list[Tensor],
    grads: list[Tensor],
    states: tuple[list[Tensor], list[Tensor]] | None = None,
) -> tuple[str, Callable, dict]:
    """(backend name, function, extra keyword arguments) for one group's tensors; ``states``, the
    moments (exp_avgs, exp_avg_sqs), are checked too when given.

    ``"fused"`` (torch's ``fused=True``) is the fused kernel of the tensors' device: ``"cpu"`` on
    CPU tensors, ``"triton"`` on CUDA tensors. Raises ValueError if an explicit ``backend`` is
    unknown or cannot take these tensors."""
    name = None if backend is None else ALIASES.get(backend, backend)
    if name == "fused":
        devices = {p.device.type for p in params}
        name = "cpu" if devices == {"cpu"} else "triton" if devices == {"cuda"} else None
        if name is None:
            raise ValueError(
                f"MERIT(fused=True) cannot be used: merit's fused kernels run on CPU or CUDA tensors "
                f"(one device type per group), got {', '.join(sorted(devices))}"
            )
    if name is not None and name not in BACKENDS:
        raise ValueError(f"MERIT: unknown implementation {backend!r}; one of {', '.join(IMPLEMENTATIONS)}")
    if any(is_dtensor(p) for p in params):
        return "sharded", merit_sharded, {"local": _sharded_local(name, params, grads)}
    if name is None:
        name = "reference" if _plain(params, grads) else _default(params, grads, states)
    else:
        reason = BACKENDS[name].unavailable(params, grads)
        if not reason and name == "triton" and states is not None:
            reason = _triton_states(*states)
        if reason:
            raise ValueError(f"MERIT(implementation={backend!r}) cannot be used: {reason}")
    return name, BACKENDS[name].load(), {}


def _sharded_local(name: str | None, params: list[Tensor], grads: list[Tensor]) -> str | None:
    """How the sharded path computes on local shards for an explicit backend (None: its own choice)."""
    if name in (None,):
        return None
    if name in ("reference", "foreach"):
        return "torch"
    if name == "cpu":
        local_p = [p.to_local() if is_dtensor(p) else p for p in params]
        local_g = [g.to_local() if is_dtensor(g) else g for g in grads]
        reason = BACKENDS["cpu"].unavailable(local_p, local_g)
        if reason:
            raise ValueError(f"MERIT(implementation='cpu') cannot be used on these shards: {reason}")
        return "cpu"
    raise ValueError(
        f"MERIT(implementation={name!r}) cannot be used: DTensor parameters take the sharded path, "
        "which runs 'cpu' or torch ('foreach'/'reference') on each shard"
    )


@torch.no_grad()
def merit(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    state_steps: list[Tensor],
    *,
    lr: float | Tensor,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    norm: str,
    elementwise: bool,
    weight_bound: bool,
    clip: float | None,
    bias_correction: bool,
    maximize: bool,
    backend: str | None = None,
) -> None:
    r"""One MERIT step of a group of parameters, in place. Functional API of :class:`MERIT`.

    For each parameter ``w`` with gradient ``g`` (step ``t``, after advancing it)::

        m <- b1*m + (1-b1)*g ;  v <- b2*v + (1-b2)*g^2      (g negated if maximize)
        u <- m_hat / (sqrt(v_hat) + eps) + weight_decay*w     (hats: bias correction, if on)
        2+ dims: s_ij = max(r_i, c_j[, b]), r_i = ||w_i,:|| / ||u_i,:||, c_j likewise, b = ||w|| / ||u||,
                 s_ij = 1 where any of the four row/column norms feeding it is zero
        < 2 dims (or elementwise=False): s = b, or 1 if either norm is zero
        w <- w - lr * clamp(s*u, -clip, clip)

    Args:
        params, grads, exp_avgs, exp_avg_sqs, state_steps: equal-length lists; moments in the
            parameter's dtype, fp32 for bf16/fp16 parameters; ``state_steps`` are CPU scalar
            tensors, advanced by 1 here.
        lr: float or 0-d tensor (a changing tensor lr never recompiles anything).
        backend: None (the best available for these tensors) or a name of :data:`BACKENDS`
            (aliases ``"eager"``, ``"cpp"``).

    Non-finite values: a parameter whose weight or update direction holds a NaN or an infinity
    becomes NaN in every element; its moments are updated element by element as usual (every
    backend, every ablation: :data:`~merit_core.optim.merit.common.NONFINITE_RULE`).

    Raises:
        ValueError: an explicit ``backend`` that cannot take these tensors, moments of another
            shape than their parameter, a ``norm`` other than "max"/"l2" or a ``clip`` <= 0
            (nothing changed).
    """
    if not params:
        return
    if not (len(grads) == len(exp_avgs) == len(exp_avg_sqs) == len(state_steps) == len(params)):
        raise ValueError("MERIT: params, grads, exp_avgs, exp_avg_sqs and state_steps differ in length")
    for i, (p, m, v) in enumerate(zip(params, exp_avgs, exp_avg_sqs)):
        if m.shape != p.shape or v.shape != p.shape:
            raise ValueError(
                f"MERIT: the state of parameter {i} of the group does not fit it: {moment_misfit(p, m, v)}"
            )
    h = Hyper.of(**hyper_values(locals()))  # the keywords above, as one record
    _, fn, extra = choose(backend, params, grads, (exp_avgs, exp_avg_sqs))  # everything checked, nothing changed
    torch._foreach_add_(state_steps, 1)
    fn(params, grads, exp_avgs, exp_avg_sqs, state_steps, h, **extra)
