"""Checkpoints: `<run>/step_<N>/`, each a complete Hugging Face model folder plus trainer state.

A checkpoint holds `config.json`, `model.safetensors`, the tokenizer files (so it loads with
`AutoModelForCausalLM.from_pretrained` / `AutoTokenizer.from_pretrained` and lm-eval on its
own), `trainer_state.json` (step, tokens, lr, model, optimizer, batch shape: what tools read)
and `trainer_state.pt` (optimizer state, RNG states, data position; tensors and plain
containers only, so it loads with `torch.load(weights_only=True)`). Under fsdp the optimizer
state is instead an `optimizer/` folder of torch.distributed.checkpoint shards, which every
process writes into the staged folder (`merit_core.checkpoint.runs.begin_staging`). It is written into
`<run>/.tmp-step_<N>`, fsynced and renamed into place, so a crash never leaves half a
checkpoint. What the folder layout is (naming, completeness, "latest", staging, durable
writes) belongs to `merit_core.checkpoint.runs`; this module writes and reads the files inside.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from merit_core.checkpoint import runs
from merit_core.checkpoint.runs import STATE_FORMAT, STATE_JSON, STATE_PT, WEIGHTS_NAME
from merit_core.checkpoint.safe import opened_path, validate_safetensors
from merit_core.data.tokenizer import make_tokenizer_portable
from merit_core.errors import CheckpointError, first_line, os_error_line
from merit_core.fileio import open_regular
from merit_core.models import family_spec

__all__ = [
    "STATE_FORMAT",
    "STATE_JSON",
    "STATE_PT",
    "load_model_weights",
    "check_optimizer_state",
    "load_trainer_state",
    "prune_checkpoints",
    "save_checkpoint",
]


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    *,
    model,
    state_dict: dict[str, torch.Tensor] | None,
    tokenizer_dir: str | Path | None,
    info: dict[str, Any],
    state: dict[str, Any],
    staging: Path | None = None,
) -> Path:
    """Write `step_<step>/` atomically and durably, and return its path.

    model: the unwrapped transformers model (its config and save_pretrained are used);
    state_dict: full weights to save instead of the model's own (sharded training);
    info: the JSON trainer state; state: the tensor trainer state for trainer_state.pt;
    staging: the folder from `runs.begin_staging` when other files were already written into it.
    """
    run_dir = Path(run_dir)
    tmp = staging if staging is not None else runs.begin_staging(run_dir, step)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Writing model shards" bars would break the caller's progress display
    kwargs = {"state_dict": state_dict} if state_dict is not None else {}
    model.save_pretrained(tmp, **kwargs)
    if tokenizer_dir is not None:
        for item in runs.tokenizer_files(tokenizer_dir):
            shutil.copyfile(item, tmp / item.name)
        make_tokenizer_portable(tmp)  # data prepared by transformers 5 before tokenizers were saved portably
    torch.save(state, tmp / STATE_PT)
    (tmp / STATE_JSON).write_text(json.dumps({"format": STATE_FORMAT, **info}, indent=2) + "\n")
    return runs.publish_folder(tmp, runs.step_path(run_dir, step))


def prune_checkpoints(run_dir: str | Path, keep: int) -> None:
    """Keep only the newest `keep` checkpoints (keep <= 0 keeps all)."""
    if keep <= 0:
        return
    for _, path in runs.checkpoints(run_dir)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)


def load_trainer_state(checkpoint: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """trainer_state.pt, loaded safely: opened as a regular file only (a FIFO or device in its place
    is refused, never read) and unpickled with weights_only=True (tensors and plain containers)."""
    path = Path(checkpoint) / STATE_PT
    if not os.path.lexists(path):
        raise CheckpointError(f"{checkpoint} has no {STATE_PT}; it cannot be resumed")
    try:
        with open_regular(path) as fh:
            return torch.load(fh, map_location=map_location, weights_only=True)
    except CheckpointError:
        raise
    except OSError as exc:
        raise CheckpointError(os_error_line(exc)) from None
    except Exception as exc:  # corrupt file or a pickle that is not plain tensors/containers
        raise CheckpointError(f"{path} cannot be loaded safely: {type(exc).__name__}: {first_line(exc)}") from None


def load_model_weights(model: torch.nn.Module, checkpoint: str | Path) -> None:
    """Copy the checkpoint's safetensors weights into `model` (tied weights may be absent).

    The file is checked whole first (merit_core.checkpoint.safe.validate_safetensors: a truncated file or
    a corrupt header is refused in one line) and loaded through the checked descriptor."""
    path = Path(checkpoint) / WEIGHTS_NAME
    if not os.path.lexists(path):
        raise CheckpointError(f"{checkpoint} has no {WEIGHTS_NAME}")
    validate_safetensors(path)
    try:
        with opened_path(path) as checked:
            weights = load_file(checked)
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"{path} is unreadable: {first_line(exc)}") from None

    spec = family_spec(model.config)  # names save_pretrained renames (GPT-NeoX lm_head -> embed_out)
    weights = {spec.model_name(name): tensor for name, tensor in weights.items()}
    try:
        missing, unexpected = model.load_state_dict(weights, strict=False)
    except RuntimeError as exc:  # a tensor of another shape
        detail = next((line.strip() for line in str(exc).splitlines() if "size mismatch" in line), first_line(exc))
        raise CheckpointError(f"{checkpoint} does not match the model: {detail}") from None
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    if unexpected or set(missing) - tied:
        raise CheckpointError(
            f"{checkpoint} does not match the model: missing {sorted(set(missing) - tied)[:3]}, "
            f"unexpected {sorted(unexpected)[:3]}"
        )


# Optimizer state entries that always have their parameter's shape (Adam/MERIT moments, momentum, Sophia's Hessian).
PARAM_SHAPED_STATE = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "momentum", "hessian")


def _overlapping(tensor: torch.Tensor) -> bool:
    """True when two elements of `tensor` may share memory (a stride of 0, as in an expanded view, or
    strides that interleave): an in-place optimizer update of such a tensor fails."""
    reach = 0
    for stride, size in sorted((st, n) for st, n in zip(tensor.stride(), tensor.shape) if n > 1):
        if stride <= reach:
            return True
        reach += stride * (size - 1)
    return False


def check_optimizer_state(optimizer: torch.optim.Optimizer, state: Any, where: str | Path) -> None:
    """CheckpointError unless a saved optimizer state_dict fits `optimizer`: the same parameter groups,
    and every moment of the parameter's shape. torch's load_state_dict checks only the group sizes,
    so a wrong-shaped `exp_avg` would load and fail at the first step, after the run was rewritten."""
    try:
        saved_groups, saved_state = state["param_groups"], state["state"]
        ids = [[*group["params"]] for group in saved_groups]
    except (KeyError, TypeError):
        raise CheckpointError(f"{where}: the optimizer state is not a torch optimizer state_dict") from None
    groups = optimizer.param_groups
    if len(ids) != len(groups) or any(len(a) != len(g["params"]) for a, g in zip(ids, groups)):
        raise CheckpointError(f"{where}: the optimizer state has other parameter groups than this model's optimizer")
    if not isinstance(saved_state, dict):
        raise CheckpointError(f"{where}: the optimizer state is not a torch optimizer state_dict")
    for group_ids, group in zip(ids, groups):
        for index, param in zip(group_ids, group["params"]):
            entry = saved_state.get(index, {})
            if not isinstance(entry, dict):
                raise CheckpointError(f"{where}: the optimizer state of parameter {index} is not a dict")
            for key in PARAM_SHAPED_STATE:
                value = entry.get(key)
                if value is None:
                    continue
                shape = tuple(getattr(param, "shape", ()))
                if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape:
                    got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                    raise CheckpointError(
                        f"{where}: optimizer state {key!r} of parameter {index} has shape {got}, "
                        f"the parameter has {shape}; this checkpoint cannot be resumed"
                    )
                if _overlapping(value):  # e.g. an expanded view: elements share memory, in-place updates fail
                    raise CheckpointError(
                        f"{where}: optimizer state {key!r} of parameter {index} is a view with strides "
                        f"{tuple(value.stride())}, not a tensor of its own; this checkpoint cannot be resumed"
                    )
