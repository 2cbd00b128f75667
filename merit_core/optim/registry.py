"""Name -> optimizer: MERIT, the paper's ablations of it, and the baselines it is compared against.

Every registry name has one :class:`OptimizerSpec`, the only place that knows what the rest of
the project needs about that optimizer: how to build it, its settable hyperparameters with their
defaults and kinds, its measured learning rates (or, unmeasured, the centre of compare's lr grid;
or the name whose lrs it shares), whether it trains FSDP2 shards, and an optional per-step hook
the training loop calls (Sophia-G's Hessian refresh). Adding an optimizer means adding a builder
(:mod:`merit_core.optim.builders`), a spec here and its name to :mod:`merit_core.optimizer_names`
(see CONTRIBUTING.md); `merit train`, `merit compare` and the fsdp check then know it.

``build_optimizer(name, model_or_params, **hparams)`` builds one. Names are case-insensitive and
``_`` equals ``-``; the functions below also take the :class:`OptimizerSpec` of :func:`get_spec`,
so that a training run looks its optimizer up once. A user's mistake (unknown name or
hyperparameter, a value of the wrong type or out of range) raises
:class:`~merit_core.errors.ConfigError` in one line; an inconsistent spec raises ValueError when it
is defined, so it fails at import, not in a user's run.

Learning rates: AdamW, LAMB and MERIT carry measured lrs (:mod:`merit_core.optim.lr_table`);
:func:`default_lr` is what `merit train` uses without an lr, and the centre of `merit compare`'s
automatic grid. The `lr` default of each spec is its table's entry for GPT-2 small.
"""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torch.optim import Optimizer

from merit_core.errors import ConfigError
from merit_core.optim.builders import build_adamw, build_lamb, build_lion, build_merit, build_muon, build_sophiag
from merit_core.optim.lr_table import (
    ADAMW_LRS,
    LAMB_LRS,
    MERIT_LRS,
    LrDefault,
    MeasuredLr,
    lr_from_table,
    table_width,
)
from merit_core.optim.sophia import hessian_interval, hessian_refresh
from merit_core.optimizer_names import BUILTIN_OPTIMIZERS, add_name, known_optimizer, optimizer_key, remove_name
from merit_core.values import PAIR, coerce, describe, is_number

# ---------------------------------------------------------------------------------------------
# what a spec holds

# Names that mean the same thing in every optimizer, so they get the same kind (a type hint of
# merit_core.values) whatever the default looks like (a weight_decay default of 0 is still a float).
# Other kinds are read from the default (see OptimizerSpec.kinds).
SHARED_KINDS: dict[str, Any] = {
    **dict.fromkeys(("lr", "eps", "weight_decay", "momentum"), float),
    "betas": PAIR,
    **dict.fromkeys(("maximize", "decay_embeddings"), bool),
    **dict.fromkeys(("fused", "foreach"), bool | None),
}


@dataclass(frozen=True)
class StepHook:
    """Extra work for the training loop after some optimizer updates (Sophia-G's Hessian refresh).

    The cadence belongs to the loop: it calls ``run`` after update ``i`` when
    ``i % every == every - 1``, where ``every = interval(optimizer)`` is read once from the built
    optimizer. Gradients are cleared before ``run`` and again after it.
    """

    interval: Callable[[Optimizer], int]
    run: Callable[[Any], None]  # called with the loop's merit_core.train.step_hooks.StepContext


@dataclass(frozen=True, kw_only=True)
class OptimizerSpec:
    """One registry entry: everything the project needs to know about one optimizer name.

    name: the registry name (lower case, words joined by ``-``).
    summary: one line for ``--optimizer`` help and run logs.
    builder: ``(name, model_or_params, hparams) -> Optimizer``; `hparams` are the resolved
        defaults and overrides plus `fixed`, already type-checked.
    defaults: the hyperparameters a user may set, with their defaults.
    kinds: the kind, a type hint :func:`merit_core.values.coerce` checks values against, of every
        hyperparameter whose default does not say it: a None default, or a number that may also be
        None (``float | None``). The others come from :data:`SHARED_KINDS`, else from the default's
        type (bool, int, float, str, a pair of numbers: ``merit_core.values.PAIR``). After
        construction it holds the kind of every key of `defaults`.
    fixed: switches that define a variant and cannot be set (the MERIT ablations).
    lr_centre / lr_family: compare's lr-grid centre for an optimizer without measured lrs, by
        model scale (``{"small": lr, "gpt2": lr}``, see :func:`merit_core.compare.grid.auto_centre`),
        or the registry name whose centre and measured lrs this optimizer shares (the MERIT
        ablations use MERIT's); exactly one of lr_centre, lr_family and measured_lrs.
    fsdp_refused: None when the optimizer trains FSDP2-sharded (DTensor) parameters exactly
        (tests/dist_scripts/fsdp_checks.py checks every name); else the one-line reason
        `--parallel fsdp` refuses it.
    measured_lrs: the measured lrs (see :class:`MeasuredLr` and :func:`default_lr`); `merit train`
        without an lr and `merit compare`'s auto grid start from them.
    step_hook: extra work the training loop does after some updates, or None.
    """

    name: str
    summary: str
    builder: Callable[[str, Any, dict[str, Any]], Optimizer]
    defaults: Mapping[str, Any]
    kinds: Mapping[str, Any] = field(default_factory=dict)
    fixed: Mapping[str, Any] = field(default_factory=dict)
    lr_centre: Mapping[str, float] | None = None
    lr_family: str | None = None
    fsdp_refused: str | None = None
    measured_lrs: tuple[MeasuredLr, ...] = ()
    step_hook: StepHook | None = None

    def __post_init__(self) -> None:
        where = f"optimizer spec '{self.name}'"
        if not isinstance(self.name, str) or self.name != optimizer_key(self.name) or not self.name:
            raise ValueError(f"{where}: the name must be lower case with '-' between words")
        stray = set(self.kinds) - set(self.defaults)
        if stray:
            raise ValueError(f"{where}: kinds given for unknown hyperparameters {sorted(stray)}")
        clash = set(self.fixed) & set(self.defaults)
        if clash:
            raise ValueError(f"{where}: {sorted(clash)} are both fixed and settable")
        kinds = {}
        for key, default in self.defaults.items():
            kind = self.kinds.get(key) or SHARED_KINDS.get(key) or _kind_of(default)
            try:
                describe(kind)  # TypeError for anything but the hints merit_core.values coerces
            except TypeError:
                raise ValueError(
                    f"{where}: hyperparameter '{key}' (default {default!r}) needs its kind in kinds=, a type "
                    "hint: float, int, bool, str, tuple[float, float] or one of them | None"
                ) from None
            kinds[key] = kind
            try:
                coerce(default, kind, f"{where}: the default of '{key}'")
            except ConfigError as exc:
                raise ValueError(str(exc)) from None
        object.__setattr__(self, "kinds", kinds)
        if self.lr_centre is not None and (
            set(self.lr_centre) != {"small", "gpt2"} or not all(is_number(v) and v > 0 for v in self.lr_centre.values())
        ):
            raise ValueError(f"{where}: lr_centre must give a positive lr for 'small' and for 'gpt2' models")
        given = [self.lr_centre is not None, self.lr_family is not None, bool(self.measured_lrs)]
        if sum(given) != 1:
            raise ValueError(
                f"{where}: give exactly one of lr_centre (compare's lr-grid centre), measured_lrs or lr_family"
            )


def _kind_of(default: Any) -> Any:
    """The kind a default value implies, or None when it does not imply one."""
    for kind in (bool, int, float, str):  # bool first: True is an int too
        if isinstance(default, kind):
            return kind
    if isinstance(default, tuple) and len(default) == 2 and all(map(is_number, default)):
        return PAIR
    return None


# ---------------------------------------------------------------------------------------------
# the registry

_SPECS: dict[str, OptimizerSpec] = {}


def register_optimizer(spec: OptimizerSpec, *, replace: bool = False) -> OptimizerSpec:
    """Add `spec` under ``spec.name`` (ValueError if the name is taken, unless `replace`)."""
    if spec.name in _SPECS and not replace:
        raise ValueError(f"optimizer '{spec.name}' is already registered")
    if spec.lr_family is not None:
        head = _SPECS.get(spec.lr_family)
        if head is None or head.lr_family is not None:
            raise ValueError(
                f"optimizer spec '{spec.name}': lr_family '{spec.lr_family}' must be a registered optimizer "
                "with an lr_centre or measured_lrs of its own"
            )
    _SPECS[spec.name] = spec
    add_name(spec.name)  # the torch-free list `merit train` checks a name against first
    return spec


def unregister_optimizer(name: str) -> None:
    """Remove a registered name (for tests and plugins that registered their own)."""
    key = canonical_name(name)
    _SPECS.pop(key)
    remove_name(key)


def _default_lr_centre(lr: float) -> dict[str, float]:
    """Compare's lr-grid centre of an optimizer without measured lrs: its default `lr` on GPT-2, x 5/3
    on small models (AdamW's nanoGPT lr 6e-4 on GPT-2 against a usual 1e-3 on small models)."""
    return {"small": lr * 1e-3 / 6e-4, "gpt2": lr}


_MERIT_SWITCHES = ("norm", "elementwise", "weight_bound", "clip")
# The reference README's language-model example (betas (0.9, 0.95), weight decay 1e-2) with the
# measured GPT-2 small lr (benchmarks/README.md); the MERIT class keeps the reference code's defaults.
_MERIT_DEFAULTS: dict[str, Any] = dict(
    lr=2e-3,
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
_MERIT_KINDS = {"clip": float | None, "implementation": str | None}
# nanoGPT's GPT-2 recipe (its lr is also the measured GPT-2 small entry).
_ADAMW_DEFAULTS: dict[str, Any] = dict(
    lr=6e-4,
    betas=(0.9, 0.95),
    eps=1e-8,
    weight_decay=0.1,
    maximize=False,
    fused=None,
    foreach=None,
    decay_embeddings=True,
)
# Same betas / eps / decay / lr as MERIT, so the two differ only in the ratio.
_LAMB_DEFAULTS: dict[str, Any] = dict(
    lr=2e-3,
    betas=(0.9, 0.95),
    eps=1e-6,
    weight_decay=1e-2,
    weight_decouple=False,
    maximize=False,
    decay_embeddings=True,
)
# Lion paper's advice: lr 3-10x below AdamW's, decay 3-10x above (here lr*wd = 6e-5 as AdamW's),
# betas (0.95, 0.98) for language-model stability.
_LION_DEFAULTS: dict[str, Any] = dict(
    lr=1e-4, betas=(0.95, 0.98), weight_decay=0.6, maximize=False, decay_embeddings=True
)
# The official SophiaG class defaults (lr 1e-4, betas, rho 0.04 at B = 5120, wd 0.1, k = 10);
# rho re-expressed per sampled token, see merit_core.optim.sophia.
_SOPHIAG_DEFAULTS: dict[str, Any] = dict(
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
_MUON_DEFAULTS: dict[str, Any] = dict(
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
    """A MERIT ablation: MERIT with some switches fixed; it shares MERIT's measured lrs."""
    fixed = {k: _MERIT_DEFAULTS[k] for k in _MERIT_SWITCHES} | switches
    settable = {k: v for k, v in _MERIT_DEFAULTS.items() if k not in _MERIT_SWITCHES}
    kinds = {k: v for k, v in _MERIT_KINDS.items() if k in settable}
    return OptimizerSpec(
        name=name, summary=summary, builder=build_merit, defaults=settable, kinds=kinds, fixed=fixed, lr_family="merit"
    )


for _spec in (
    OptimizerSpec(
        name="merit",
        summary="MERIT: max-norm element-wise trust ratios, clipped (Luo et al. 2025)",
        builder=build_merit,
        defaults=_MERIT_DEFAULTS,
        kinds=_MERIT_KINDS,
        measured_lrs=MERIT_LRS,
    ),
    OptimizerSpec(
        name="adamw",
        summary="torch AdamW, decoupled decay (fused kernel on CPU/CUDA, else foreach)",
        builder=build_adamw,
        defaults=_ADAMW_DEFAULTS,
        measured_lrs=ADAMW_LRS,
    ),
    OptimizerSpec(
        name="lamb",
        summary="pytorch_optimizer Lamb (step / (1 - b1^t)); decay inside the trust-ratio update",
        builder=build_lamb,
        defaults=_LAMB_DEFAULTS,
        measured_lrs=LAMB_LRS,
        fsdp_refused="pytorch_optimizer's Lamb clamps its trust-ratio norms in place, which DTensor shards do not "
        "support; use 'lamb-ref' (LAMB as MERIT's ablation, exact under fsdp) or --parallel ddp",
    ),
    OptimizerSpec(
        name="lion",
        summary="pytorch_optimizer Lion: signed momentum updates, decoupled decay",
        builder=build_lion,
        defaults=_LION_DEFAULTS,
        lr_centre=_default_lr_centre(_LION_DEFAULTS["lr"]),
    ),
    OptimizerSpec(
        name="sophiag",
        summary="Sophia-G (Liu et al. 2023); the loop refreshes its Hessian every hessian_interval",
        builder=build_sophiag,
        defaults=_SOPHIAG_DEFAULTS,
        lr_centre=_default_lr_centre(_SOPHIAG_DEFAULTS["lr"]),
        step_hook=StepHook(interval=hessian_interval, run=hessian_refresh),
    ),
    OptimizerSpec(
        name="muon",
        summary="torch Muon on 2-D hidden weights + AdamW (adamw_*) on embeddings, head and 1-D params",
        builder=build_muon,
        defaults=_MUON_DEFAULTS,
        kinds={"adjust_lr_fn": str | None},
        lr_centre=_default_lr_centre(_MUON_DEFAULTS["lr"]),
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
):
    register_optimizer(_spec)
del _spec

# The built-in names, in registry order (optimizer_names() also lists names registered later): the
# torch-free list merit_core.optimizer_names holds, which `merit train` reads before torch loads.
OPTIMIZER_NAMES: tuple[str, ...] = tuple(_SPECS)
if OPTIMIZER_NAMES != BUILTIN_OPTIMIZERS:
    raise ValueError(
        f"merit_core.optimizer_names.BUILTIN_OPTIMIZERS {BUILTIN_OPTIMIZERS} must be the registry's built-in "
        f"names {OPTIMIZER_NAMES}, in order"
    )


def optimizer_names() -> tuple[str, ...]:
    """Every registered name, built-in ones first."""
    return tuple(_SPECS)


def canonical_name(name: str) -> str:
    """The registry name for ``name`` (case-insensitive, ``_`` == ``-``); ConfigError if there is none."""
    key = optimizer_key(name) if isinstance(name, str) else None
    if key in _SPECS:
        return key
    return known_optimizer(name, optimizer_names())  # not a registered name: its one-line error


def get_spec(name: str | OptimizerSpec) -> OptimizerSpec:
    """The registry entry for ``name`` (see :func:`canonical_name`); a spec is its own entry."""
    return name if isinstance(name, OptimizerSpec) else _SPECS[canonical_name(name)]


def default_hparams(name: str) -> dict[str, Any]:
    """The settable hyperparameters of optimizer ``name`` and their defaults (a fresh dict)."""
    return dict(get_spec(name).defaults)


def fixed_hparams(name: str) -> dict[str, Any]:
    """The MERIT switches a variant fixes (empty for non-variants), e.g. ``{"clip": None, ...}``."""
    return dict(get_spec(name).fixed)


def optimizer_summary(name: str) -> str:
    """One line describing optimizer ``name`` (for ``--optimizer`` help and run logs)."""
    return get_spec(name).summary


def lr_centre(name: str) -> Mapping[str, float] | None:
    """The centre of compare's automatic lr grid for an optimizer without measured lrs (its lr
    family's when it has one); None when it has measured lrs (see :func:`default_lr`)."""
    spec = get_spec(name)
    return spec.lr_centre if spec.lr_family is None else get_spec(spec.lr_family).lr_centre


def measured_lrs(name: str | OptimizerSpec) -> tuple[MeasuredLr, ...]:
    """The measured lrs of ``name`` (its lr family's when it has one); empty when none."""
    spec = get_spec(name)
    return spec.measured_lrs if spec.lr_family is None else get_spec(spec.lr_family).measured_lrs


def measured_lr(
    name: str | OptimizerSpec, model: str, batch_size: int, seq_len: int, width: int | None
) -> LrDefault | None:
    """The lr the measured table gives optimizer ``name`` for ``model`` (``width`` = its d_model, None
    when its config cannot be read) at ``batch_size`` sequences of ``seq_len`` tokens (the rule:
    :func:`merit_core.optim.lr_table.lr_from_table`), or None when ``name`` has no table (or no
    entry applies: an unknown width and no entry of that model)."""
    spec = get_spec(name)
    table = measured_lrs(spec)
    if not table:
        return None
    head = spec.lr_family or spec.name
    shared = "" if head == spec.name else f" ({spec.name} shares {head}'s lrs)"
    return lr_from_table(table, head, model, width, batch_size, seq_len, shared)


_UNSET: Any = object()  # default_lr's width not given: read it from the model


def model_width(model: str | nn.Module | Any) -> int | None:
    """d_model of ``model`` as the lr table needs it, read without building anything: a module's
    ``config`` (``n_embd``, ``hidden_size`` or ``d_model``), else its first embedding's width; a name
    the table has entries for, their width; a config.json (or a folder holding one), its field; None
    otherwise (a bare iterable of parameters, an unknown name: then only same-name entries apply)."""
    if isinstance(model, nn.Module):
        config = getattr(model, "config", None)
        for key in ("n_embd", "hidden_size", "d_model"):
            value = getattr(config, key, None)
            if isinstance(value, int) and value > 0:
                return value
        embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
        return embedding.embedding_dim if embedding is not None else None
    if not isinstance(model, str):
        return None
    return table_width(model)


def model_name(model: nn.Module | Any) -> str:
    """The name a module's lr is looked up under: its config's ``name_or_path`` when it was loaded
    from one, else "this model" (a model built from a config matches entries by width only)."""
    return str(getattr(getattr(model, "config", None), "name_or_path", "") or "this model")


def default_lr(
    name: str | OptimizerSpec,
    model: str,
    batch_size: int,
    seq_len: int,
    width: int | None = _UNSET,
) -> LrDefault:
    """The lr `merit train` uses for a run without one: :func:`measured_lr`, else the registry default
    (its source says why: no table for the optimizer, or ``model``'s width unknown). Without
    ``width``, :func:`model_width` reads it from ``model`` (a name or config.json path)."""
    spec = get_spec(name)
    if width is _UNSET:
        width = model_width(model)
    found = measured_lr(spec, model, batch_size, seq_len, width)
    if found is not None:
        return found
    why = (
        "no measured lr for it"
        if not measured_lrs(spec)
        else f"{model}'s config could not be read for its width: pass width=, its d_model"
    )
    return LrDefault(float(spec.defaults["lr"]), f"{spec.name}'s registry default ({why})")


def resolve_hparams(name: str | OptimizerSpec, **hparams: Any) -> dict[str, Any]:
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
        resolved[key] = coerce(value, spec.kinds[key], f"optimizer '{spec.name}': hyperparameter '{key}'")
    return resolved


class LrChoiceWarning(UserWarning):
    """How :func:`build_optimizer` chose an lr it was not given (said once per distinct choice)."""


_said: set[str] = set()


def _say_once(message: str) -> None:
    if message not in _said:
        _said.add(message)
        warnings.warn(message, LrChoiceWarning, stacklevel=4)


def library_lr(
    spec: OptimizerSpec, model_or_params: nn.Module | Any, batch_size: int | None, seq_len: int | None
) -> float | None:
    """The lr :func:`build_optimizer` gives an optimizer with measured lrs when none is passed, said
    once: the table's (:func:`measured_lr`) for the model's width at ``batch_size`` x ``seq_len``,
    else (no batch or sequence length, or no width) the generic registry default, with a warning
    that it is one. None for an optimizer without a table (its registry default applies)."""
    if not measured_lrs(spec):
        return None
    generic = float(spec.defaults["lr"])
    if batch_size is None or seq_len is None:
        _say_once(
            f"build_optimizer('{spec.name}'): lr {generic:g} is a generic default (GPT-2 small's); pass "
            "batch_size= and seq_len= for the lr measured for this model's width and batch, or choose one with lr=..."
        )
        return generic
    for what, value in (("batch_size", batch_size), ("seq_len", seq_len)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"build_optimizer: {what} must be a positive integer, got {value!r}")
    found = measured_lr(spec, model_name(model_or_params), batch_size, seq_len, model_width(model_or_params))
    if found is None:
        _say_once(
            f"build_optimizer('{spec.name}'): lr {generic:g} is a generic default (GPT-2 small's), as the model's "
            "width (d_model) could not be read (it has no Hugging Face config); choose one with lr=..."
        )
        return generic
    _say_once(f"build_optimizer('{spec.name}'): lr {found.lr:g}, {found.source}")
    return found.lr


def build_optimizer(
    name: str | OptimizerSpec,
    model_or_params: nn.Module | Any,
    *,
    batch_size: int | None = None,
    seq_len: int | None = None,
    **hparams: Any,
) -> Optimizer:
    """Build registry optimizer ``name`` over a model (preferred) or an iterable of (named) parameters.

    Without ``lr``, an optimizer with measured lrs (merit, its ablations, adamw, lamb) gets
    :func:`library_lr`: the measured lr for the model's width at ``batch_size`` sequences of
    ``seq_len`` tokens (the global batch of one optimizer step), said once; without them a generic
    default, with a warning. Given a model, embeddings and the LM head are recognised by module type
    (see :mod:`merit_core.optim.param_groups`); given bare tensors, every 2-D+ tensor counts as hidden.
    Build after moving the model to its device (AdamW picks its fused kernel from the devices).
    """
    spec = get_spec(name)
    if "lr" not in hparams:
        lr = library_lr(spec, model_or_params, batch_size, seq_len)
        if lr is not None:
            hparams["lr"] = lr
    hp = resolve_hparams(spec, **hparams) | dict(spec.fixed)
    return spec.builder(spec.name, model_or_params, hp)
