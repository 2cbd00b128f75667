"""Max-norm statistics of the query/key weights (and every other 2-D weight) of a checkpoint.

MERIT's argument: the max attention logit is bounded by ||W_Q||_m * ||W_K||_m (times constants
of the normalised input), so these max-norms, per layer and per head, are what to watch.
Everything here works on any name -> tensor mapping: a lazily-read safetensors checkpoint (one
tensor in memory at a time, no model built, no transformers import) or a live model's state dict.

Layouts (as stored):
- GPT-2: `c_attn.weight` is a Conv1D weight [d_in, 3*d] holding Q | K | V along dim 1, so W_Q
  is `c_attn[:, :d]`, W_K is `c_attn[:, d:2d]`; rows are input features, columns are output
  features, and head h owns columns h*hd:(h+1)*hd.
- Llama: `q_proj.weight` [H*hd, d] and `k_proj.weight` [Hkv*hd, d] are Linear weights; rows are
  output features (head h owns rows h*hd:(h+1)*hd), columns are input features. With grouped
  query heads, query head h reads key head h // (H / Hkv).
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from merit_core.errors import CheckpointError, ConfigError, MeritError

_GPT2_QKV = re.compile(r"^((?:transformer\.)?)h\.(\d+)\.attn\.c_attn\.weight$")
_LLAMA_Q = re.compile(r"^((?:model\.)?)layers\.(\d+)\.self_attn\.q_proj\.weight$")
FAMILIES = ("gpt2", "llama")
PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class AttentionLayout:
    """Where the attention weights sit and how they split into heads."""

    family: str  # 'gpt2' | 'llama'
    prefix: str  # 'transformer.' / 'model.' / '' (older GPT-2 checkpoints)
    n_layers: int
    d_model: int
    n_heads: int | None  # None: unknown (no config and none given), no per-head stats
    n_kv_heads: int | None
    head_dim: int | None

    def q_name(self, layer: int) -> str:
        if self.family == "gpt2":
            return f"{self.prefix}h.{layer}.attn.c_attn.weight"
        return f"{self.prefix}layers.{layer}.self_attn.q_proj.weight"

    def k_name(self, layer: int) -> str:
        if self.family == "gpt2":
            return self.q_name(layer)
        return f"{self.prefix}layers.{layer}.self_attn.k_proj.weight"

    @property
    def row_axis(self) -> str:
        """What a stored row of W_Q / W_K indexes: 'input' (GPT-2 Conv1D) or 'output' (Llama)."""
        return "input" if self.family == "gpt2" else "output"


def _shape(tensors: Mapping, name: str) -> tuple[int, ...]:
    shape = getattr(tensors, "shape", None)
    return tuple(shape(name)) if callable(shape) else tuple(tensors[name].shape)


def _unknown_naming(names: list[str]) -> CheckpointError:
    sample = ", ".join(sorted(names)[:6]) or "no tensors"
    return CheckpointError(
        "unknown architecture: no GPT-2 ('h.N.attn.c_attn.weight') or Llama ('layers.N.self_attn.q_proj.weight') "
        f"attention weights among {len(names)} tensors, e.g. {sample}"
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
    return data


def detect_layout(tensors: Mapping, config: dict | None = None, n_heads: int | None = None) -> AttentionLayout:
    """The attention layout from tensor names and shapes, checked against `config` (a config.json dict).

    `n_heads` supplies the head count when there is no config. Raises CheckpointError for unknown
    naming or weights that do not match the config, ConfigError for an unsupported model_type.
    """
    names = list(tensors.keys())
    model_type = (config or {}).get("model_type")
    if config is not None and model_type not in FAMILIES:
        raise ConfigError(
            f"unknown architecture: config.json has model_type {model_type!r}; "
            "merit inspects 'gpt2' and 'llama' checkpoints"
        )
    found = {}
    for fam, pattern in (("gpt2", _GPT2_QKV), ("llama", _LLAMA_Q)):
        hits = [m for m in map(pattern.match, names) if m]
        if hits:
            found[fam] = hits
    if not found:
        raise _unknown_naming(names)
    fam = model_type if model_type in found else next(iter(found))
    if model_type is not None and model_type != fam:
        raise CheckpointError(f"config.json says {model_type!r} but the weights are named like {fam!r}")
    prefix = found[fam][0].group(1)
    layers = sorted(int(m.group(2)) for m in found[fam])
    if layers != list(range(len(layers))):
        raise CheckpointError(f"attention layers are not numbered 0..{len(layers) - 1}: found {layers}")
    shapes = _gpt2_shapes if fam == "gpt2" else _llama_shapes
    d, q_out, k_out, heads, kv_heads = shapes(tensors, prefix, len(layers), config, n_heads)
    head_dim = None
    if heads:
        where = "config.json does not match the weights: " if config is not None else ""
        head_dim = (config or {}).get("head_dim") or (q_out // heads if q_out % heads == 0 else None)
        if head_dim is None or heads * head_dim != q_out:
            raise CheckpointError(f"{where}{heads} heads do not divide the {q_out} query features of layer 0")
        if not kv_heads or kv_heads * head_dim != k_out or heads % kv_heads:
            raise CheckpointError(f"{where}layer 0 has {k_out} key features, not {kv_heads} key heads of {head_dim}")
    embed = f"{prefix}wte.weight" if fam == "gpt2" else f"{prefix}embed_tokens.weight"
    if config is not None and embed in tensors:
        _expect(config, "vocab_size", _shape(tensors, embed)[0], f"{embed} is {list(_shape(tensors, embed))}")
    layout = AttentionLayout(fam, prefix, len(layers), d, heads, kv_heads, head_dim)
    for layer in range(1, len(layers)):  # every layer must have the shapes of layer 0
        for name in {layout.q_name(layer), layout.k_name(layer)}:
            if name not in tensors or _shape(tensors, name) != _shape(tensors, name.replace(f".{layer}.", ".0.", 1)):
                raise CheckpointError(f"{name} is missing or shaped unlike layer 0")
    return layout


def _gpt2_shapes(tensors, prefix, n_layers, config, n_heads):
    """(d_model, query features, key features, heads, key heads) of a GPT-2 checkpoint."""
    shape = _shape(tensors, f"{prefix}h.0.attn.c_attn.weight")
    if len(shape) != 2 or shape[1] != 3 * shape[0]:
        raise CheckpointError(f"GPT-2 c_attn.weight should be [d, 3d] (Conv1D), found {list(shape)}")
    d = shape[0]
    if config is None:
        return d, d, d, n_heads, n_heads
    _expect(config, "n_embd", d, f"layer 0 c_attn is {list(shape)}")
    _expect(config, "n_layer", n_layers, f"the weights have {n_layers} layers")
    return d, d, d, config.get("n_head"), config.get("n_head")


def _llama_shapes(tensors, prefix, n_layers, config, n_heads):
    """(d_model, query features, key features, heads, key heads) of a Llama checkpoint (GQA allowed)."""
    k_name = f"{prefix}layers.0.self_attn.k_proj.weight"
    if k_name not in tensors:
        raise CheckpointError(f"Llama checkpoint has q_proj but no k_proj ({k_name})")
    qs, ks = _shape(tensors, f"{prefix}layers.0.self_attn.q_proj.weight"), _shape(tensors, k_name)
    if len(qs) != 2 or len(ks) != 2 or qs[1] != ks[1]:
        raise CheckpointError(f"Llama q_proj {list(qs)} and k_proj {list(ks)} should be [out, d] with the same d")
    d = qs[1]
    if config is None:  # key heads follow from the head count and the two shapes
        kv = n_heads * ks[0] // qs[0] if n_heads and (n_heads * ks[0]) % qs[0] == 0 else None
        return d, qs[0], ks[0], n_heads, kv
    _expect(config, "hidden_size", d, f"layer 0 q_proj is {list(qs)}")
    _expect(config, "num_hidden_layers", n_layers, f"the weights have {n_layers} layers")
    heads = config.get("num_attention_heads")
    return d, qs[0], ks[0], heads, config.get("num_key_value_heads") or heads


def _expect(config: dict, key: str, actual: int, what: str) -> None:
    if key in config and config[key] != actual:
        raise CheckpointError(f"config.json does not match the weights: {key}={config[key]} but {what}")


def _quantiles(values: torch.Tensor) -> dict[str, float]:
    qs = torch.quantile(values.float(), torch.tensor([p / 100 for p in PERCENTILES]))
    out = {f"p{p}": float(v) for p, v in zip(PERCENTILES, qs)}
    out["min"], out["max"] = float(values.min()), float(values.max())
    return out


def _distribution(maxes: torch.Tensor, top_k: int, head_dim: int | None) -> dict:
    """Percentiles of per-row (or per-column) max-norms and the top-k entries with their ratio to the median."""
    dist = _quantiles(maxes)
    median = dist["p50"]
    k = min(top_k, maxes.numel())
    vals, idx = torch.topk(maxes, k)
    dist["outliers"] = [
        {
            "index": int(i),
            "max_norm": float(v),
            "x_median": float(v) / median if median > 0 else None,
            **({"head": int(i) // head_dim} if head_dim else {}),
        }
        for v, i in zip(vals, idx)
    ]
    return dist


def matrix_stats(w: torch.Tensor, top_k: int = 3, head_axis: int | None = None, head_dim: int | None = None) -> dict:
    """max-norm, l2 norm, their ratio, and row / column max-norm distributions of a 2-D weight.

    `head_axis` (0 rows, 1 columns) is the output-feature axis, split into heads of `head_dim`:
    outliers along it are tagged with their head, and "head_max_norm" / "head_l2_norm" list the
    per-head norms. Two passes over the weight; per-head numbers come from per-feature vectors.
    """
    w = w.detach().float().contiguous()  # GPT-2's Q / K are column slices of c_attn
    a = w.abs()
    row_max, col_max = a.amax(dim=1), a.amax(dim=0)
    del a
    max_norm = float(row_max.max())
    out = {
        "rows": _distribution(row_max, top_k, head_dim if head_axis == 0 else None),
        "cols": _distribution(col_max, top_k, head_dim if head_axis == 1 else None),
    }
    if head_axis is None:
        l2 = float(torch.linalg.vector_norm(w))
    else:
        feature_sq = (w * w).sum(dim=1 - head_axis, dtype=torch.float64)  # squared l2 per output feature
        l2 = float(feature_sq.sum().sqrt())
        if head_dim:
            per_head_max = (row_max if head_axis == 0 else col_max).view(-1, head_dim).amax(dim=1)
            out["head_max_norm"] = per_head_max.tolist()
            out["head_l2_norm"] = feature_sq.view(-1, head_dim).sum(dim=1).sqrt().tolist()
    return {"max_norm": max_norm, "l2_norm": l2, "max_over_l2": max_norm / l2 if l2 > 0 else None, **out}


def _qk(tensors: Mapping, layout: AttentionLayout, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    if layout.family == "gpt2":
        qkv = tensors[layout.q_name(layer)]
        d = layout.d_model
        return qkv[:, :d], qkv[:, d : 2 * d]
    return tensors[layout.q_name(layer)], tensors[layout.k_name(layer)]


def layer_stats(tensors: Mapping, layout: AttentionLayout, layer: int, top_k: int = 3) -> dict:
    """One layer's W_Q / W_K statistics, per head when the head count is known."""
    q, k = _qk(tensors, layout, layer)
    axis = 1 if layout.family == "gpt2" else 0  # the output-feature axis, split into heads
    hd = layout.head_dim
    qs, ks = matrix_stats(q, top_k, axis, hd), matrix_stats(k, top_k, axis, hd)
    out = {
        "layer": layer,
        "q_max_norm": qs["max_norm"],
        "k_max_norm": ks["max_norm"],
        "q_l2_norm": qs["l2_norm"],
        "k_l2_norm": ks["l2_norm"],
        "q_max_over_l2": qs["max_over_l2"],
        "k_max_over_l2": ks["max_over_l2"],
        "bound": qs["max_norm"] * ks["max_norm"],
        "max_attention_logit": None,
        "heads": [],
        "q_rows": qs["rows"],
        "q_cols": qs["cols"],
        "k_rows": ks["rows"],
        "k_cols": ks["cols"],
    }
    if layout.n_heads:
        qm, ql, km, kl = qs["head_max_norm"], qs["head_l2_norm"], ks["head_max_norm"], ks["head_l2_norm"]
        group = layout.n_heads // layout.n_kv_heads
        for h in range(layout.n_heads):
            kv = h // group
            out["heads"].append(
                {
                    "head": h,
                    "kv_head": kv,
                    "q_max_norm": qm[h],
                    "k_max_norm": km[kv],
                    "q_l2_norm": ql[h],
                    "k_l2_norm": kl[kv],
                    "bound": qm[h] * km[kv],
                    "max_attention_logit": None,
                }
            )
    return out


def _max_abs(w: torch.Tensor) -> float:
    lo, hi = torch.aminmax(w)  # one pass, no |w| temporary (matters for embeddings)
    return max(-float(lo), float(hi))


def other_weights(tensors: Mapping) -> list[dict]:
    """A one-line summary (shape, max-norm, l2 norm) of every 2-D tensor, in name order."""
    out = []
    for name in sorted(tensors.keys()):
        if len(_shape(tensors, name)) != 2:
            continue
        w = tensors[name].detach()
        if not w.is_floating_point():
            continue
        out.append(
            {
                "name": name,
                "shape": list(w.shape),
                "max_norm": _max_abs(w),
                "l2_norm": float(torch.linalg.vector_norm(w, dtype=torch.float32)),
            }
        )
        del w
    return out


def attention_weight_stats(
    tensors: Mapping, config: dict | None = None, n_heads: int | None = None, top_k: int = 3, include_other: bool = True
) -> dict:
    """Statistics of one set of weights (a lazy checkpoint reader or a state dict), in the JSON shape.

    Returns {"architecture", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_model",
    "row_axis", "layers": [layer_stats...], "weights": [other_weights...], "notes": [...]}.
    """
    layout = detect_layout(tensors, config, n_heads)
    notes = []
    if not layout.n_heads:
        notes.append("per-head statistics need the head count: no config.json next to the weights (pass --heads N)")
    return {
        "architecture": layout.family,
        "n_layers": layout.n_layers,
        "n_heads": layout.n_heads,
        "n_kv_heads": layout.n_kv_heads,
        "head_dim": layout.head_dim,
        "d_model": layout.d_model,
        "row_axis": layout.row_axis,
        "layers": [layer_stats(tensors, layout, i, top_k) for i in range(layout.n_layers)],
        "weights": other_weights(tensors) if include_other else [],
        "notes": notes,
    }


@contextlib.contextmanager
def checkpoint_context(path):
    """Prefix user errors raised inside the block with the checkpoint they concern."""
    try:
        yield
    except MeritError as exc:
        if str(path) in str(exc):
            raise
        raise type(exc)(f"{path}: {exc}") from None


def model_weight_stats(model, top_k: int = 3, include_other: bool = False) -> dict:
    """The same statistics for a live transformers model (e.g. from a training loop), no copies."""
    for wrapper in ("_orig_mod", "module"):  # torch.compile / DDP wrappers
        model = getattr(model, wrapper, model)
    with torch.no_grad():
        return attention_weight_stats(
            model.state_dict(), model.config.to_dict(), top_k=top_k, include_other=include_other
        )


def weight_stats(path, n_heads: int | None = None, top_k: int = 3, include_other: bool = True) -> dict:
    """Weight statistics of one checkpoint (safetensors file, sharded index or HF folder), lazily read.

    Adds "path" and "step" to `attention_weight_stats`'s dict. A run folder with several step_*
    checkpoints is a CheckpointError here: use `find_checkpoints` and call this per checkpoint.
    """
    from merit_core.diagnostics.checkpoints import Checkpoint, SafetensorsReader, find_checkpoints

    if isinstance(path, Checkpoint):
        ckpt = path
    else:
        found = find_checkpoints(path)
        if len(found) != 1:
            raise CheckpointError(f"{path} holds {len(found)} checkpoints; pass one of its step_* folders")
        ckpt = found[0]
    with checkpoint_context(ckpt.path):
        stats = attention_weight_stats(
            SafetensorsReader(ckpt), read_config(ckpt.config_path), n_heads, top_k, include_other
        )
    stats["notes"] = ckpt.notes + stats["notes"]
    return {"path": str(ckpt.path), "label": ckpt.label, "step": ckpt.step, **stats}
