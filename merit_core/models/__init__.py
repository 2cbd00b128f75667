"""Named model configurations of every supported family, built into transformers models from config (no downloads).

Sizes follow the MERIT paper: GPT-2 small/medium/large (context 1024), and the Llama configs of
the low-memory-optimizer papers on C4 (context 256). Every family has a `-tiny` model for CPUs
(gpt2-tiny, llama-tiny, qwen3-tiny, mistral-tiny, ...); Pythia and Qwen3 have their published
shapes. Dropout is 0 everywhere, as in large-batch pretraining recipes. The vocabulary size is
set from the tokenizer actually used, so a model never has rows no token can reach, nor tokens
it cannot embed. What a family is (names of its weights, GQA, QK-norm, sliding windows) lives
in `merit_core.models.family` / `families`; this module only builds.
"""

from __future__ import annotations

import difflib
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from merit_core.checkpoint.runs import MODEL_CONFIG
from merit_core.errors import ConfigError, MeritError
from merit_core.models import families as _families  # noqa: F401  (registers the specs)
from merit_core.models.family import FamilySpec, all_families, family_names, get_family, register_family
from merit_core.models.limits import check_raw_config
from merit_core.settings import VOCAB_SIZE

__all__ = [
    "NAMED_MODELS",
    "FamilySpec",
    "ModelSpec",
    "all_families",
    "build_model",
    "check_model_name",
    "config_from_dict",
    "context_length",
    "count_parameters",
    "family",
    "family_names",
    "family_spec",
    "get_family",
    "model_config",
    "model_width",
    "register_family",
    "set_context_length",
]


@dataclass(frozen=True)
class ModelSpec:
    """A named architecture: family (a model_type), shape, default context and vocabulary."""

    family: str
    n_layer: int
    d_model: int
    n_head: int
    context: int
    vocab: int
    d_ff: int | None = None  # MLP width; None: 4 * d_model (GPT-2 always uses 4 * d_model)
    n_kv_head: int | None = None  # key/value heads (grouped-query attention); None: n_head
    head_dim: int | None = None  # None: d_model // n_head
    extra: dict[str, Any] = field(default_factory=dict, compare=False)  # further config keys


# The tiny models' vocabulary is the default BPE's (merit_core.settings), so they fit the built-in data.
def _tiny(family: str, n_kv_head: int | None = 2, **extra) -> ModelSpec:
    return ModelSpec(family, 4, 128, 4, 256, VOCAB_SIZE, d_ff=344, n_kv_head=n_kv_head, extra=extra)


NAMED_MODELS: dict[str, ModelSpec] = {
    "gpt2-tiny": ModelSpec("gpt2", 4, 128, 4, 256, VOCAB_SIZE),
    "gpt2-small": ModelSpec("gpt2", 12, 768, 12, 1024, 50257),
    "gpt2-medium": ModelSpec("gpt2", 24, 1024, 16, 1024, 50257),
    "gpt2-large": ModelSpec("gpt2", 36, 1280, 20, 1024, 50257),
    "llama-tiny": ModelSpec("llama", 4, 128, 4, 256, VOCAB_SIZE, d_ff=344),
    "llama-60m": ModelSpec("llama", 8, 512, 8, 256, 32000, d_ff=1376),
    "llama-130m": ModelSpec("llama", 12, 768, 12, 256, 32000, d_ff=2048),
    "llama-350m": ModelSpec("llama", 24, 1024, 16, 256, 32000, d_ff=2736),
    "llama-1b": ModelSpec("llama", 24, 2048, 32, 256, 32000, d_ff=5461),
    "mistral-tiny": _tiny("mistral", sliding_window=128),
    "qwen2-tiny": _tiny("qwen2"),
    "qwen3-tiny": _tiny("qwen3"),
    "qwen3-0.6b": ModelSpec(
        "qwen3", 28, 1024, 16, 40960, 151936, d_ff=3072, n_kv_head=8, head_dim=128, extra={"tie_word_embeddings": True}
    ),
    "gemma2-tiny": _tiny("gemma2", sliding_window=128),
    "gemma3-tiny": _tiny("gemma3_text", sliding_window=128, layer_types=["sliding_attention", "full_attention"] * 2),
    "olmo2-tiny": _tiny("olmo2"),
    "phi3-tiny": _tiny("phi3"),
    "pythia-tiny": _tiny("gpt_neox", n_kv_head=None),
    "pythia-70m": ModelSpec("gpt_neox", 6, 512, 8, 2048, 50304, d_ff=2048),
    "pythia-160m": ModelSpec("gpt_neox", 12, 768, 12, 2048, 50304, d_ff=3072),
}


def _spec_config(spec: ModelSpec, vocab_size: int, context: int, special_ids: dict[str, int]):
    from transformers import AutoConfig

    fam = get_family(spec.family)
    kwargs = {**fam.config_kwargs(spec, vocab_size, context, special_ids), **spec.extra}
    return AutoConfig.for_model(fam.model_type, **kwargs)


def model_config(
    name_or_path: str | ModelSpec,
    vocab_size: int | None = None,
    context: int | None = None,
    special_ids: dict[str, int] | None = None,
):
    """A transformers config for a named model, a ModelSpec, or a config.json path (file or folder).

    `vocab_size` and `context` override the named defaults (a config file keeps its own
    context unless `context` is given, and its own vocab unless `vocab_size` is given).
    """
    special_ids = special_ids or {}
    if isinstance(name_or_path, ModelSpec) or name_or_path in NAMED_MODELS:
        spec = NAMED_MODELS[name_or_path] if isinstance(name_or_path, str) else name_or_path
        return _spec_config(spec, vocab_size or spec.vocab, context or spec.context, special_ids)
    return _config_from_file(_config_path(name_or_path), vocab_size, context, special_ids)


def check_model_name(name_or_path: str) -> None:
    """A ConfigError line unless `name_or_path` is a named model or a config.json path (file or
    folder). Reads no file and imports no transformers: `merit train` answers a misspelt --model
    with it before torch loads; model_config reads the file."""
    if name_or_path not in NAMED_MODELS:
        _config_path(name_or_path)


def _config_path(name_or_path: str) -> Path:
    """The config.json a model that is not named stands for (a folder's own), or the unknown-model error."""
    path = Path(name_or_path)
    if path.is_dir():
        path = path / MODEL_CONFIG
    if path.suffix == ".json" or path.exists():
        return path
    close = difflib.get_close_matches(name_or_path, NAMED_MODELS, n=3)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    raise ConfigError(
        f"unknown model {name_or_path!r}: use one of {', '.join(NAMED_MODELS)} or a path to a config.json.{hint}"
    )


def model_width(name_or_path: str) -> int | None:
    """d_model of a named model or config.json (n_embd or hidden_size), or None when it cannot be read."""
    if name_or_path in NAMED_MODELS:
        return NAMED_MODELS[name_or_path].d_model
    try:
        config = model_config(name_or_path)
    except (MeritError, OSError, ValueError):
        return None
    width = getattr(config, "n_embd", None) or getattr(config, "hidden_size", None)
    return int(width) if width else None


def config_from_dict(raw: dict[str, Any], where: str = "config.json"):
    """A transformers config from a config.json dict of a supported family (ConfigError otherwise)."""
    from transformers import AutoConfig

    # auto_map would point transformers at Python files next to the config: never used here
    raw = {k: v for k, v in raw.items() if k not in ("architectures", "transformers_version", "auto_map")}
    check_raw_config(raw, where)
    model_type = raw.pop("model_type", None)
    try:
        get_family(model_type)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    try:
        with warnings.catch_warnings():  # transformers' deprecation notes (rope_scaling) are not the user's to act on
            warnings.simplefilter("ignore", FutureWarning)
            return AutoConfig.for_model(model_type, **raw)
    except Exception as exc:  # ValueError, TypeError, huggingface_hub's strict-dataclass validation errors
        detail = " ".join(str(exc).split())[:240] or type(exc).__name__
        raise ConfigError(f"{where} is not a usable {model_type} config: {detail}") from None


def _config_from_file(path: Path, vocab_size: int | None, context: int | None, special_ids: dict[str, int]):
    if not path.is_file():
        raise ConfigError(f"model config not found: {path}")
    try:
        raw: dict[str, Any] = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path} is not a readable JSON config: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} is not a JSON object")
    config = config_from_dict(raw, str(path))
    if vocab_size is not None:
        config.vocab_size = vocab_size
    _fit_special_ids(config, raw, special_ids)
    if context is not None:
        set_context_length(config, context)
    return config


def _fit_special_ids(config, raw: dict[str, Any], special_ids: dict[str, int]) -> None:
    """The token ids of a config read from a file, made to fit its vocabulary: an id the file does
    not give (transformers then fills in its own default, GPT-2's 50256) or one beyond the
    vocabulary (a GPT-2 config.json trained on data of another tokenizer) becomes the data's
    (`special_ids`, e.g. {"bos": eos, "eos": eos}); without one, an id beyond the vocabulary is unset."""
    vocab = getattr(config, "vocab_size", None)
    for short, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("pad", "pad_token_id")):
        value = getattr(config, key, None)
        given = raw.get(key) is not None
        fits = isinstance(value, int) and not isinstance(value, bool) and (vocab is None or 0 <= value < vocab)
        if given and fits:
            continue
        if short in special_ids:
            setattr(config, key, special_ids[short])
        elif value is not None and not fits:
            setattr(config, key, None)


def family_spec(config) -> FamilySpec:
    """The FamilySpec of a transformers config (ConfigError for an unsupported model_type)."""
    return get_family(getattr(config, "model_type", None))


def family(config) -> str:
    """The config's model_type, checked to be a supported family."""
    return family_spec(config).model_type


def context_length(config) -> int:
    """The longest sequence the model accepts."""
    return family_spec(config).context_length(config)


def set_context_length(config, context: int) -> None:
    setattr(config, family_spec(config).context_key, context)


def build_model(config, seed: int | None = None, dtype=None):
    """A freshly initialised causal LM from a config: float32 unless `dtype`, SDPA attention where
    the family allows it (eager for logit soft-capping)."""
    import torch
    from transformers import AutoModelForCausalLM

    if seed is not None:
        torch.manual_seed(seed)
    spec = family_spec(config)
    return AutoModelForCausalLM.from_config(
        config,
        attn_implementation=spec.attn_implementation(config),
        dtype=dtype or torch.float32,
        trust_remote_code=False,  # a supported family is built from transformers' own code, never a config's
    )


def count_parameters(model) -> int:
    """Number of distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
