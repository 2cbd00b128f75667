"""Which parameter is which (embedding, head, hidden matrix, vector) and the weight-decay groups built from that.

Roles, decided by module type and never by parameter name:

- ``"embedding"``: the weight of every ``nn.Embedding`` / ``nn.EmbeddingBag`` and of
  ``model.get_input_embeddings()`` (token and position embeddings).
- ``"head"``: ``model.get_output_embeddings().weight`` (the LM head) when it is *not* tied to an
  embedding. A tied head is the same tensor as the token embedding and is listed once, as
  ``"embedding"``, under its first name (``transformer.wte.weight`` for GPT-2).
- ``"vector"``: every other parameter with fewer than 2 dimensions (biases, norm gains).
- ``"hidden"``: every other parameter with 2 or more dimensions (the hidden weight matrices).

Without a module (a plain iterable of tensors or of ``(name, tensor)`` pairs) nothing is known
about embeddings or heads: tensors with 2+ dims are ``"hidden"``, the rest ``"vector"``. Pass the
model when that distinction matters (weight-decay on embeddings, Muon's AdamW part).
Only parameters with ``requires_grad`` are returned; a tensor reachable twice is returned once.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from merit_core.errors import ConfigError


@dataclass(frozen=True)
class NamedParam:
    """One trainable tensor with its (first) qualified name and its role (see module docstring)."""

    name: str
    param: torch.Tensor
    role: str

    @property
    def is_embedding_like(self) -> bool:
        """True for token/position embeddings and the LM head: the tensors `decay_embeddings` controls."""
        return self.role in ("embedding", "head")


def _embedding_ids(model: nn.Module) -> tuple[set[int], set[int]]:
    """Return (ids of embedding weights, ids of output-embedding (head) weights) of `model`."""
    embedding: set[int] = set()
    for module in model.modules():
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
            embedding.add(id(module.weight))
    head: set[int] = set()
    for getter, target in (("get_input_embeddings", embedding), ("get_output_embeddings", head)):
        fn = getattr(model, getter, None)
        if not callable(fn):
            continue
        try:
            module = fn()
        except (NotImplementedError, AttributeError):
            continue
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor):
            target.add(id(weight))
    return embedding, head - embedding


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's module inside ``DistributedDataParallel`` / ``DataParallel`` / ``torch.compile`` wrappers."""
    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif isinstance(inner := getattr(model, "_orig_mod", None), nn.Module):
            model = inner
        else:
            return model


def _role(param: torch.Tensor, embedding: set[int], head: set[int]) -> str:
    if id(param) in embedding:
        return "embedding"
    if id(param) in head:
        return "head"
    return "hidden" if param.ndim >= 2 else "vector"


def classify_parameters(model_or_params: nn.Module | Iterable[Any]) -> list[NamedParam]:
    """List the trainable tensors of a module or iterable, each once, in order, with name and role.

    Accepts an ``nn.Module`` (DDP / compile wrappers are looked through, so names carry no
    ``module.`` / ``_orig_mod.`` prefix), an iterable of tensors (named ``"param_0"``, ``"param_1"``, ...) or
    an iterable of ``(name, tensor)`` pairs such as ``model.named_parameters()``.
    """
    named: list[tuple[str, torch.Tensor]]
    if isinstance(model_or_params, nn.Module):
        model = unwrap_model(model_or_params)
        embedding, head = _embedding_ids(model)
        named = list(model.named_parameters())  # drops tied duplicates, keeps the first name
    else:
        embedding, head = set(), set()
        if isinstance(model_or_params, torch.Tensor):
            raise TypeError("pass a model or an iterable of parameters, not a single tensor")
        named = []
        for i, item in enumerate(model_or_params):
            if isinstance(item, dict):
                raise TypeError(
                    "build param groups from a model or an iterable of parameters; to use your own "
                    "param-group dicts, construct the optimizer class directly"
                )
            if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
                named.append(item)
            elif isinstance(item, torch.Tensor):
                named.append((f"param_{i}", item))
            else:
                raise TypeError(f"expected a tensor or a (name, tensor) pair, got {type(item).__name__}")
    seen: set[int] = set()
    out: list[NamedParam] = []
    for name, param in named:
        if id(param) in seen or not param.requires_grad:
            continue
        seen.add(id(param))
        out.append(NamedParam(name, param, _role(param, embedding, head)))
    if not out:
        raise ConfigError("there are no trainable parameters to optimize (all are frozen or the list is empty)")
    return out


def decays(item: NamedParam, decay_embeddings: bool = True) -> bool:
    """Whether weight decay applies: hidden matrices yes, vectors no, embeddings/head per `decay_embeddings`."""
    if item.role == "vector":
        return False
    if item.is_embedding_like:
        return decay_embeddings
    return True


def make_group(name: str, items: list[NamedParam], **options: Any) -> dict[str, Any]:
    """A param-group dict: ``params``, ``param_names`` (kept in the optimizer's state_dict), ``name``, `options`."""
    return {
        "params": [i.param for i in items],
        "param_names": [i.name for i in items],
        "name": name,
        **options,
    }


def build_param_groups(
    model_or_params: nn.Module | Iterable[Any],
    weight_decay: float,
    *,
    decay_embeddings: bool = True,
) -> list[dict[str, Any]]:
    """Two groups, ``"decay"`` (``weight_decay``) and ``"no_decay"`` (0.0); an empty group is left out.

    1-D parameters never decay; embeddings and the LM head decay unless ``decay_embeddings=False``.
    Each group carries ``param_names`` so logs and diagnostics can tell which tensor is which.
    """
    return decay_groups(classify_parameters(model_or_params), weight_decay, decay_embeddings)


def decay_groups(
    items: list[NamedParam], weight_decay: float, decay_embeddings: bool = True, prefix: str = "", **options: Any
) -> list[dict[str, Any]]:
    """`items` as a ``prefix + "decay"`` group (``weight_decay``) and a ``prefix + "no_decay"`` group
    (0.0), each with `options`; an empty group is left out."""
    decay = [i for i in items if decays(i, decay_embeddings)]
    no_decay = [i for i in items if not decays(i, decay_embeddings)]
    named = ((f"{prefix}decay", decay, weight_decay), (f"{prefix}no_decay", no_decay, 0.0))
    return [make_group(name, group, **options, weight_decay=wd) for name, group, wd in named if group]
