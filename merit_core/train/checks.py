"""Input checks of a training run that need the model config or the prepared data.

They run before anything is written, so that a config transformers accepts but cannot build or
train, a batch too large to hold, or data whose token ids exceed the vocabulary is one line
(ConfigError / DataError) instead of a crash after the run folder was made.
"""

from __future__ import annotations

from pathlib import Path

from merit_core.data import open_tokens
from merit_core.errors import ConfigError, DataError, MeritError, first_line
from merit_core.models import context_length, model_config
from merit_core.models.limits import check_model_config, check_model_size
from merit_core.train.batches import check_split_length
from merit_core.train.config import TrainConfig

MAX_BATCH_BYTES = 8 << 30  # token windows held at once (a micro-batch, the validation set)


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
    check_model_size(mconf, c.model, bytes_per_parameter=8)  # built on the host: weights and gradients
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


def check_data(path: Path, meta, seq_len: int) -> None:
    """DataError when a split is shorter than one window, or token ids reach the vocabulary size."""
    check_split_length(meta.train_tokens, seq_len, f"train split of {path}")
    check_split_length(meta.val_tokens, seq_len, f"validation split of {path}")
    check_token_ids(path, meta)


def check_token_ids(path: Path, meta, sample: int = 1 << 22) -> None:
    """DataError when token ids reach the vocabulary size (all of val, the first `sample` train tokens)."""
    import numpy as np

    for split, limit in (("val", None), ("train", sample)):
        tokens = open_tokens(path, split)
        top = int(np.max(tokens[:limit])) if len(tokens) else 0
        if top >= meta.vocab_size:
            raise DataError(
                f"prepared data {path} has token id {top} in {split}.bin but vocab_size {meta.vocab_size}; "
                "prepare it again"
            )
