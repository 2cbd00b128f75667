"""Muon as it is used in practice: ``torch.optim.Muon`` on the hidden weight matrices and
``torch.optim.AdamW`` on everything else (embeddings, the LM head, biases and norm gains, and
any tensor that is not 2-D), presented to the training loop as ONE ``torch.optim.Optimizer``.

The composite's ``param_groups`` are the very dicts of its two parts (Muon's first, then
AdamW's), each tagged ``use_muon``; so an LR scheduler, ``zero_grad``, gradient clipping and
``GradScaler.unscale_`` see every parameter, and ``state_dict()`` is an ordinary optimizer
state dict (ids in group order) that ``load_state_dict`` restores into both parts.

Which tensors are "hidden" is decided by :func:`muon_param_groups` (used by
``build_optimizer("muon", model)``) from :mod:`merit_core.optim.param_groups` roles: 2-D
``"hidden"`` tensors go to Muon; embeddings, the untied head, vectors and 3-D+ tensors to AdamW.
Given plain tensors (no module), every 2-D tensor counts as hidden -- including embeddings and
head, which Muon should not get -- so prefer passing the model.

Caveat: torch's default ``adjust_lr_fn`` ("original", Keller Jordan's) scales the lr by
``sqrt(max(1, rows / cols))`` of the *stored* shape, i.e. it assumes ``nn.Linear``'s
``[out, in]`` layout. GPT-2's ``Conv1D`` stores ``[in, out]``, so its 4x-wide MLP input weight
gets factor 1 instead of 2 (and the MLP output weight 2 instead of 1).
``adjust_lr_fn="match_rms_adamw"`` is symmetric in the two dims.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.optim import AdamW, Optimizer

from merit_core.errors import ConfigError
from merit_core.optim.closure import closure_loss
from merit_core.optim.param_groups import classify_parameters, decay_groups, make_group


def _muon_class() -> type[Optimizer]:
    """``torch.optim.Muon`` (torch 2.9+), imported when a Muon part is built so MERIT works on older torch."""
    try:
        from torch.optim import Muon
    except ImportError:
        raise ConfigError(
            f"optimizer 'muon' needs torch>=2.9 (torch.optim.Muon); this is torch {torch.__version__}"
        ) from None
    return Muon


def fast_adamw_options(params: Iterable[torch.Tensor]) -> dict[str, bool]:
    """``{"fused": True}`` when every tensor is a plain floating tensor on CPU or CUDA, else ``{"foreach": True}``.

    Decide after the model has been moved to its device: a fused AdamW keeps its step counters there.
    """
    params = list(params)
    plain = all(
        type(p) in (torch.Tensor, torch.nn.Parameter) and p.is_floating_point() and p.device.type in ("cpu", "cuda")
        for p in params
    )
    return {"fused": True} if plain and params else {"foreach": True}


def muon_param_groups(
    model_or_params: nn.Module | Any, adamw_weight_decay: float, *, decay_embeddings: bool = True
) -> list[dict[str, Any]]:
    """Groups for :class:`MuonWithAdamW`: ``"muon"`` (2-D hidden matrices), ``"adamw_decay"``, ``"adamw_no_decay"``.

    Embeddings, the untied LM head and 3-D+ tensors go to AdamW (decayed; embeddings and head
    only if ``decay_embeddings``); vectors to AdamW without decay. Empty groups are left out.
    """
    items = classify_parameters(model_or_params)
    muon = [i for i in items if i.role == "hidden" and i.param.ndim == 2]
    rest = [i for i in items if not (i.role == "hidden" and i.param.ndim == 2)]
    groups = [make_group("muon", muon, use_muon=True)] if muon else []
    return groups + decay_groups(rest, adamw_weight_decay, decay_embeddings, prefix="adamw_", use_muon=False)


def _split(params: Any) -> tuple[list[dict], list[dict]]:
    """Split tensors or group dicts (each with a bool ``use_muon``) into Muon and AdamW groups."""
    if isinstance(params, torch.Tensor):
        raise TypeError("params must be an iterable of tensors or of param-group dicts, not a tensor")
    items = list(params)
    if not items:
        raise ValueError("optimizer got an empty parameter list")
    if all(isinstance(i, dict) for i in items):
        groups = [dict(g) for g in items]
        for g in groups:
            if not isinstance(g.get("use_muon"), bool):
                raise ValueError("every param-group dict given to MuonWithAdamW needs use_muon=True/False")
    elif any(isinstance(i, dict) for i in items):
        raise TypeError("params must be all tensors or all param-group dicts, not a mix")
    else:
        muon = [p for p in items if p.ndim == 2]
        other = [p for p in items if p.ndim != 2]
        groups = [{"params": muon, "use_muon": True}] if muon else []
        groups += [{"params": other, "use_muon": False}] if other else []
    return [g for g in groups if g["use_muon"]], [g for g in groups if not g["use_muon"]]


class MuonWithAdamW(Optimizer):
    """``torch.optim.Muon`` for groups with ``use_muon=True``, ``torch.optim.AdamW`` for the others.

    Args:
        params: tensors (2-D ones go to Muon) or param-group dicts with ``use_muon``; a group may
            override its part's hyperparameters (``lr``, ``weight_decay``, ``betas``, ...).
        lr, momentum, nesterov, ns_steps, weight_decay, adjust_lr_fn: Muon's defaults
            (``torch.optim.Muon``; weight decay is decoupled, ``w *= 1 - lr * weight_decay``).
        adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay: AdamW's defaults.
        adamw_fused, adamw_foreach: AdamW's kernel choice; both None = :func:`fast_adamw_options`.
    """

    def __init__(
        self,
        params,
        lr: float = 0.02,
        momentum: float = 0.95,
        *,
        nesterov: bool = True,
        ns_steps: int = 5,
        weight_decay: float = 0.01,
        adjust_lr_fn: str | None = None,
        adamw_lr: float = 3e-4,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-10,
        adamw_weight_decay: float = 0.01,
        adamw_fused: bool | None = None,
        adamw_foreach: bool | None = None,
    ) -> None:
        muon_groups, adamw_groups = _split(params)
        self._muon_defaults: dict[str, Any] = dict(
            lr=lr,
            momentum=momentum,
            nesterov=nesterov,
            ns_steps=ns_steps,
            weight_decay=weight_decay,
            adjust_lr_fn=adjust_lr_fn,
        )
        self._adamw_defaults: dict[str, Any] = dict(
            lr=adamw_lr, betas=tuple(adamw_betas), eps=adamw_eps, weight_decay=adamw_weight_decay
        )
        kernel: Mapping[str, bool | None]
        if adamw_fused is None and adamw_foreach is None:
            kernel = fast_adamw_options(p for g in adamw_groups for p in g["params"])
        else:
            kernel = {"fused": adamw_fused, "foreach": adamw_foreach}
        self._adamw_defaults.update(kernel)
        self._muon = _muon_class()(muon_groups, **self._muon_defaults) if muon_groups else None
        self._adamw = AdamW(adamw_groups, **self._adamw_defaults) if adamw_groups else None
        # The composite owns the same group dicts as its parts; `defaults` stays empty because
        # each group was already completed by its part.
        self._initialized = False
        super().__init__([g for part in self._parts() for g in part.param_groups], defaults={})
        self._initialized = True
        self._link_parts()

    def _parts(self) -> list[Optimizer]:
        return [part for part in (self._muon, self._adamw) if part is not None]

    def _link_parts(self) -> None:
        """Point both parts at the composite's group dicts and its one state dict."""
        if self._muon is not None:
            self._muon.param_groups = [g for g in self.param_groups if g["use_muon"]]
            self._muon.state = self.state
        if self._adamw is not None:
            self._adamw.param_groups = [g for g in self.param_groups if not g["use_muon"]]
            self._adamw.state = self.state

    def __getstate__(self) -> dict[str, Any]:
        # torch's keeps defaults, state and param_groups only; a copy (deepcopy, pickle) needs the
        # parts too (they share the group dicts and the state, which the copy keeps shared)
        parts = ("_muon", "_adamw", "_muon_defaults", "_adamw_defaults", "_initialized")
        return {**super().__getstate__(), **{k: self.__dict__[k] for k in parts}}

    def __setstate__(self, state: dict[str, Any]) -> None:
        # load_state_dict() installs fresh group dicts and a fresh state through here.
        super().__setstate__(state)
        if "_muon" in self.__dict__:
            self._link_parts()
        for group in self.param_groups:  # a state dict that saved ``step`` as a number, as AdamW converts it
            on_device = group.get("fused") or group.get("capturable")
            for p in group["params"]:
                st = self.state.get(p)
                if isinstance(st, dict) and isinstance(st.get("step"), (int, float)):
                    st["step"] = torch.tensor(float(st["step"]), device=p.device if on_device else "cpu")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group; it goes to Muon when ``use_muon`` is True (default: the tensors are all 2-D)."""
        if not self.__dict__.get("_initialized", False):
            # Called by Optimizer.__init__ with groups that already belong to a part.
            super().add_param_group(param_group)
            return
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        use_muon = param_group.get("use_muon", all(p.ndim == 2 for p in params))
        group = {**param_group, "params": params, "use_muon": bool(use_muon)}
        if group["use_muon"]:
            if any(p.ndim != 2 for p in params):
                raise ValueError("Muon only supports 2-D parameters; add this group with use_muon=False")
            if self._muon is None:
                self._muon = _muon_class()([group], **self._muon_defaults)
            else:
                self._muon.add_param_group(group)
        else:
            if self._adamw is None:
                self._adamw = AdamW([group], **self._adamw_defaults)
            else:
                self._adamw.add_param_group(group)
        super().add_param_group(group)
        # keep Muon's groups before AdamW's, as at construction
        self.param_groups.sort(key=lambda g: not g["use_muon"])
        self._link_parts()

    @torch.no_grad()
    def step(self, closure=None):
        """Step Muon, then AdamW; returns the closure's loss (evaluated once)."""
        loss = closure_loss(closure)
        for part in self._parts():
            part.step()
        return loss
