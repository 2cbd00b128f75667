"""Input checks of a training run that need the model config or the prepared data.

They run before anything is written, so that a config transformers accepts but cannot build or
train, a batch too large to hold, or data whose token ids exceed the vocabulary is one line
(ConfigError / DataError) instead of a crash after the run folder was made.
"""

from __future__ import annotations

from pathlib import Path

from merit_core.errors import ConfigError, DataError, MeritError, first_line
from merit_core.models import context_length, model_config
from merit_core.train.config import TrainConfig

MAX_BATCH_BYTES = 8 << 30  # token windows held at once (a micro-batch, the validation set)
# The largest position table a model config may ask for (a learned table of this many rows is built).
MAX_POSITIONS = 1 << 24


def check_model_and_batches(config: TrainConfig, world_size: int) -> None:
    """ConfigError for an unusable model config, a seq_len beyond its context, or batches too large to hold."""
    c = config
    try:
        mconf = model_config(c.model)
    except MeritError:
        raise
    except Exception as exc:  # transformers' own config validation (types, values)
        raise ConfigError(f"model {c.model} is not a usable config: {first_line(exc)}") from None
    check_model_config(mconf, c.model)
    context = context_length(mconf)
    if c.seq_len > context:
        raise ConfigError(f"seq_len {c.seq_len} is beyond the context of {c.model} ({context} tokens)")
    micro = c.micro_batch_size or c.batch_size // world_size  # 'auto' tries the whole batch first
    windows = max(micro, c.eval_batches * c.eval_batch_size) * (c.seq_len + 1) * 8
    if windows > MAX_BATCH_BYTES:
        raise ConfigError(
            f"batch sizes too large: {windows / 2**30:.0f} GiB of token windows at once "
            "(micro_batch_size or eval_batches x eval_batch_size, times seq_len); lower them"
        )


def check_model_config(mconf, name: str) -> None:
    """ConfigError for model configs transformers accepts but cannot build or run (a zero or negative
    head count, heads that do not divide the width, an unknown activation, a huge position table)."""
    from transformers.activations import ACT2FN

    def value(*keys):
        return next((getattr(mconf, k) for k in keys if getattr(mconf, k, None) is not None), None)

    sizes = {
        "hidden size": value("hidden_size", "n_embd"),
        "layers": value("num_hidden_layers", "n_layer"),
        "attention heads": value("num_attention_heads", "n_head"),
        "vocabulary": value("vocab_size"),
    }
    for what, size in sizes.items():
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size <= 0):
            raise ConfigError(f"model {name}: {what} must be a positive integer, got {size!r}")
    hidden, heads = sizes["hidden size"], sizes["attention heads"]
    if hidden and heads and hidden % heads and getattr(mconf, "head_dim", None) is None:
        raise ConfigError(f"model {name}: hidden size {hidden} is not divisible by {heads} attention heads")
    kv = value("num_key_value_heads")
    if kv is not None and heads and (not isinstance(kv, int) or kv <= 0 or heads % kv):
        raise ConfigError(f"model {name}: num_key_value_heads {kv!r} must be positive and divide {heads} heads")
    act = value("hidden_act", "activation_function")
    if isinstance(act, str) and act not in ACT2FN:
        raise ConfigError(f"model {name}: unknown activation {act!r}")
    positions = value("max_position_embeddings", "n_positions")
    if positions is not None and (not isinstance(positions, int) or not 0 < positions <= MAX_POSITIONS):
        raise ConfigError(f"model {name}: context length must be from 1 to {MAX_POSITIONS}, got {positions!r}")


def check_data(path: Path, meta, seq_len: int) -> None:
    """DataError when a split is shorter than one window, or token ids reach the vocabulary size."""
    from merit_core.train.batches import check_split_length

    check_split_length(meta.train_tokens, seq_len, f"train split of {path}")
    check_split_length(meta.val_tokens, seq_len, f"validation split of {path}")
    check_token_ids(path, meta)


def check_token_ids(path: Path, meta, sample: int = 1 << 22) -> None:
    """DataError when token ids reach the vocabulary size (all of val, the first `sample` train tokens)."""
    import numpy as np

    from merit_core.data import open_tokens

    for split, limit in (("val", None), ("train", sample)):
        tokens = open_tokens(path, split)
        top = int(np.max(tokens[:limit])) if len(tokens) else 0
        if top >= meta.vocab_size:
            raise DataError(
                f"prepared data {path} has token id {top} in {split}.bin but vocab_size {meta.vocab_size}; "
                "prepare it again"
            )
