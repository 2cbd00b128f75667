"""The probe batch (token ids) and the model a checkpoint's config builds, for logit and Hessian probes.

The probe text is `--text`, a text file, or the built-in paragraph below, tokenized with the
checkpoint's own tokenizer when its folder has one. A user's text is measured as given (cut to
the probe length when longer, never repeated); the built-in paragraph is repeated to fill the
probe length (cut to it when longer), with a note when repeated. Without a tokenizer the probe falls back to deterministic
pseudo-random token ids (seeded) and says so in a note; a user's text then is an error.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from merit_core.checkpoint.runs import TOKENIZER_FILES
from merit_core.diagnostics.layout import read_config
from merit_core.errors import CheckpointError, ConfigError, DataError
from merit_core.models import build_model, config_from_dict, family_spec
from merit_core.models.layered_forward import TensorTap, layered_model
from merit_core.models.limits import check_layered_size, check_model_config, check_model_size

PROBE_TEXT = (
    "The committee met on a grey Tuesday morning to review the budget for the coming year. "
    "Most of the discussion concerned the new library wing, which had already cost twice what the "
    "architects first promised, and the question of whether the old reading room should stay open "
    "during construction. One member argued that students would simply study elsewhere; another "
    "pointed out that the nearest alternative was a forty-minute bus ride away. In the end they agreed "
    "to keep the room open three days a week, to publish the revised figures in the spring newsletter, "
    "and to meet again in June, when the contractor's final estimate would be known. Outside, the rain "
    "had stopped, and a few people were already crossing the square toward the market, where the "
    "fishmongers were shouting prices for herring, mackerel and cod."
)


@dataclass
class ProbeInfo:
    """How the probe batch of a report was made."""

    source: str  # 'builtin' | 'text' | 'file' | 'random-ids'
    n_tokens: int
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "n_tokens": self.n_tokens, "notes": list(self.notes)}


@dataclass
class ProbeBatch:
    """Token ids [1, T] and how they were made."""

    input_ids: torch.Tensor
    source: str  # 'builtin' | 'text' | 'file' | 'random-ids'
    notes: list[str] = field(default_factory=list)

    def describe(self) -> ProbeInfo:
        return ProbeInfo(self.source, int(self.input_ids.shape[1]), list(self.notes))


def has_tokenizer(folder: Path) -> bool:
    return any((folder / name).is_file() for name in TOKENIZER_FILES)


def _tokenize(folder: Path, text: str) -> list[int]:
    try:
        tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
    except Exception as exc:  # transformers raises many types for a broken tokenizer folder
        raise CheckpointError(f"cannot load the tokenizer in {folder}: {str(exc).splitlines()[0]}") from None
    return tok(text, add_special_tokens=False)["input_ids"]


def make_probe_batch(
    folder: Path, vocab_size: int, seq_len: int, text: str | None = None, source: str = "builtin", seed: int = 0
) -> ProbeBatch:
    """Token ids for the probe: a user's text as given (at most `seq_len` tokens), the built-in
    paragraph repeated to fill `seq_len`, or `seq_len` seeded ids when there is no tokenizer."""
    if seq_len < 2:
        raise DataError(f"--seq-len must be at least 2, got {seq_len}")
    notes: list[str] = []
    builtin = text is None
    if text is None:
        text, source = PROBE_TEXT, "builtin"
    elif source == "builtin":
        source = "text"
    if has_tokenizer(folder):
        ids = _tokenize(folder, text)
        if not ids:
            raise DataError("the probe text tokenizes to no tokens")
        if len(ids) > seq_len and not builtin:  # the built-in paragraph fills seq_len, cut or repeated
            notes.append(f"probe text has {len(ids)} tokens; the first {seq_len} were measured")
        elif len(ids) < seq_len and builtin:
            reps = -(-seq_len // len(ids))
            notes.append(f"built-in probe text has {len(ids)} tokens; repeated {reps}x to fill {seq_len}")
            ids = ids * reps
        elif len(ids) < 2:
            raise DataError("the probe text is a single token; attention needs at least 2")
        ids = ids[:seq_len]
        if max(ids) >= vocab_size:
            raise CheckpointError(
                f"the tokenizer in {folder} produces id {max(ids)} but the model has only {vocab_size} embeddings"
            )
        return ProbeBatch(torch.tensor([ids], dtype=torch.long), source, notes)
    if not builtin:
        raise DataError(f"no tokenizer next to the weights in {folder}: the probe text cannot be tokenized")
    gen = torch.Generator().manual_seed(seed)
    notes.append(f"no tokenizer next to the weights: probing with {seq_len} seeded random token ids (seed {seed})")
    return ProbeBatch(torch.randint(0, vocab_size, (1, seq_len), generator=gen), "random-ids", notes)


def load_model(
    checkpoint,
    tensors,
    device: str | torch.device = "cpu",
    raw_config: dict | None = None,
    layered: bool = False,
    tap: TensorTap | None = None,
):
    """A float32 causal LM built from the checkpoint's config.json, with every weight from `tensors`.

    Built with `from_config` and filled from the lazy safetensors reader, so any file name or
    shard layout works and a missing weight is an error rather than a silent random init.
    Keys saved without the base-model prefix (older GPT-2 files) and the names transformers saves
    some weights under (GPT-NeoX embed_out) are accepted. `raw_config`: the checkpoint's config.json
    when the caller has read it already (else it is read here). `layered`: a model for forward
    passes that reads each layer's weights when it runs (merit_core.models.layered_forward), so a
    checkpoint larger than memory can be probed; the same numbers as the whole model's. `tap`: with
    `layered`, called with each layer's stored tensors as they are read.
    """
    raw = raw_config if raw_config is not None else read_config(checkpoint.config_path)
    if raw is None:
        raise CheckpointError(f"no config.json next to {checkpoint.path}")
    try:
        config = config_from_dict(raw, str(checkpoint.config_path))
    except ConfigError as exc:
        if raw.get("model_type") is None or "not a usable" in str(exc):
            raise CheckpointError(str(exc)) from None
        raise
    config.dtype = torch.float32
    spec = family_spec(config)
    try:  # a config.json from someone else: shapes it cannot build, sizes no memory holds
        check_model_config(config, str(checkpoint.config_path))
        (check_layered_size if layered else check_model_size)(config, str(checkpoint.config_path), str(device))
    except ConfigError as exc:
        raise CheckpointError(str(exc)) from None
    if layered:
        return layered_model(config, tensors, device, tap=tap, where=str(checkpoint.path))
    model = build_model(config)
    prefix = model.base_model_prefix + "."
    tied = getattr(config, "tie_word_embeddings", False)
    missing = []
    with torch.no_grad():
        for name, target in model.state_dict().items():  # tensors sharing storage with the model
            key = spec.saved_name(name)
            if key not in tensors and key.startswith(prefix):
                key = key[len(prefix) :]
            if key not in tensors:
                if not (tied and name == "lm_head.weight"):
                    missing.append(name)
                continue
            value = tensors[key]  # one tensor in memory at a time
            if tuple(value.shape) != tuple(target.shape):
                raise CheckpointError(
                    f"config.json does not match the weights: {key} is {list(value.shape)}, "
                    f"the config builds {list(target.shape)}"
                )
            target.copy_(value)
    if missing:
        raise CheckpointError(f"{checkpoint.path} lacks {len(missing)} weights the config needs, e.g. {missing[0]}")
    if tied:
        model.tie_weights()
    return model.to(device).eval()
