"""Named GPT-2 and Llama configurations, built into transformers models from config (no downloads).

Sizes follow the MERIT paper: GPT-2 small/medium/large (context 1024), and the Llama configs of
the low-memory-optimizer papers on C4 (context 256). The `-tiny` models are for CPUs. Dropout is
0 everywhere, as in large-batch pretraining recipes. The vocabulary size is set from the
tokenizer actually used, so a model never has rows no token can reach, nor tokens it cannot embed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from merit_core.errors import ConfigError


@dataclass(frozen=True)
class ModelSpec:
    """A named architecture: family ('gpt2' | 'llama'), shape, default context and vocabulary."""

    family: str
    n_layer: int
    d_model: int
    n_head: int
    context: int
    vocab: int
    d_ff: int | None = None  # Llama MLP width; GPT-2 uses 4 * d_model
    n_kv_head: int | None = None


NAMED_MODELS: dict[str, ModelSpec] = {
    "gpt2-tiny": ModelSpec("gpt2", 4, 128, 4, 256, 4096),
    "gpt2-small": ModelSpec("gpt2", 12, 768, 12, 1024, 50257),
    "gpt2-medium": ModelSpec("gpt2", 24, 1024, 16, 1024, 50257),
    "gpt2-large": ModelSpec("gpt2", 36, 1280, 20, 1024, 50257),
    "llama-tiny": ModelSpec("llama", 4, 128, 4, 256, 4096, d_ff=344),
    "llama-60m": ModelSpec("llama", 8, 512, 8, 256, 32000, d_ff=1376),
    "llama-130m": ModelSpec("llama", 12, 768, 12, 256, 32000, d_ff=2048),
    "llama-350m": ModelSpec("llama", 24, 1024, 16, 256, 32000, d_ff=2736),
    "llama-1b": ModelSpec("llama", 24, 2048, 32, 256, 32000, d_ff=5461),
}


def _spec_config(spec: ModelSpec, vocab_size: int, context: int, special_ids: dict[str, int]):
    if spec.family == "gpt2":
        from transformers import GPT2Config

        return GPT2Config(
            vocab_size=vocab_size,
            n_positions=context,
            n_embd=spec.d_model,
            n_layer=spec.n_layer,
            n_head=spec.n_head,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=special_ids.get("bos", 0),
            eos_token_id=special_ids.get("eos", 0),
        )
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=spec.d_model,
        intermediate_size=spec.d_ff,
        num_hidden_layers=spec.n_layer,
        num_attention_heads=spec.n_head,
        num_key_value_heads=spec.n_kv_head or spec.n_head,
        max_position_embeddings=context,
        tie_word_embeddings=False,
        attention_dropout=0.0,
        bos_token_id=special_ids.get("bos", 0),
        eos_token_id=special_ids.get("eos", 0),
        pad_token_id=special_ids.get("pad"),
    )


def model_names() -> list[str]:
    return list(NAMED_MODELS)


def model_config(
    name_or_path: str,
    vocab_size: int | None = None,
    context: int | None = None,
    special_ids: dict[str, int] | None = None,
):
    """A transformers config for a named model or a config.json path (file or folder).

    `vocab_size` and `context` override the named defaults (a config file keeps its own
    context unless `context` is given, and its own vocab unless `vocab_size` is given).
    """
    special_ids = special_ids or {}
    if name_or_path in NAMED_MODELS:
        spec = NAMED_MODELS[name_or_path]
        return _spec_config(spec, vocab_size or spec.vocab, context or spec.context, special_ids)
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".json" or path.exists():
        return _config_from_file(path, vocab_size, context)
    import difflib

    close = difflib.get_close_matches(name_or_path, NAMED_MODELS, n=3)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    raise ConfigError(
        f"unknown model {name_or_path!r}: use one of {', '.join(NAMED_MODELS)} or a path to a config.json.{hint}"
    )


def _config_from_file(path: Path, vocab_size: int | None, context: int | None):
    from transformers import AutoConfig

    if not path.is_file():
        raise ConfigError(f"model config not found: {path}")
    try:
        raw: dict[str, Any] = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path} is not a readable JSON config: {exc}") from None
    model_type = raw.pop("model_type", None)
    if model_type not in ("gpt2", "llama"):
        raise ConfigError(f"{path}: model_type {model_type!r} is not supported; merit trains 'gpt2' and 'llama'")
    raw.pop("architectures", None)
    raw.pop("transformers_version", None)
    config = AutoConfig.for_model(model_type, **raw)
    if vocab_size is not None:
        config.vocab_size = vocab_size
    if context is not None:
        set_context_length(config, context)
    return config


def family(config) -> str:
    """'gpt2' or 'llama'."""
    if config.model_type not in ("gpt2", "llama"):
        raise ConfigError(f"model_type {config.model_type!r} is not supported; merit handles 'gpt2' and 'llama'")
    return config.model_type


def context_length(config) -> int:
    """The longest sequence the model accepts."""
    return config.n_positions if config.model_type == "gpt2" else config.max_position_embeddings


def set_context_length(config, context: int) -> None:
    if config.model_type == "gpt2":
        config.n_positions = context
    else:
        config.max_position_embeddings = context


def build_model(config, seed: int | None = None):
    """A freshly initialised causal LM (float32, SDPA attention) from a config."""
    import torch
    from transformers import AutoModelForCausalLM

    if seed is not None:
        torch.manual_seed(seed)
    family(config)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)


def count_parameters(model) -> int:
    """Number of distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
