"""Where a checkpoint's attention weights are: the family, the layer prefix, the head layout.

Works on any name -> tensor mapping (a lazily-read safetensors checkpoint or a live model's state
dict), by the tensor names and shapes and, when there is one, the checkpoint's config.json. The
family's knowledge (where W_Q / W_K sit, how a fused QKV matrix splits) is in
`merit_core.models.family`; this module finds which family a checkpoint is and hands out its
W_Q / W_K (and biases) in the stored orientation.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from merit_core.errors import CheckpointError, ConfigError
from merit_core.models.family import CONV1D, FUSED_PER_HEAD, FamilySpec, all_families, get_family
from merit_core.models.limits import check_raw_config


@dataclass(frozen=True)
class AttentionLayout:
    """Where one checkpoint's attention weights sit and how they split into heads."""

    spec: FamilySpec
    prefix: str  # 'transformer.' / 'model.' / '' (older GPT-2 checkpoints) ...
    n_layers: int
    d_model: int
    n_heads: int | None  # None: unknown (no config and none given), no per-head stats
    n_kv_heads: int | None
    head_dim: int | None
    q_features: int  # output features of W_Q / W_K
    k_features: int

    @property
    def family(self) -> str:
        return self.spec.model_type

    def q_name(self, layer: int) -> str:
        return self.prefix + self.spec.attention.q_name(layer)

    def k_name(self, layer: int) -> str:
        return self.prefix + self.spec.attention.k_name(layer)

    @property
    def row_axis(self) -> str:
        """What a stored row of W_Q / W_K indexes: 'input' (GPT-2 Conv1D) or 'output' (Linear)."""
        return "input" if self.spec.attention.orientation == CONV1D else "output"

    @property
    def out_axis(self) -> int:
        return self.spec.attention.out_axis

    @property
    def head_split(self) -> tuple[int, int, int] | None:
        """``(n_heads, n_kv_heads, head_dim)`` when the head count is known (the three are then set together)."""
        if not self.n_heads or not self.n_kv_heads or not self.head_dim:
            return None
        return self.n_heads, self.n_kv_heads, self.head_dim


def tensor_shape(tensors: Mapping, name: str) -> tuple[int, ...]:
    shape = getattr(tensors, "shape", None)
    return tuple(shape(name)) if callable(shape) else tuple(tensors[name].shape)


def _naming_families() -> list[FamilySpec]:
    """One family per distinct weight naming, the first registered (GPT-2, Llama, Phi-3, GPT-NeoX)."""
    seen, out = set(), []
    for spec in all_families():
        key = (spec.attention.block, spec.attention.qkv or spec.attention.q)
        if key not in seen:
            seen.add(key)
            out.append(spec)
    return out


def _unknown_naming(names: list[str]) -> CheckpointError:
    sample = ", ".join(sorted(names)[:6]) or "no tensors"
    known = "; ".join(f"{s.label} '{s.attention.q_name(0)}'" for s in _naming_families())
    return CheckpointError(
        f"unknown architecture: no attention weights named like any supported family ({known}) "
        f"among {len(names)} tensors, e.g. {sample}"
    )


def read_config(path: Path | None) -> dict | None:
    """config.json as a dict (None when absent); a corrupt file is a CheckpointError."""
    if path is None:
        return None
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"{path} is not a readable JSON config: {exc}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} is not a JSON object")
    return check_raw_config(data, str(path))


def _matches(tensors: Mapping, spec: FamilySpec) -> list:
    pattern = spec.attention.pattern()
    return [m for m in map(pattern.match, tensors.keys()) if m]


def detect_layout(tensors: Mapping, config: dict | None = None, n_heads: int | None = None) -> AttentionLayout:
    """The attention layout from tensor names and shapes, checked against `config` (a config.json dict).

    With a config its model_type names the family; without one the family is guessed from the
    weight names (any Llama-style naming reads as 'llama': the statistics are the same).
    `n_heads` supplies the head count when there is no config. Raises CheckpointError for unknown
    naming or weights that do not match the config, ConfigError for an unsupported model_type.
    """
    names = list(tensors.keys())
    if config is not None:
        model_type = config.get("model_type")
        try:
            spec = get_family(model_type)
        except ConfigError as exc:
            raise ConfigError(f"unknown architecture: config.json: {exc}") from None
        hits = _matches(tensors, spec)
        if not hits:
            other = next((s for s in _naming_families() if _matches(tensors, s)), None)
            if other is None:
                raise _unknown_naming(names)
            raise CheckpointError(
                f"config.json says {model_type!r} but the weights are named like {other.model_type!r}"
            )
    else:
        found = next(((s, h) for s in _naming_families() if (h := _matches(tensors, s))), None)
        if found is None:
            raise _unknown_naming(names)
        spec, hits = found
    prefix = hits[0].group(1)
    layers = sorted({int(m.group(2)) for m in hits if m.group(1) == prefix})
    if layers != list(range(len(layers))):
        raise CheckpointError(f"attention layers are not numbered 0..{len(layers) - 1}: found {layers}")
    layout = _shapes(tensors, spec, prefix, len(layers), config, n_heads)
    embed = f"{prefix}{spec.embedding}"
    if config is not None and embed in tensors:
        _expect(
            config, "vocab_size", tensor_shape(tensors, embed)[0], f"{embed} is {list(tensor_shape(tensors, embed))}"
        )
    for layer in range(1, len(layers)):  # every layer must have the shapes of layer 0
        for name in {layout.q_name(layer), layout.k_name(layer)}:
            if name not in tensors or tensor_shape(tensors, name) != tensor_shape(
                tensors, name.replace(f".{layer}.", ".0.", 1)
            ):
                raise CheckpointError(f"{name} is missing or shaped unlike layer 0")
    return layout


def _shapes(tensors, spec: FamilySpec, prefix: str, n_layers: int, config, n_heads) -> AttentionLayout:
    """Head count, key heads, head size and feature counts from layer 0's shapes (and the config)."""
    att = spec.attention
    q_name, k_name = prefix + att.q_name(0), prefix + att.k_name(0)
    if k_name not in tensors:
        raise CheckpointError(f"{spec.label} checkpoint has {q_name} but no {k_name}")
    qs, ks = tensor_shape(tensors, q_name), tensor_shape(tensors, k_name)
    if len(qs) != 2 or len(ks) != 2:
        raise CheckpointError(f"{spec.label} attention weights should be 2-D, found {list(qs)} and {list(ks)}")
    in_axis = 1 - att.out_axis
    d = qs[in_axis]
    if ks[in_axis] != d:
        raise CheckpointError(f"{spec.label} {q_name} {list(qs)} and {k_name} {list(ks)} read different input sizes")
    where = "config.json does not match the weights: " if config is not None else ""
    if config is not None:
        _expect(config, spec.hidden_key, d, f"layer 0 {att.qkv or att.q} is {list(qs)}")
        _expect(config, spec.layers_key, n_layers, f"the weights have {n_layers} layers")
        heads = spec.n_heads(config)
        kv_heads = spec.n_kv_heads(config)
        head_dim = config.get("head_dim") or (d // heads if heads else None)
    else:
        heads, kv_heads, head_dim = n_heads, None, None
    out = qs[att.out_axis]
    if att.fused is None:
        q_out, k_out = out, ks[att.out_axis]
    elif att.fused == FUSED_PER_HEAD or spec.kv_heads_key is None:  # Q, K, V of d features each
        if out % 3:
            raise CheckpointError(f"{spec.label} {q_name} should hold Q, K and V of equal size, found {list(qs)}")
        q_out = k_out = out // 3
    else:  # Q | K | V with grouped key heads: needs the query size
        if not head_dim and heads and d % heads == 0:
            head_dim = d // heads
        if not heads or not head_dim:
            raise CheckpointError(f"{spec.label} fused {att.qkv} needs the head count to split: pass --heads N")
        q_out = heads * head_dim
        if (out - q_out) <= 0 or (out - q_out) % 2:
            raise CheckpointError(f"{where}{q_name} {list(qs)} does not hold {heads} query heads of {head_dim}")
        k_out = (out - q_out) // 2
    if heads:
        if config is None or not head_dim:
            head_dim = q_out // heads if q_out % heads == 0 else None
        if head_dim is None or heads * head_dim != q_out:
            raise CheckpointError(f"{where}{heads} heads do not divide the {q_out} query features of layer 0")
        if kv_heads is None and k_out % head_dim == 0:
            kv_heads = k_out // head_dim
        if not kv_heads or kv_heads * head_dim != k_out or heads % kv_heads:
            raise CheckpointError(f"{where}layer 0 has {k_out} key features, not {kv_heads} key heads of {head_dim}")
    elif att.fused == FUSED_PER_HEAD:
        raise CheckpointError(f"{spec.label} {att.qkv} interleaves heads: pass --heads N to split it")
    else:
        head_dim = kv_heads = None
    return AttentionLayout(spec, prefix, n_layers, d, heads, kv_heads, head_dim, q_out, k_out)


def _expect(config: dict, key: str, actual: int, what: str) -> None:
    if key in config and config[key] != actual:
        raise CheckpointError(f"config.json does not match the weights: {key}={config[key]} but {what}")


def query_key(tensors: Mapping, layout: AttentionLayout, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """W_Q and W_K of one layer, in the stored orientation, output features in head order."""
    att = layout.spec.attention
    if att.fused is None:
        return tensors[layout.q_name(layer)], tensors[layout.k_name(layer)]
    w = tensors[layout.q_name(layer)]
    q_out, k_out = layout.q_features, layout.k_features
    if att.fused == FUSED_PER_HEAD:  # rows [q_0 | k_0 | v_0 | q_1 | k_1 | v_1 | ...]
        h, hd = layout.n_heads, layout.head_dim
        per_head = w.reshape(h, 3, hd, w.shape[1])
        return per_head[:, 0].reshape(q_out, -1), per_head[:, 1].reshape(k_out, -1)
    if att.out_axis == 1:
        return w[:, :q_out], w[:, q_out : q_out + k_out]
    return w[:q_out], w[q_out : q_out + k_out]


def query_key_bias(tensors: Mapping, layout: AttentionLayout, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The query and key biases of one layer in head order (zeros where the family has none)."""
    att = layout.spec.attention
    q_out, k_out = layout.q_features, layout.k_features
    qb, kb = layout.q_name(layer)[: -len("weight")] + "bias", layout.k_name(layer)[: -len("weight")] + "bias"
    if att.fused is None:
        q = tensors[qb].float() if qb in tensors else torch.zeros(q_out)
        return q, tensors[kb].float() if kb in tensors else torch.zeros(k_out)
    if qb not in tensors:
        return torch.zeros(q_out), torch.zeros(k_out)
    b = tensors[qb].float()
    if att.fused == FUSED_PER_HEAD:
        per_head = b.reshape(layout.n_heads, 3, layout.head_dim)
        return per_head[:, 0].reshape(-1), per_head[:, 1].reshape(-1)
    return b[:q_out], b[q_out : q_out + k_out]
