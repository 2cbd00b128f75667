"""The model a checkpoint's config.json builds, filled with the checkpoint's weights: what the logit,
Hessian and update-size probes of `merit inspect` and compare's measures run on."""

from __future__ import annotations

import torch

from merit_core.checkpoint.tensors import copy_weights
from merit_core.diagnostics.layout import read_config
from merit_core.errors import CheckpointError, ConfigError
from merit_core.models import build_model, config_from_dict, family_spec
from merit_core.models.layered_forward import TensorTap, layered_model
from merit_core.models.limits import check_layered_size, check_model_config, check_model_size


def load_model(
    checkpoint,
    tensors,
    device: str | torch.device = "cpu",
    raw_config: dict | None = None,
    layered: bool = False,
    tap: TensorTap | None = None,
):
    """A float32 causal LM built from the checkpoint's config.json, with every weight from `tensors`.

    Built with `from_config` and filled from the lazy safetensors reader by the one weight loader
    (merit_core.checkpoint.tensors.copy_weights), so any file name or shard layout works and a
    missing weight is an error rather than a silent random init; the names transformers saves some
    weights under (GPT-NeoX embed_out) are accepted. `raw_config`: the checkpoint's config.json
    when the caller has read it already (else it is read here). `layered`: a model for forward
    passes that reads each layer's weights when it runs (merit_core.models.layered_forward), so a
    checkpoint larger than memory can be probed, with the same numbers as the whole model's. `tap`:
    with `layered`, called with each layer's stored tensors as they are read.
    """
    raw = raw_config if raw_config is not None else read_config(checkpoint.config_path)
    if raw is None:
        raise CheckpointError(f"no config.json next to {checkpoint.path}")
    try:
        config = config_from_dict(raw, str(checkpoint.config_path))
    except ConfigError as exc:
        if raw.get("model_type") is None or "not a usable" in str(exc):
            raise CheckpointError(str(exc)) from None
        raise
    config.dtype = torch.float32
    spec = family_spec(config)
    try:  # a config.json from someone else: shapes it cannot build, sizes no memory holds
        check_model_config(config, str(checkpoint.config_path))
        (check_layered_size if layered else check_model_size)(config, str(checkpoint.config_path), str(device))
    except ConfigError as exc:
        raise CheckpointError(str(exc)) from None
    if layered:
        return layered_model(config, tensors, device, tap=tap, where=str(checkpoint.path))
    model = build_model(config)
    copy_weights(model, tensors, str(checkpoint.path), spec.saved_name)
    return model.to(device).eval()
