"""Optimizers: MERIT, its ablations, and the baselines it is compared against.

``build_optimizer(name, model, **hparams)`` is the one entry point the training code needs;
``OPTIMIZER_NAMES`` lists the names, ``default_hparams(name)`` their settable defaults.
"""

from merit_core.optim.merit import MERIT
from merit_core.optim.muon import MuonWithAdamW, muon_param_groups
from merit_core.optim.param_groups import NamedParam, build_param_groups, classify_parameters
from merit_core.optim.registry import (
    OPTIMIZER_NAMES,
    build_optimizer,
    canonical_name,
    default_hparams,
    fixed_hparams,
    optimizer_summary,
    resolve_hparams,
)
from merit_core.optim.sophia import SampledLoss, SophiaG, sampled_label_loss

__all__ = [
    "MERIT",
    "SophiaG",
    "MuonWithAdamW",
    "build_optimizer",
    "OPTIMIZER_NAMES",
    "default_hparams",
    "fixed_hparams",
    "optimizer_summary",
    "resolve_hparams",
    "canonical_name",
    "build_param_groups",
    "classify_parameters",
    "muon_param_groups",
    "NamedParam",
    "sampled_label_loss",
    "SampledLoss",
]
