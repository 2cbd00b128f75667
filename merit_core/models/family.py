"""What a model family is: one `FamilySpec` per transformers `model_type`, and the registry of them.

A spec says everything the rest of merit needs to know about an architecture, so no other module
branches on the family name:
- building: the transformers config for a named size (`config_kwargs`), the context-length key,
  the attention implementation to train with;
- the weights: where W_Q / W_K / W_V / W_O of layer i live, in which orientation ('linear' =
  nn.Linear [out, in]; 'conv1d' = GPT-2's Conv1D [in, out]), and how a fused QKV matrix splits
  ('concat': Q | K | V blocks along the output axis, as GPT-2 c_attn and Phi-3 qkv_proj;
  'per_head': GPT-NeoX query_key_value, whose output rows are [q_h | k_h | v_h] for each head h);
- the attention: grouped-query heads, QK-norm ('head': RMSNorm over each head's features, Qwen3 and
  Gemma 3; 'full': over all query / key features before the head split, OLMo 2), sliding-window
  layers, the logit scaling and tanh soft-capping.

`get_family(model_type)` is the one door: an unknown type is a ConfigError naming the supported ones.
A new family is one `register_family(FamilySpec(...))` call (see families.py).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from merit_core.errors import ConfigError

LINEAR, CONV1D = "linear", "conv1d"
FUSED_CONCAT, FUSED_PER_HEAD = "concat", "per_head"


@dataclass(frozen=True)
class AttentionWeights:
    """Where one layer's attention projections are stored, relative to the base model's prefix.

    `block` is the attention module's path with `{i}` for the layer index. With `qkv` set, the
    query, key and value projections are one fused matrix split as `fused` says, and q / k / v are
    unused.
    """

    block: str  # e.g. "layers.{i}.self_attn"
    q: str = "q_proj"
    k: str = "k_proj"
    v: str = "v_proj"
    o: str = "o_proj"
    qkv: str | None = None  # fused projection module name
    fused: str | None = None  # FUSED_CONCAT | FUSED_PER_HEAD
    orientation: str = LINEAR  # LINEAR ([out, in]) | CONV1D ([in, out])

    def name(self, layer: int, module: str) -> str:
        """The stored weight name (without the base-model prefix) of `module` in layer `layer`."""
        return f"{self.block.format(i=layer)}.{module}.weight"

    def q_name(self, layer: int) -> str:
        return self.name(layer, self.qkv or self.q)

    def k_name(self, layer: int) -> str:
        return self.name(layer, self.qkv or self.k)

    def pattern(self) -> re.Pattern:
        """Matches layer i's query (or fused) weight under any prefix: groups (prefix, layer)."""
        block = re.escape(self.block).replace(re.escape("{i}"), r"(\d+)")
        return re.compile(rf"^(.*?){block}\.{re.escape(self.qkv or self.q)}\.weight$")

    @property
    def layer_block(self) -> str:
        """The decoder layer holding the attention module (its parent path), with `{i}`: its output is
        the residual stream after layer i."""
        return self.block.rsplit(".", 1)[0]

    @property
    def out_axis(self) -> int:
        """The axis of a stored W_Q / W_K that indexes output features (0 for Linear, 1 for Conv1D)."""
        return 1 if self.orientation == CONV1D else 0


@dataclass(frozen=True)
class LigerKernels:
    """Which Liger Kernel (`pip install merit-optim[gpu]`) kernels fit a family's modules; applied
    per model instance by merit_core.train.liger_kernels.

    rms_norm: the casting mode of its RMSNorm modules ('llama': normalise in fp32, scale in the
        input dtype; 'gemma': all in fp32), with `rms_offset` added to the weight (Gemma: 1 + w).
    mlp: 'swiglu' (gate_proj, up_proj, down_proj, SiLU), 'phi3' (fused gate_up_proj, SiLU) or
        'geglu' (gate_proj, up_proj, down_proj, tanh-GELU).
    modeling: the transformers module whose `apply_rotary_pos_emb` becomes Liger's RoPE.
    The fused linear cross-entropy applies to every family with a spec.
    """

    modeling: str
    rms_norm: str = "llama"
    rms_offset: float = 0.0
    mlp: str = "swiglu"


@dataclass(frozen=True)
class FamilySpec:
    """One model family (a transformers `model_type`)."""

    model_type: str
    label: str  # for messages: "GPT-2", "Llama", ...
    base_prefix: str  # the base model's attribute in *ForCausalLM state dicts: "model", "transformer"
    embedding: str  # token embedding weight under the prefix: "embed_tokens.weight"
    attention: AttentionWeights
    config_kwargs: Callable[..., dict[str, Any]]  # (size, vocab_size, context, special_ids) -> AutoConfig kwargs
    context_key: str = "max_position_embeddings"
    hidden_key: str = "hidden_size"
    layers_key: str = "num_hidden_layers"
    heads_key: str = "num_attention_heads"
    kv_heads_key: str | None = "num_key_value_heads"  # None: every head has its own key head
    qk_norm: str | None = None  # None | 'head' | 'full'
    sliding_window: bool = False  # whether configs of this family can have sliding-window layers
    query_scalar_key: str | None = None  # scaling = config[key] ** -0.5 instead of head_dim ** -0.5
    softcap_key: str | None = None  # tanh soft-capping of attention logits: cap * tanh(logit / cap)
    # (model state-dict name, name save_pretrained stores it under) where transformers renames on save
    saved_as: tuple[tuple[str, str], ...] = ()
    liger: LigerKernels | None = None  # None: no Liger Kernel support (kernels=auto uses merit's own loss)

    def saved_name(self, name: str) -> str:
        """The name a model's state-dict entry has in a save_pretrained checkpoint."""
        return dict(self.saved_as).get(name, name)

    def model_name(self, saved: str) -> str:
        """The model's state-dict name of a checkpoint entry (inverse of `saved_name`)."""
        return {s: m for m, s in self.saved_as}.get(saved, saved)

    # -- reading a config (a transformers config object or a config.json dict) ----------------
    def n_layers(self, config) -> int:
        return _get(config, self.layers_key)

    def n_heads(self, config) -> int:
        return _get(config, self.heads_key)

    def n_kv_heads(self, config) -> int:
        heads = self.n_heads(config)
        return (_get(config, self.kv_heads_key) if self.kv_heads_key else None) or heads

    def head_dim(self, config) -> int:
        return _get(config, "head_dim") or _get(config, self.hidden_key) // self.n_heads(config)

    def context_length(self, config) -> int:
        return _get(config, self.context_key)

    def scaling(self, config) -> float:
        """The factor q.k is multiplied by before the softmax."""
        if self.query_scalar_key and _get(config, self.query_scalar_key):
            return float(_get(config, self.query_scalar_key)) ** -0.5
        return float(self.head_dim(config)) ** -0.5

    def softcap(self, config) -> float | None:
        return (_get(config, self.softcap_key) or None) if self.softcap_key else None

    def sliding_windows(self, config) -> list[int | None]:
        """Per layer: the sliding-window size (a query sees itself and the window-1 keys before it) or None."""
        n = self.n_layers(config)
        window = _get(config, "sliding_window") if self.sliding_window else None
        if not window:
            return [None] * n
        types = _get(config, "layer_types")
        if types:
            return [window if t == "sliding_attention" else None for t in types]
        return [window] * n

    def attn_implementation(self, config) -> str:
        """'sdpa', or 'eager' where SDPA cannot express the attention (logit soft-capping)."""
        return "eager" if self.softcap(config) else "sdpa"


def _get(config, key: str | None):
    if key is None:
        return None
    if isinstance(config, dict):
        return config.get(key)
    return getattr(config, key, None)


_FAMILIES: dict[str, FamilySpec] = {}


def register_family(spec: FamilySpec) -> FamilySpec:
    """Add (or replace) the spec of `spec.model_type`."""
    _FAMILIES[spec.model_type] = spec
    return spec


def family_names() -> list[str]:
    return list(_FAMILIES)


def get_family(model_type: str | None) -> FamilySpec:
    """The spec of a transformers model_type; ConfigError for one merit does not know."""
    spec = _FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if spec is None:
        raise ConfigError(f"model_type {model_type!r} is not supported; merit handles {', '.join(_FAMILIES)}")
    return spec


def all_families() -> list[FamilySpec]:
    return list(_FAMILIES.values())
