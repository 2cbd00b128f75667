"""The builders of the registry's optimizers: ``(registry name, model_or_params, hparams) ->
Optimizer``, where ``hparams`` are the resolved and type-checked defaults and overrides plus a
variant's fixed switches (see :class:`merit_core.optim.registry.OptimizerSpec`). A new
optimizer's builder uses :func:`decay_groups` and :func:`construct` as these do. Third-party optimizers
are imported only when built (importing pytorch_optimizer is slow)."""

from __future__ import annotations

from typing import Any

from torch.optim import AdamW, Optimizer

from merit_core.errors import ConfigError
from merit_core.extras import require
from merit_core.optim.merit import MERIT
from merit_core.optim.muon import MuonWithAdamW, fast_adamw_options, muon_param_groups
from merit_core.optim.param_groups import build_param_groups
from merit_core.optim.sophia import SophiaG


def construct(optimizer: str, cls: type, *args: Any, **kwargs: Any) -> Optimizer:
    """Call an optimizer constructor, turning its validation errors into a ConfigError."""
    try:
        return cls(*args, **kwargs)
    except (ValueError, TypeError, IndexError) as e:
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"optimizer '{optimizer}': invalid hyperparameters: {message}") from e


def decay_groups(model_or_params: Any, hp: dict[str, Any]) -> list[dict[str, Any]]:
    """Decay / no-decay groups (no decay on 1-D tensors; embeddings and the LM head decayed unless
    ``decay_embeddings=False``); consumes the registry-only ``decay_embeddings`` from ``hp``."""
    return build_param_groups(model_or_params, hp["weight_decay"], decay_embeddings=hp.pop("decay_embeddings"))


def build_merit(name: str, model_or_params: Any, hp: dict[str, Any]) -> Optimizer:
    groups = decay_groups(model_or_params, hp)
    return construct(name, MERIT, groups, **hp)


def build_adamw(name: str, model_or_params: Any, hp: dict[str, Any]) -> Optimizer:
    groups = decay_groups(model_or_params, hp)
    fused, foreach = hp.pop("fused"), hp.pop("foreach")
    if fused is None and foreach is None:
        kernel = fast_adamw_options(p for g in groups for p in g["params"])
    else:
        kernel = {"fused": fused, "foreach": foreach}
    return construct(name, AdamW, groups, **hp, **kernel)


def build_lamb(name: str, model_or_params: Any, hp: dict[str, Any]) -> Optimizer:
    Lamb = require("pytorch_optimizer", "optimizer 'lamb'", "'merit-optim[baselines]'").Lamb
    groups = decay_groups(model_or_params, hp)
    return construct(name, Lamb, groups, **hp)


def build_lion(name: str, model_or_params: Any, hp: dict[str, Any]) -> Optimizer:
    Lion = require("pytorch_optimizer", "optimizer 'lion'", "'merit-optim[baselines]'").Lion
    groups = decay_groups(model_or_params, hp)
    return construct(name, Lion, groups, **hp)


def build_sophiag(name: str, model_or_params: Any, hp: dict[str, Any]) -> Optimizer:
    groups = decay_groups(model_or_params, hp)
    return construct(name, SophiaG, groups, **hp)


def build_muon(name: str, model_or_params: Any, hp: dict[str, Any]) -> Optimizer:
    groups = muon_param_groups(model_or_params, hp["adamw_weight_decay"], decay_embeddings=hp.pop("decay_embeddings"))
    return construct(name, MuonWithAdamW, groups, **hp)
