"""A model's forward pass holding one decoder layer's weights at a time, read from the checkpoint.

A checkpoint of 7B-70B parameters does not fit in host memory in float32, but a forward pass
needs only the layer it is running. The model is built on the meta device (accelerate's
`init_empty_weights`: parameters without storage, buffers such as rotary frequencies real), and
its weights are materialised just in time by forward hooks: before a unit runs, its parameters
are read from the name -> tensor mapping (a lazy safetensors reader: one tensor at a time, any
shard layout), moved to the device and upcast to float32 there; after it ran they go back to
the meta device, their float32 buffers kept for the next unit of the same shapes to upcast into
(every layer after the first writes into memory already mapped, rather than faulting in fresh
pages for each layer). A unit is a decoder layer, or any other module owning parameters directly (the
token and position embeddings, the final norm, the output head).

The model's own forward runs unchanged (masks, position ids, rotary embeddings, sliding windows,
soft-capping: whatever each family's code gives its layers), so every probe that works on a
whole model works on this one and measures the same numbers: the float32 weights are the same
values the whole-model loader copies in, and the same code multiplies them.

On a CUDA device the next unit's weights are read and moved by a background thread while the
current unit runs; on the CPU units are read in turn (reading ahead would hold two layers).

    model = layered_model(config, reader, "cuda")
    result = probe_attention(model, ids, inputs=True, instability=True)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from merit_core.errors import CheckpointError
from merit_core.models import build_model, family_spec

# (unit name, {stored name: the tensor's values, see `_tapped`}) when a unit's weights are read
TensorTap = Callable[[str, dict[str, torch.Tensor]], None]


@dataclass
class Unit:
    """A module whose parameters are read together: a decoder layer, or a module owning parameters
    outside the layers. `params`: (owning submodule, attribute, model name, stored names to try)."""

    name: str
    module: torch.nn.Module
    params: list[tuple[torch.nn.Module, str, str, list[str]]] = field(default_factory=list)


def empty_model(config) -> Any:
    """The causal LM `config` builds, in float32, with every parameter on the meta device (no memory,
    no random initialisation) and its buffers real, on the CPU."""
    from accelerate import init_empty_weights  # type: ignore[import-untyped]

    with init_empty_weights(include_buffers=False):
        model = build_model(config)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()  # the meta context made the tied head a parameter of its own: one again
    return model.eval()


def _stored_names(model: Any, name: str, aliases: list[str]) -> list[str]:
    """The names a model parameter may be stored under: its own (as save_pretrained renames it, and
    without the base-model prefix, as older GPT-2 files have it), then those of the parameters tied
    to it (an output head tied to the embedding is not stored)."""
    spec = family_spec(model.config)
    prefix = model.base_model_prefix + "."
    out: list[str] = []
    for candidate in [name, *aliases]:
        saved = spec.saved_name(candidate)
        for key in (saved, saved[len(prefix) :] if saved.startswith(prefix) else None):
            if key is not None and key not in out:
                out.append(key)
    return out


def model_units(model: Any) -> list[Unit]:
    """The model's units in the order its forward runs them: the modules owning parameters before
    the first decoder layer, the layers, the modules after (the order they are registered in,
    which is their order of execution in every supported family)."""
    spec = family_spec(model.config)
    layer_paths = {
        f"{model.base_model_prefix}.{spec.attention.layer_block.format(i=i)}"
        for i in range(spec.n_layers(model.config))
    }
    ties: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        ties.setdefault(id(param), []).append(name)
    units: dict[str, Unit] = {}
    modules = dict(model.named_modules())
    for name, param in model.named_parameters(remove_duplicate=False):
        owner_path, _, attr = name.rpartition(".")
        unit_path = next((p for p in layer_paths if name.startswith(p + ".")), owner_path)
        unit = units.get(unit_path)
        if unit is None:
            unit = units[unit_path] = Unit(unit_path, modules[unit_path])
        aliases = [n for n in ties[id(param)] if n != name]
        unit.params.append((modules[owner_path], attr, name, _stored_names(model, name, aliases)))
    return list(units.values())


class _Loader:
    """Reads units' weights from `tensors` onto `device`; with `prefetch`, one unit ahead in a thread
    (started at the first unit of a pass, stopped after the last)."""

    def __init__(self, units: list[Unit], tensors: Mapping, device: torch.device, prefetch: bool, tap):
        self.units = units
        self.order = {unit.name: i for i, unit in enumerate(units)}
        self.tensors = tensors
        self.device = device
        self.prefetch = prefetch
        self.tap = tap
        self.pool: ThreadPoolExecutor | None = None
        self.pending: dict[str, Future] = {}
        # float32 buffers of upcast weights: those the running unit holds (model name -> buffer), and
        # those the unit that ran last freed, by (shape, device), for the next unit to upcast into
        self.owned: dict[str, torch.Tensor] = {}
        self.spare: dict[tuple[tuple[int, ...], torch.device], list[torch.Tensor]] = {}

    def read(self, unit: Unit) -> dict[str, tuple[str, torch.Tensor]]:
        """{model name: (stored name, the stored tensor on the device, in its stored dtype)} for every
        parameter of `unit`."""
        out = {}
        for owner, attr, name, keys in unit.params:
            key = next((k for k in keys if k in self.tensors), None)
            if key is None:
                raise CheckpointError(f"the checkpoint lacks {name}, a weight the config needs")
            value = self.tensors[key]
            target = owner._parameters[attr]
            assert target is not None
            if tuple(value.shape) != tuple(target.shape):
                raise CheckpointError(
                    f"config.json does not match the weights: {key} is {list(value.shape)}, "
                    f"the config builds {list(target.shape)}"
                )
            out[name] = (key, value.to(self.device))
        return out

    def take(self, unit: Unit) -> dict[str, tuple[str, torch.Tensor]]:
        """`unit`'s weights (read ahead, or now), and the next unit's read started."""
        future = self.pending.pop(unit.name, None)
        weights = future.result() if future is not None else self.read(unit)
        nxt = self.order[unit.name] + 1
        if self.prefetch and nxt < len(self.units):
            if self.pool is None:
                self.pool = ThreadPoolExecutor(1, thread_name_prefix="merit-weights")
            if self.units[nxt].name not in self.pending:
                self.pending[self.units[nxt].name] = self.pool.submit(self.read, self.units[nxt])
        elif nxt == len(self.units):
            self.close()
        return weights

    def close(self) -> None:
        """Stop reading ahead (the pass ended, or failed)."""
        for future in self.pending.values():
            future.cancel()
        self.pending.clear()
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None


def check_weights(units: list[Unit], tensors: Mapping, where: str) -> None:
    """CheckpointError unless `tensors` holds every parameter of `units` in its shape (read from the
    file headers where `tensors` can tell shapes, as a lazy safetensors reader does)."""
    missing = []
    for unit in units:
        for owner, attr, name, keys in unit.params:
            key = next((k for k in keys if k in tensors), None)
            if key is None:
                missing.append(name)
                continue
            shape = getattr(tensors, "shape", None)
            stored = tuple(shape(key)) if callable(shape) else tuple(tensors[key].shape)
            target = owner._parameters[attr]
            assert target is not None
            if stored != tuple(target.shape):
                raise CheckpointError(
                    f"config.json does not match the weights: {key} is {list(stored)}, "
                    f"the config builds {list(target.shape)}"
                )
    if missing:
        raise CheckpointError(f"{where} lacks {len(missing)} weights the config needs, e.g. {missing[0]}")


def _tapped(stored: torch.Tensor, upcast: torch.Tensor) -> torch.Tensor:
    """What the tap gets of a stored tensor: its float32 upcast where that holds the same values
    (half, bfloat16, float8 and float32 files: statistics of it equal those of the stored tensor,
    and float32 kernels are the fast ones), the stored tensor where it would round (float64)."""
    return upcast if stored.dtype.itemsize <= 4 else stored


def _install(unit: Unit, loader: _Loader) -> None:
    """Forward hooks that materialise `unit`'s parameters in float32 before it runs and drop them after
    (the float32 buffers it upcast into to the loader's spares, for the next unit's upcast)."""
    empty = {name: owner._parameters[attr] for owner, attr, name, _ in unit.params}

    def before(module, args):
        stored = loader.take(unit)
        weights, tapped = {}, {}
        spare, loader.spare = loader.spare, {}
        for name in list(stored):  # upcast once, for the model and the tap; each stored copy freed in turn
            key, value = stored.pop(name)
            if value.dtype == torch.float32:  # already float32: the tensor as read (perhaps the caller's own)
                weights[name] = value
            else:  # into a float32 buffer the previous unit freed where one fits (no fresh pages to fault in)
                shelf = spare.get((tuple(value.shape), value.device))
                buffer = shelf.pop() if shelf else torch.empty(value.shape, device=value.device)
                weights[name] = loader.owned[name] = buffer.copy_(value)
            tapped[key] = _tapped(value, weights[name])
            del value
        del spare  # buffers of shapes this unit has none of: freed now, as before the pool
        if loader.tap is not None:
            loader.tap(unit.name, tapped)
        del tapped
        for owner, attr, name, _ in unit.params:
            owner._parameters[attr] = torch.nn.Parameter(weights.pop(name), requires_grad=False)

    def after(module, args, output):
        for owner, attr, name, _ in unit.params:
            owner._parameters[attr] = empty[name]
            buffer = loader.owned.pop(name, None)
            if buffer is not None:  # for the next unit's upcast
                loader.spare.setdefault((tuple(buffer.shape), buffer.device), []).append(buffer)

    unit.module.register_forward_pre_hook(before)
    unit.module.register_forward_hook(after)


def layered_model(
    config,
    tensors: Mapping,
    device: str | torch.device = "cpu",
    prefetch: bool | None = None,
    tap: TensorTap | None = None,
    where: str = "the checkpoint",
) -> Any:
    """A float32 causal LM of `config` whose forward passes read each unit's weights from `tensors`
    (a name -> tensor mapping as stored) when the unit runs and free them after it ran.

    `prefetch`: read the next unit while the current one runs (default: on CUDA devices).
    `tap`: called with each unit's name and its stored tensors ({stored name: tensor}, on the
    device, upcast to float32 where that is exact, i.e. the model's own float32 weights) as they
    are read, so statistics of the weights can be taken from the same read and the same upcast
    (during the call: the next unit upcasts into the same memory). A missing weight, or one of another shape, is a CheckpointError here (`where`
    names the checkpoint in it), before anything is read. The model is for forward passes only (no `.to()`, no training, no state dict).
    """
    device = torch.device(device)
    model = empty_model(config)
    for module in model.modules():  # the buffers (rotary frequencies, embedding scales) to the device
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = buffer.to(device)
    units = model_units(model)
    check_weights(units, tensors, where)
    loader = _Loader(units, tensors, device, device.type == "cuda" if prefetch is None else prefetch, tap)
    for unit in units:
        _install(unit, loader)
    return model
