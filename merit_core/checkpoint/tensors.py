"""trainer_state.pt and the weights, read safely and checked whole before anything uses them.

trainer_state.pt holds `step`, `optimizer` (a torch optimizer state_dict, or the marker of fsdp's
sharded state), `rng` and `data`. It is opened as a regular file only and unpickled with
`weights_only=True` (tensors and plain containers). A file that loads can still be crafted: a
negative or text step, moments on the meta device, a missing `exp_avg_sq`, garbage `betas`. A
resume that took such a state would move the later checkpoints aside and cut metrics.jsonl back
before failing at its first step, so every field is checked here first (`check_trainer_state`
without an optimizer, `check_optimizer_state` against the optimizer it will load into), and any
exception from reading becomes one CheckpointError line.

What an optimizer keeps per parameter is learnt from the optimizer itself: a replica of it on
tiny parameters of the same dimensions takes one zero-gradient step, and the saved state must
hold the same entries (tensors of the parameter's shape where the replica's are, scalars where
its are).
"""

from __future__ import annotations

import copy
import math
import os
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from merit_core import values
from merit_core.checkpoint.runs import STATE_PT, WEIGHTS_NAME
from merit_core.checkpoint.safe import opened_path, validate_safetensors
from merit_core.errors import CheckpointError, first_line, os_error_line
from merit_core.file_reading import display, open_regular

# What a sharded scheme (fsdp) keeps in trainer_state.pt in place of the optimizer state: a marker
# naming the format of the shards it wrote into the checkpoint folder (see merit_core.train.fsdp).
DCP_FORMAT = "torch.distributed.checkpoint"
# Hyperparameters that are never negative, whatever the optimizer (betas: each in [0, 1]).
_NON_NEGATIVE = ("lr", "eps", "weight_decay", "clip", "momentum", "max_grad_norm")


def load_trainer_state(checkpoint: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """trainer_state.pt as a dict, loaded safely: opened as a regular file only (a FIFO or device in
    its place is refused, never read) and unpickled with weights_only=True. Not yet checked: see
    `check_trainer_state`."""
    path = Path(checkpoint) / STATE_PT
    if not os.path.lexists(path):
        raise CheckpointError(f"{display(checkpoint)} has no {STATE_PT}; it cannot be resumed")
    try:
        with open_regular(path) as fh:
            state = torch.load(fh, map_location=map_location, weights_only=True)
    except CheckpointError:
        raise
    except OSError as exc:
        raise CheckpointError(os_error_line(exc)) from None
    except Exception as exc:  # noqa: BLE001 - a corrupt file or a pickle that is not plain tensors/containers
        raise CheckpointError(
            f"{display(path)} cannot be loaded safely: {type(exc).__name__}: {first_line(exc)}"
        ) from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{display(path)} is not a merit trainer state (not a dict)")
    return state


def is_sharded_optimizer_state(state: Any) -> bool:
    """True for the marker fsdp checkpoints keep in trainer_state.pt instead of the optimizer state."""
    return isinstance(state, dict) and state.get("format") == DCP_FORMAT


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _count(value: Any) -> int | None:
    """`value` as a non-negative integer, read as every number a user or a file gives is
    (merit_core.values.as_int: no bool, no text, an integral float as its int); None when it is not one."""
    number = values.as_int(value)
    return number if number is not None and number >= 0 else None


def check_trainer_state(state: Any, where: str | Path, step: int | None = None) -> int:
    """CheckpointError unless trainer_state.pt's `state` is what a resume needs: a non-negative int
    `step` (equal to `step`, the step trainer_state.json and the folder name say, when given), an
    optimizer state_dict of plain structure (or fsdp's marker), torch's RNG state, the data position.
    Returns the step."""
    where = display(where)

    def refuse(what: str) -> CheckpointError:
        return CheckpointError(f"{where} is not a usable trainer state: {what}; this checkpoint cannot be resumed")

    if not isinstance(state, dict):
        raise refuse("not a merit trainer state (step, optimizer, rng)")
    saved = _count(state.get("step"))
    if saved is None:
        raise refuse(f"its step is {_kind(state.get('step'))}, not a non-negative integer")
    if step is not None and saved != step:
        raise refuse(f"it holds step {saved} but its folder holds step {step}")
    rng = state.get("rng")
    if not isinstance(rng, dict) or not isinstance(rng.get("torch"), torch.Tensor):
        raise refuse("it has no torch RNG state")
    expected = torch.get_rng_state()
    generator = rng["torch"]
    if generator.dtype != torch.uint8 or generator.shape != expected.shape or generator.device.type != "cpu":
        raise refuse("its torch RNG state is not one torch saved")
    cuda = rng.get("cuda")
    if cuda is not None and not (
        isinstance(cuda, (list, tuple))
        and all(isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.device.type == "cpu" for t in cuda)
    ):
        raise refuse("its CUDA RNG states are not ones torch saved")
    data = state.get("data")
    if data is not None and not (isinstance(data, dict) and all(_count(v) is not None for v in data.values())):
        raise refuse("its data position is not a set of non-negative integers")
    if data is not None and data.get("next_batch", saved) != saved:  # written as the step: the batch it resumes at
        raise refuse(f"its data position is batch {data['next_batch']} but its step is {saved}")
    optimizer = state.get("optimizer")
    if not is_sharded_optimizer_state(optimizer):
        check_state_dict_structure(optimizer, where)
    return saved


def _kind(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, (int, float, str)) and not isinstance(value, bool):
        return repr(value) if len(repr(value)) < 30 else type(value).__name__
    return type(value).__name__


def check_state_dict_structure(state: Any, where: str) -> None:
    """CheckpointError unless `state` has a torch optimizer state_dict's structure: param_groups (dicts
    with a list of integer `params`), state (integer -> dict of tensors and numbers), every tensor a
    real one on the CPU (not meta), every number finite."""
    if not isinstance(state, dict) or not isinstance(state.get("param_groups"), list):
        raise CheckpointError(f"{where}: the optimizer state is not a torch optimizer state_dict")
    if not isinstance(state.get("state"), dict):
        raise CheckpointError(f"{where}: the optimizer state is not a torch optimizer state_dict")
    for i, group in enumerate(state["param_groups"]):
        if not isinstance(group, dict) or not isinstance(group.get("params"), list):
            raise CheckpointError(f"{where}: parameter group {i} of the optimizer state has no parameter list")
        if not all(_is_int(p) for p in group["params"]):
            raise CheckpointError(f"{where}: parameter group {i} of the optimizer state names non-integer parameters")
    for index, entry in state["state"].items():
        if not _is_int(index) or not isinstance(entry, dict):
            raise CheckpointError(f"{where}: the optimizer state of parameter {index!r} is not a dict")
        for key, value in entry.items():
            _check_value(value, f"{where}: optimizer state {key!r} of parameter {index}")


def _check_value(value: Any, what: str) -> None:
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            raise CheckpointError(f"{what} is on the {value.device.type} device, not stored data")
        if value.is_sparse or value.layout != torch.strided:
            raise CheckpointError(f"{what} is not a dense tensor")
        if value.dtype.is_complex or value.dtype == torch.bool:
            raise CheckpointError(f"{what} has dtype {value.dtype}, not a real number type")
    elif not values.is_number(value) or not math.isfinite(value):
        raise CheckpointError(f"{what} is {_kind(value)}, not a tensor or a finite number")


def _overlapping(tensor: torch.Tensor) -> bool:
    """True when two elements of `tensor` may share memory (a stride of 0, as in an expanded view, or
    strides that interleave): an in-place optimizer update of such a tensor fails."""
    reach = 0
    for stride, size in sorted((st, n) for st, n in zip(tensor.stride(), tensor.shape) if n > 1):
        if stride <= reach:
            return True
        reach += stride * (size - 1)
    return False


def _same_kind(saved: Any, current: Any) -> bool:
    """Whether a saved hyperparameter can stand where the optimizer has `current`."""
    if isinstance(current, bool):
        return isinstance(saved, bool)
    if current is None:  # unset (e.g. MERIT's implementation): a plain value may stand in for it
        return saved is None or isinstance(saved, (str, bool)) or _same_kind(saved, 0.0)
    if isinstance(current, (int, float)):
        return saved is None or (
            isinstance(saved, (int, float)) and not isinstance(saved, bool) and math.isfinite(saved)
        )
    if isinstance(current, (tuple, list)):
        return (
            isinstance(saved, (tuple, list))
            and len(saved) == len(current)
            and all(_same_kind(s, c) for s, c in zip(saved, current))
        )
    if isinstance(current, str):
        return isinstance(saved, str)
    if isinstance(current, torch.Tensor):
        return isinstance(saved, torch.Tensor) and saved.shape == current.shape and saved.device.type == "cpu"
    return type(saved) is type(current)


def _check_group(saved: dict[str, Any], current: dict[str, Any], where: str, i: int) -> None:
    for key, value in current.items():
        if key == "params":
            continue
        if key not in saved:
            raise CheckpointError(f"{where}: parameter group {i} of the optimizer state has no {key!r}")
        if not _same_kind(saved[key], value):
            raise CheckpointError(
                f"{where}: {key!r} of parameter group {i} is {_kind(saved[key])}, where the optimizer has "
                f"{_kind(value)}; this checkpoint cannot be resumed"
            )
        got = saved[key]
        if key == "betas" and isinstance(got, (tuple, list)) and any(not (0 <= b <= 1) for b in got if b is not None):
            raise CheckpointError(
                f"{where}: betas of parameter group {i} are {tuple(got)}, outside [0, 1]; this checkpoint cannot be resumed"
            )
        if key in _NON_NEGATIVE and isinstance(got, (int, float)) and got < 0:
            raise CheckpointError(
                f"{where}: {key} of parameter group {i} is {got}, below 0; this checkpoint cannot be resumed"
            )


def _expected_entries(optimizer: torch.optim.Optimizer) -> list[list[dict[str, Any]]] | None:
    """What the optimizer keeps per parameter after a step, learnt from a replica on parameters of at
    most two elements per dimension (same groups, same hyperparameters) stepped once with zero
    gradients; None when the optimizer cannot be replicated that way."""
    tiny = [
        [torch.zeros([min(int(n), 2) for n in p.shape], requires_grad=True) for p in group["params"]]
        for group in optimizer.param_groups
    ]
    memo = {id(p): q for group, params in zip(optimizer.param_groups, tiny) for p, q in zip(group["params"], params)}
    try:
        replica = copy.deepcopy(optimizer, memo)  # the same class and settings, on the tiny parameters
        replica.state = defaultdict(dict)
        for params in tiny:
            for q in params:
                q.grad = torch.zeros_like(q)
        replica.step()
    except Exception:  # noqa: BLE001 - an optimizer that cannot be replicated: the structure checks only
        return None
    return [[dict(replica.state.get(q, {})) for q in params] for params in tiny]


def check_optimizer_state(optimizer: torch.optim.Optimizer, state: Any, where: str | Path) -> None:
    """CheckpointError unless a saved optimizer state_dict fits `optimizer`: its structure
    (`check_state_dict_structure`), the same parameter groups with hyperparameters of the same
    kinds (no text `betas`, no negative lr), and per parameter the entries the optimizer keeps,
    moments of the parameter's shape and dtype, step counters non-negative scalars. torch's
    load_state_dict checks only the group sizes, so a crafted state would load and fail at the
    first step, after the run was rewritten."""
    where = display(where)
    check_state_dict_structure(state, where)
    saved_groups, saved_state = state["param_groups"], state["state"]
    groups = optimizer.param_groups
    if len(saved_groups) != len(groups) or any(
        len(a["params"]) != len(g["params"]) for a, g in zip(saved_groups, groups)
    ):
        raise CheckpointError(f"{where}: the optimizer state has other parameter groups than this model's optimizer")
    expected = _expected_entries(optimizer)
    for gi, (saved_group, group) in enumerate(zip(saved_groups, groups)):
        _check_group(saved_group, group, where, gi)
        for pi, (index, param) in enumerate(zip(saved_group["params"], group["params"])):
            entry = saved_state.get(index, {})
            if not entry:
                continue  # a parameter the optimizer has not stepped yet
            want = expected[gi][pi] if expected is not None else {}
            missing = sorted(set(want) - set(entry))
            if missing:
                raise CheckpointError(
                    f"{where}: the optimizer state of parameter {index} has no {missing[0]!r}; "
                    "this checkpoint cannot be resumed"
                )
            for key, value in entry.items():
                _check_entry(key, value, want.get(key), param, index, where)


def _check_entry(key: str, value: Any, like: Any, param: torch.Tensor, index: int, where: str) -> None:
    shape = tuple(param.shape)
    tiny = tuple(min(int(n), 2) for n in shape)
    what = f"{where}: optimizer state {key!r} of parameter {index}"
    param_shaped = isinstance(like, torch.Tensor) and tuple(like.shape) == tiny and like.dim() == len(shape)
    if like is None and isinstance(value, torch.Tensor) and value.dim() == len(shape) and value.dim() > 0:
        param_shaped = True  # an entry the replica did not show (optimizer not rebuildable): judged by its rank
    if param_shaped:
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape:
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise CheckpointError(
                f"{what} has shape {got}, the parameter has {shape}; this checkpoint cannot be resumed"
            )
        if not value.dtype.is_floating_point and isinstance(like, torch.Tensor) and like.dtype.is_floating_point:
            raise CheckpointError(f"{what} has dtype {value.dtype}, not a floating-point type")
        if _overlapping(value):  # e.g. an expanded view: elements share memory, in-place updates fail
            raise CheckpointError(
                f"{what} is a view with strides {tuple(value.stride())}, not a tensor of its own; "
                "this checkpoint cannot be resumed"
            )
        return
    if isinstance(like, torch.Tensor) and like.dim() == 0 or isinstance(like, (int, float)) or key == "step":
        number = value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value
        if isinstance(value, torch.Tensor) and value.dim() != 0 and like is not None:
            raise CheckpointError(f"{what} is a tensor of shape {tuple(value.shape)}, not a scalar")
        if not values.is_number(number) or not math.isfinite(number) or number < 0:
            raise CheckpointError(f"{what} is {_kind(value)}, not a non-negative number")


def load_model_weights(
    model: torch.nn.Module,
    checkpoint: str | Path,
    rename: Callable[[str], str] = lambda name: name,
    load: Callable[[dict[str, torch.Tensor]], Any] | None = None,
) -> None:
    """Copy the checkpoint's safetensors weights into `model` (`copy_weights`; tied weights may be
    absent, and a weight the model lacks is refused too).

    The file is checked whole first (`validate_safetensors`: a truncated file or a corrupt header is
    refused in one line) and loaded through the checked descriptor. `rename` maps a saved name to
    the model's (save_pretrained renames some: GPT-NeoX's lm_head is saved as embed_out). `load`
    puts the full weights into the model and returns its (missing, unexpected) keys: by default
    `model.load_state_dict(weights, strict=False)`; a sharded model gives its own (each process
    keeps its shard)."""
    from safetensors.torch import load_file

    path = Path(checkpoint) / WEIGHTS_NAME
    if not os.path.lexists(path):
        raise CheckpointError(f"{display(checkpoint)} has no {WEIGHTS_NAME}")
    validate_safetensors(path)
    try:
        with opened_path(path) as checked:
            weights = load_file(checked)
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - safetensors raises several types for a damaged file
        raise CheckpointError(f"{display(path)} is unreadable: {first_line(exc)}") from None
    weights = {rename(name): tensor for name, tensor in weights.items()}
    if load is not None:  # a sharded model: its own loader puts each process's shard in place
        try:
            missing, unexpected = load(weights)
        except RuntimeError as exc:  # a tensor of another shape
            detail = next((line.strip() for line in str(exc).splitlines() if "size mismatch" in line), first_line(exc))
            raise CheckpointError(f"{display(checkpoint)} does not match the model: {detail}") from None
        tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
        if unexpected or set(missing) - tied:
            raise CheckpointError(
                f"{display(checkpoint)} does not match the model: missing {sorted(set(missing) - tied)[:3]}, "
                f"unexpected {sorted(unexpected)[:3]}"
            )
        return
    unexpected = sorted(set(weights) - set(model.state_dict()))
    if unexpected:
        raise CheckpointError(f"{display(checkpoint)} does not match the model: unexpected {unexpected[:3]}")
    copy_weights(model, weights, display(checkpoint))


def copy_weights(
    model: torch.nn.Module, tensors: Any, where: str, saved_name: Callable[[str], str] = lambda name: name
) -> None:
    """Fill every tensor of `model`'s state dict from `tensors` (a mapping, or a lazy reader with `in`
    and `[]` that reads one tensor at a time), under its saved name `saved_name(name)`: the one way
    merit loads weights into a model, for resuming and rewinding a run and for inspecting a checkpoint.

    A key saved without the base-model prefix (older GPT-2 files) is accepted; the tied output layer
    may be absent (it follows the embedding). A missing weight or one of another shape is a
    CheckpointError naming `where`, never a silent random init."""
    prefix = getattr(model, "base_model_prefix", "") + "."
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    missing = []
    with torch.no_grad():
        for name, target in model.state_dict().items():  # tensors sharing storage with the model
            key = saved_name(name)
            if key not in tensors and key.startswith(prefix):
                key = key[len(prefix) :]
            if key not in tensors:
                if not (tied and name == "lm_head.weight"):
                    missing.append(name)
                continue
            value = tensors[key]  # one tensor in memory at a time
            if tuple(value.shape) != tuple(target.shape):
                raise CheckpointError(
                    f"{where} does not match the model: {key} is {list(value.shape)}, "
                    f"the model has {list(target.shape)}"
                )
            target.copy_(value)
    if missing:
        raise CheckpointError(
            f"{where} does not match the model: it lacks {len(missing)} weights the model needs, e.g. {missing[0]}"
        )
    if tied:
        model.tie_weights()  # type: ignore[operator]
