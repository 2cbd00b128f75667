"""What a model config may ask for before merit builds it: sane shapes, and a size that fits in memory.

A config.json comes from the user or from a checkpoint folder someone else wrote. transformers
accepts shapes it cannot build (a negative MLP width) and sizes no machine holds (a vocabulary
of 2^40, a billion layers, which spins for minutes creating modules before the first
allocation fails). Both are refused here, in one line, before anything is allocated.
"""

from __future__ import annotations

import math
from typing import Any

from merit_core.devices import available_host_memory
from merit_core.errors import CheckpointError, ConfigError, printable
from merit_core.values import coerce, is_number

# The largest position table a model config may ask for (a learned table of this many rows is built).
MAX_POSITIONS = 1 << 24


def _value(config: Any, *keys: str) -> Any:
    return next((getattr(config, k) for k in keys if getattr(config, k, None) is not None), None)


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


# The sizes a config.json gives: whole positive numbers, never text ("2") or fractions, which
# transformers stores as given and which then fail deep inside a division or a layer's constructor.
COUNT_KEYS = (
    "n_embd",
    "hidden_size",
    "n_layer",
    "num_hidden_layers",
    "n_head",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "n_positions",
    "n_ctx",
    "max_position_embeddings",
    "intermediate_size",
    "n_inner",
)


def check_raw_config(raw: dict[str, Any], where: str) -> dict[str, Any]:
    """`raw` (a config.json as read) with its sizes checked before transformers or merit reads it:
    each of COUNT_KEYS present an integer (an integral float becomes an int; whether it is large
    enough is `check_model_config`'s, which words it per size), and
    `rope_scaling` null or a table whose `factor` is a positive number. ConfigError in one line
    naming the key otherwise. Returns `raw`, changed in place."""
    for key in COUNT_KEYS:
        if raw.get(key) is not None:
            raw[key] = coerce(raw[key], int, f"{where}: {key}")  # its range: check_model_config
    rope = raw.get("rope_scaling")
    if rope is not None:
        example = '{"rope_type": "linear", "factor": 2.0}'
        if not isinstance(rope, dict):
            raise ConfigError(f"{where}: rope_scaling must be a table such as {example} or null, got {_shown(rope)}")
        kind = rope.get("rope_type", rope.get("type"))
        if kind is not None and not isinstance(kind, str):
            raise ConfigError(f"{where}: rope_scaling's rope_type must be a name such as 'linear', got {_shown(kind)}")
        factor = rope.get("factor")
        if factor is not None and not (is_number(factor) and math.isfinite(factor) and factor > 0):
            raise ConfigError(f"{where}: rope_scaling's factor must be a positive number, got {_shown(factor)}")
    return raw


def _shown(value: Any) -> str:
    text = printable(repr(value))
    return text if len(text) <= 60 else text[:57] + "..."


def check_model_config(config: Any, name: str) -> None:
    """ConfigError for model configs transformers accepts but cannot build or run: a zero, negative or
    non-integer size (width, layers, heads, vocabulary, MLP width, head size), heads that do not divide
    the width, an unknown activation, a huge position table."""
    from transformers.activations import ACT2FN

    sizes = {
        "hidden size": _value(config, "hidden_size", "n_embd"),
        "layers": _value(config, "num_hidden_layers", "n_layer"),
        "attention heads": _value(config, "num_attention_heads", "n_head"),
        "vocabulary": _value(config, "vocab_size"),
        "MLP width": _value(config, "intermediate_size", "n_inner"),
        "head size": _value(config, "head_dim"),
    }
    for what, size in sizes.items():
        if size is not None and not _positive_int(size):
            raise ConfigError(f"model {name}: {what} must be a positive integer, got {size!r}")
    hidden, heads = sizes["hidden size"], sizes["attention heads"]
    if hidden and heads and hidden % heads and getattr(config, "head_dim", None) is None:
        raise ConfigError(f"model {name}: hidden size {hidden} is not divisible by {heads} attention heads")
    kv = _value(config, "num_key_value_heads")
    if kv is not None and heads and (not _positive_int(kv) or heads % kv):
        raise ConfigError(f"model {name}: num_key_value_heads {kv!r} must be positive and divide {heads} heads")
    act = _value(config, "hidden_act", "activation_function")
    if isinstance(act, str) and act not in ACT2FN:
        raise ConfigError(f"model {name}: unknown activation {act!r}")
    positions = _value(config, "max_position_embeddings", "n_positions")
    if positions is not None and not (_positive_int(positions) and positions <= MAX_POSITIONS):
        raise ConfigError(f"model {name}: context length must be from 1 to {MAX_POSITIONS}, got {positions!r}")


def _unit_parameters(config: Any) -> tuple[int, int, int]:
    """(layers, lower bound on one decoder layer's parameters, the embedding table's): per layer the
    four attention projections and a two-matrix MLP (gated MLPs and biases have more). Exact
    integers, so even absurd sizes compare correctly; all 0 for values check_model_config refuses."""
    hidden = _value(config, "hidden_size", "n_embd") or 0
    layers = _value(config, "num_hidden_layers", "n_layer") or 0
    vocab = _value(config, "vocab_size") or 0
    mlp = _value(config, "intermediate_size", "n_inner") or 4 * hidden
    heads = _value(config, "num_attention_heads", "n_head") or 1
    kv = _value(config, "num_key_value_heads") or heads
    head_dim = _value(config, "head_dim") or (hidden // heads if heads else hidden)
    attention = hidden * head_dim * (2 * heads + 2 * kv)  # W_Q, W_O: heads; W_K, W_V: kv heads
    values = [hidden, layers, vocab, mlp, head_dim, attention]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        return 0, 0, 0  # check_model_config reports bad values
    return layers, attention + 2 * hidden * mlp, vocab * hidden


def minimum_parameters(config: Any) -> int:
    """A lower bound on the parameters a config builds: one embedding table (tied or not) and the layers."""
    layers, per_layer, embedding = _unit_parameters(config)
    return embedding + layers * per_layer


def layered_bytes(config: Any, seq_len: int, units: int = 1) -> int:
    """A lower bound on the memory a forward pass holding `units` units at a time needs
    (merit_core.models.layered_forward: a decoder layer or the embedding, in float32) on one
    sequence of `seq_len` tokens: the largest `units` units' weights and the output logits."""
    _, per_layer, embedding = _unit_parameters(config)
    vocab = _value(config, "vocab_size") or 0
    return 4 * units * max(per_layer, embedding) + 4 * seq_len * (vocab if isinstance(vocab, int) else 0)


def _memory_limits(device: str) -> list[tuple[int, str]]:
    """(bytes, what) of the memories a model on `device` is built in: the host's available memory,
    and on a CUDA device its total memory."""
    limits = []
    host = available_host_memory()
    if host:
        limits.append((host, "available host memory"))
    if str(device).startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            index = torch.device(device).index or 0
            limits.append((int(torch.cuda.get_device_properties(index).total_memory), f"memory of {device}"))
    return limits


def _refuse_over(need: int, device: str, what_is_needed: str) -> None:
    """ConfigError `what_is_needed`, more than the ... GiB of the first memory limit `need` bytes exceed."""
    for limit, what in _memory_limits(device):
        if need > limit:
            raise ConfigError(f"{what_is_needed}, more than the {limit / 2**30:,.1f} GiB {what}")


def check_model_size(config: Any, name: str, device: str = "cpu", bytes_per_parameter: int = 4) -> int:
    """ConfigError when the model's parameters alone cannot fit in the memory available to build it.

    Models are built in host memory first (then moved to a GPU), so the host's available memory
    is the limit; on a CUDA device its total memory is a second one. Returns the lower-bound
    parameter count. Nothing is allocated.
    """
    params = minimum_parameters(config)
    need = params * bytes_per_parameter
    _refuse_over(
        need,
        device,
        f"model {name} is too large: at least {_count(params)} parameters, "
        f"{need / 2**30:,.0f} GiB for the weights alone",
    )
    return params


def check_layered_size(config: Any, name: str, device: str = "cpu", seq_len: int = 256) -> int:
    """ConfigError when even a forward pass holding one layer at a time (`layered_bytes`; two on a
    CUDA device, which reads the next layer while one runs) cannot fit in the memory of `device`
    and of the host. Returns the lower bound in bytes. Nothing is allocated."""
    units = 2 if str(device).startswith("cuda") else 1
    need = layered_bytes(config, seq_len, units)
    held = "two layers" if units == 2 else "one layer"
    _refuse_over(
        need,
        device,
        f"model {name} is too large: a forward pass holding {held} at a time needs at least {need / 2**30:,.1f} GiB",
    )
    return need


def _count(n: int) -> str:
    if n >= 10**15:
        return f"10^{math.floor(math.log10(n))}"
    for unit, scale in (("T", 10**12), ("B", 10**9), ("M", 10**6)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


# Sizes every model family needs: null in a config.json (which transformers' defaults do not catch) is refused.
_REQUIRED_SIZES = (
    "n_head",
    "n_layer",
    "n_embd",
    "num_attention_heads",
    "num_hidden_layers",
    "hidden_size",
    "vocab_size",
)


def check_model_dims(config: Any, where: str) -> None:
    """CheckpointError for a model config (a transformers config) that cannot be built: a size that
    is null, zero, negative or not an integer, heads that do not divide the width, ... (the rules are
    `check_model_config`'s, which inspect's probe applies too): a config.json
    with n_head = 0 or null would otherwise fail inside the model's constructor."""

    raw = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    nulls = [key for key in _REQUIRED_SIZES if key in raw and raw[key] is None]
    if nulls:
        raise CheckpointError(f"{where}: {nulls[0]} is null in config.json; it must be a positive integer")
    try:
        check_model_config(config, where)
    except ConfigError as exc:
        raise CheckpointError(str(exc)) from None
