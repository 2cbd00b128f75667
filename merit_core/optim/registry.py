"""Name -> optimizer: MERIT, the paper's ablations of it, and the baselines it is compared against.

``build_optimizer(name, model_or_params, **hparams)`` builds one, with weight-decay param groups
from :mod:`merit_core.optim.param_groups` (no decay on 1-D tensors; embeddings and the LM head
decayed unless ``decay_embeddings=False``). Names are case-insensitive and ``_`` equals ``-``.
Every user mistake (unknown name, unknown or mistyped hyperparameter, a value of the wrong type or
out of range) raises :class:`~merit_core.errors.ConfigError` with one actionable line.

The defaults are starting points for a learning-rate grid, not tuned values (see each spec).
Third-party and torch optimizers are imported only when built (pytorch_optimizer takes seconds).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from numbers import Real
from typing import Any

from torch import nn
from torch.optim import Optimizer

from merit_core.errors import ConfigError
from merit_core.optim.param_groups import build_param_groups


@dataclass(frozen=True)
class OptimizerSpec:
    """One registry entry: the hyperparameters a user may set (with defaults) and how to build it."""

    name: str
    summary: str
    defaults: Mapping[str, Any]
    builder: Callable[[str, Any, dict[str, Any]], Optimizer]
    fixed: Mapping[str, Any] = field(default_factory=dict)  # switches that define a variant; not settable


# How each hyperparameter is type-checked (the same names mean the same thing everywhere).
_KINDS = {
    **dict.fromkeys(
        ("lr", "eps", "weight_decay", "rho", "momentum", "adamw_lr", "adamw_eps", "adamw_weight_decay"), "float"
    ),
    **dict.fromkeys(("betas", "adamw_betas"), "pair"),
    **dict.fromkeys(("ns_steps", "hessian_interval"), "int"),
    **dict.fromkeys(
        (
            "maximize",
            "nesterov",
            "elementwise",
            "weight_bound",
            "bias_correction",
            "decay_embeddings",
            "weight_decouple",
        ),
        "bool",
    ),
    **dict.fromkeys(("fused", "foreach"), "bool?"),
    "clip": "float?",
    "norm": "str",
    **dict.fromkeys(("adjust_lr_fn", "implementation"), "str?"),
}
_KIND_TEXT = {
    "float": "a number",
    "float?": "a number or None",
    "pair": "a pair of numbers",
    "int": "an integer",
    "bool": "true or false",
    "bool?": "true, false or None",
    "str": "a string",
    "str?": "a string or None",
}


def _coerce(optimizer: str, key: str, value: Any) -> Any:
    kind = _KINDS[key]
    if value is None and kind.endswith("?"):
        return None
    base = kind.rstrip("?")
    ok = False
    if base == "float":
        ok = isinstance(value, Real) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif base == "int":
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif base == "bool":
        ok = isinstance(value, bool)
    elif base == "str":
        ok = isinstance(value, str)
    elif base == "pair":
        ok = (
            isinstance(value, (list, tuple))
            and len(value) == 2
            and all(isinstance(v, Real) and not isinstance(v, bool) for v in value)
        )
        value = tuple(float(v) for v in value) if ok else value
    if not ok:
        raise ConfigError(f"optimizer '{optimizer}': hyperparameter '{key}' must be {_KIND_TEXT[kind]}, got {value!r}")
    return value


def _construct(optimizer: str, cls: type, *args: Any, **kwargs: Any) -> Optimizer:
    """Call an optimizer constructor, turning its validation errors into a ConfigError."""
    try:
        return cls(*args, **kwargs)
    except (ValueError, TypeError, IndexError) as e:
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"optimizer '{optimizer}': invalid hyperparameters: {message}") from e


# ---------------------------------------------------------------------------------------------
# builders: (registry name, model_or_params, resolved hparams incl. fixed switches) -> optimizer


def _decay_groups(model_or_params: Any, hp: dict[str, Any]) -> list[dict[str, Any]]:
    """Decay / no-decay groups; consumes the registry-only ``decay_embeddings`` from ``hp``."""
    return build_param_groups(model_or_params, hp["weight_decay"], decay_embeddings=hp.pop("decay_embeddings"))


def _build_merit(name: str, model_or_params: Any, hp: dict[str, Any]) -> Optimizer:
    from merit_core.optim.merit import MERIT

    groups = _decay_groups(model_or_params, hp)
    return _construct(name, MERIT, groups, **hp)


def _build_adamw(name: str, model_or_params: Any, hp: dict[str, Any]) -> Optimizer:
    from torch.optim import AdamW

    from merit_core.optim.muon import fast_adamw_options

    groups = _decay_groups(model_or_params, hp)
    fused, foreach = hp.pop("fused"), hp.pop("foreach")
    if fused is None and foreach is None:
        kernel = fast_adamw_options(p for g in groups for p in g["params"])
    else:
        kernel = {"fused": fused, "foreach": foreach}
    return _construct(name, AdamW, groups, **hp, **kernel)


def _build_lamb(name: str, model_or_params: Any, hp: dict[str, Any]) -> Optimizer:
    from pytorch_optimizer import Lamb

    groups = _decay_groups(model_or_params, hp)
    return _construct(name, Lamb, groups, **hp)


def _build_lion(name: str, model_or_params: Any, hp: dict[str, Any]) -> Optimizer:
    from pytorch_optimizer import Lion

    groups = _decay_groups(model_or_params, hp)
    return _construct(name, Lion, groups, **hp)


def _build_sophiag(name: str, model_or_params: Any, hp: dict[str, Any]) -> Optimizer:
    from merit_core.optim.sophia import SophiaG

    groups = _decay_groups(model_or_params, hp)
    return _construct(name, SophiaG, groups, **hp)


def _build_muon(name: str, model_or_params: Any, hp: dict[str, Any]) -> Optimizer:
    from merit_core.optim.muon import MuonWithAdamW, muon_param_groups

    groups = muon_param_groups(model_or_params, hp["adamw_weight_decay"], decay_embeddings=hp.pop("decay_embeddings"))
    return _construct(name, MuonWithAdamW, groups, **hp)


# ---------------------------------------------------------------------------------------------
# the registry

_MERIT_SWITCHES = ("norm", "elementwise", "weight_bound", "clip")
# The reference README's language-model example: lr 2e-4, betas (0.9, 0.95), weight decay 1e-2.
_MERIT_DEFAULTS = dict(
    lr=2e-4,
    betas=(0.9, 0.95),
    eps=1e-6,
    weight_decay=1e-2,
    norm="max",
    elementwise=True,
    weight_bound=True,
    clip=1.0,
    bias_correction=False,
    maximize=False,
    implementation=None,
    decay_embeddings=True,
)
# nanoGPT's GPT-2 recipe.
_ADAMW_DEFAULTS = dict(
    lr=6e-4,
    betas=(0.9, 0.95),
    eps=1e-8,
    weight_decay=0.1,
    maximize=False,
    fused=None,
    foreach=None,
    decay_embeddings=True,
)
# Same betas / eps / decay as MERIT, so the two differ only in the ratio; the library's default lr.
_LAMB_DEFAULTS = dict(
    lr=1e-3,
    betas=(0.9, 0.95),
    eps=1e-6,
    weight_decay=1e-2,
    weight_decouple=False,
    maximize=False,
    decay_embeddings=True,
)
# Lion paper's advice: lr 3-10x below AdamW's, decay 3-10x above (here lr*wd = 6e-5 as AdamW's),
# betas (0.95, 0.98) for language-model stability.
_LION_DEFAULTS = dict(lr=1e-4, betas=(0.95, 0.98), weight_decay=0.6, maximize=False, decay_embeddings=True)
# The official SophiaG class defaults (lr 1e-4, betas, rho 0.04 at B = 5120, wd 0.1, k = 10);
# rho re-expressed per sampled token, see merit_core.optim.sophia.
_SOPHIAG_DEFAULTS = dict(
    lr=1e-4,
    betas=(0.965, 0.99),
    rho=4e-4,
    weight_decay=0.1,
    eps=1e-12,
    hessian_interval=10,
    maximize=False,
    decay_embeddings=True,
)
# Keller Jordan's Muon README (MuonWithAuxAdam example): Muon lr 0.02, wd 0.01, momentum 0.95,
# nesterov, 5 Newton-Schulz steps; AdamW lr 3e-4, betas (0.9, 0.95), wd 0.01, eps 1e-10.
_MUON_DEFAULTS = dict(
    lr=0.02,
    momentum=0.95,
    nesterov=True,
    ns_steps=5,
    weight_decay=0.01,
    adjust_lr_fn=None,
    adamw_lr=3e-4,
    adamw_betas=(0.9, 0.95),
    adamw_eps=1e-10,
    adamw_weight_decay=0.01,
    decay_embeddings=True,
)


def _merit_variant(name: str, summary: str, **switches: Any) -> OptimizerSpec:
    fixed = {k: _MERIT_DEFAULTS[k] for k in _MERIT_SWITCHES} | switches
    settable = {k: v for k, v in _MERIT_DEFAULTS.items() if k not in _MERIT_SWITCHES}
    return OptimizerSpec(name, summary, settable, _build_merit, fixed)


_SPECS: dict[str, OptimizerSpec] = {
    spec.name: spec
    for spec in (
        OptimizerSpec(
            "merit",
            "MERIT: max-norm element-wise trust ratios, clipped (Luo et al. 2025)",
            _MERIT_DEFAULTS,
            _build_merit,
        ),
        OptimizerSpec(
            "adamw",
            "torch AdamW, decoupled decay (fused kernel on CPU/CUDA, else foreach)",
            _ADAMW_DEFAULTS,
            _build_adamw,
        ),
        OptimizerSpec(
            "lamb",
            "pytorch_optimizer Lamb (step / (1 - b1^t)); decay inside the trust-ratio update",
            _LAMB_DEFAULTS,
            _build_lamb,
        ),
        OptimizerSpec(
            "lion", "pytorch_optimizer Lion: signed momentum updates, decoupled decay", _LION_DEFAULTS, _build_lion
        ),
        OptimizerSpec(
            "sophiag",
            "Sophia-G (Liu et al. 2023); the loop refreshes its Hessian every hessian_interval",
            _SOPHIAG_DEFAULTS,
            _build_sophiag,
        ),
        OptimizerSpec(
            "muon",
            "torch Muon on 2-D hidden weights + AdamW (adamw_*) on embeddings, head and 1-D params",
            _MUON_DEFAULTS,
            _build_muon,
        ),
        _merit_variant("merit-noclip", "MERIT ablation: no element-wise clipping", clip=None),
        _merit_variant(
            "merit-nobound", "MERIT ablation: no weight-wise ratio bound (s = max(r_i, c_j))", weight_bound=False
        ),
        _merit_variant("max-lamb", "MERIT ablation: one max-norm weight-wise ratio per tensor", elementwise=False),
        _merit_variant("l2-merit", "MERIT ablation: l2-norm ratios, element-wise construction", norm="l2"),
        _merit_variant(
            "lamb-ref",
            "LAMB as MERIT's ablation: l2-norm, weight-wise, no clip, no bias correction",
            norm="l2",
            elementwise=False,
            clip=None,
        ),
    )
}

OPTIMIZER_NAMES: tuple[str, ...] = tuple(_SPECS)


def canonical_name(name: str) -> str:
    """The registry name for ``name`` (case-insensitive, ``_`` == ``-``); ConfigError if there is none."""
    if not isinstance(name, str):
        raise ConfigError(f"optimizer name must be a string, got {name!r}; valid: {', '.join(OPTIMIZER_NAMES)}")
    key = name.strip().lower().replace("_", "-")
    if key in _SPECS:
        return key
    close = difflib.get_close_matches(key, OPTIMIZER_NAMES, n=1, cutoff=0.5)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    raise ConfigError(f"unknown optimizer '{name}'{hint}; valid names: {', '.join(OPTIMIZER_NAMES)}")


def get_spec(name: str) -> OptimizerSpec:
    """The registry entry for ``name`` (see :func:`canonical_name`)."""
    return _SPECS[canonical_name(name)]


def default_hparams(name: str) -> dict[str, Any]:
    """The settable hyperparameters of optimizer ``name`` and their defaults (a fresh dict)."""
    return dict(get_spec(name).defaults)


def fixed_hparams(name: str) -> dict[str, Any]:
    """The MERIT switches a variant fixes (empty for non-variants), e.g. ``{"clip": None, ...}``."""
    return dict(get_spec(name).fixed)


def optimizer_summary(name: str) -> str:
    """One line describing optimizer ``name`` (for ``--optimizer`` help and run logs)."""
    return get_spec(name).summary


def resolve_hparams(name: str, **hparams: Any) -> dict[str, Any]:
    """Defaults of ``name`` overridden by ``hparams``, type-checked; ConfigError on unknown or fixed keys.

    Keys may use ``-`` for ``_``. Values are checked for type only; ranges are checked by the
    optimizer's constructor when it is built.
    """
    spec = get_spec(name)
    resolved = dict(spec.defaults)
    for raw_key, value in hparams.items():
        key = raw_key.replace("-", "_")
        if key in spec.fixed:
            raise ConfigError(
                f"optimizer '{spec.name}' fixes '{key}' to {spec.fixed[key]!r} (that is the ablation); "
                f"use 'merit' with {key}=... to set it"
            )
        if key not in spec.defaults:
            close = difflib.get_close_matches(key, list(spec.defaults), n=1, cutoff=0.6)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(
                f"unknown hyperparameter '{raw_key}' for optimizer '{spec.name}'{hint}; "
                f"accepted: {', '.join(spec.defaults)}"
            )
        resolved[key] = _coerce(spec.name, key, value)
    return resolved


def build_optimizer(name: str, model_or_params: nn.Module | Any, **hparams: Any) -> Optimizer:
    """Build registry optimizer ``name`` over a model (preferred) or an iterable of (named) parameters.

    Given a model, embeddings and the LM head are recognised by module type (see
    :mod:`merit_core.optim.param_groups`); given bare tensors, every 2-D+ tensor counts as hidden.
    Build after moving the model to its device (AdamW picks its fused kernel from the devices).
    """
    spec = get_spec(name)
    hp = resolve_hparams(spec.name, **hparams) | dict(spec.fixed)
    return spec.builder(spec.name, model_or_params, hp)
