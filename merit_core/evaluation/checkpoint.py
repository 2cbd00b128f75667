"""Checkpoints to evaluate: find the model folder, read its training metadata, load model and tokenizer.

A checkpoint is a Hugging Face causal-LM folder (config.json, weights, tokenizer files), a `merit train`
run folder (its latest `step_N/` is used), or a hub model name when the hub (or its cache) has it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from merit_core import runs
from merit_core.errors import CheckpointError, ConfigError, first_line
from merit_core.hub import looks_like_hub_id

TOKENIZER_FILES = runs.TOKENIZER_FILES
# trainer_state.json fields copied into the output's `meta`, with the type each must have.
TRAINER_STATE_FIELDS: dict[str, type] = {
    "optimizer": str,
    "step": int,
    "global_batch_size": int,
    "seq_len": int,
    "tokens": int,
}


@dataclass
class CheckpointRef:
    """Where a checkpoint's model lives, and what is known about how it was trained."""

    given: str  # as the user wrote it
    location: str  # model folder (absolute) or hub name
    is_local: bool
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """A short column title: 'run/step_N' for training steps, else the folder or hub name."""
        if not self.is_local:
            return self.location
        path = Path(self.location)
        return f"{path.parent.name}/{path.name}" if runs.parse_step(path.name) is not None else path.name


def latest_step_dir(run_dir: Path) -> Path | None:
    """The latest `step_N` subfolder that holds a model (config.json and weights), or None."""
    return runs.latest(run_dir, "model")


def read_trainer_state(model_dir: Path) -> dict[str, Any]:
    """The known fields of `trainer_state.json` with the right types; {} when absent or unreadable."""
    state = runs.read_trainer_state(model_dir, strict=False)
    out = {}
    for key, kind in TRAINER_STATE_FIELDS.items():
        value = state.get(key)
        if isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
            out[key] = value
    return out


def resolve_checkpoint(given: str | os.PathLike) -> CheckpointRef:
    """Find the model folder for `given` and check it has config.json and a tokenizer.

    Raises CheckpointError for a missing path, a run folder without steps, or a folder without
    config.json or tokenizer files. Strings shaped like hub ids that are not local paths pass through.
    """
    text = os.fspath(given)
    path = Path(text).expanduser()
    if not path.exists():
        if looks_like_hub_id(text):
            return CheckpointRef(text, text, is_local=False, meta={"source": "hub"})
        raise CheckpointError(f"checkpoint not found: {text}")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {text} is a file; give the model folder that holds config.json")
    path = path.resolve()
    source = "hf-folder"
    if not (path / runs.MODEL_CONFIG).is_file():
        step = latest_step_dir(path)
        if step is None:
            raise CheckpointError(
                f"checkpoint {text} has no config.json and no step_N/ checkpoint folder: "
                "give a Hugging Face model folder or a `merit train` run folder"
            )
        path = step
    _refuse_pickle_weights(path)
    if not runs.tokenizer_files(path):
        raise CheckpointError(
            f"checkpoint {path} has no tokenizer ({' / '.join(TOKENIZER_FILES[:2])}): "
            "save one next to the model with tokenizer.save_pretrained(folder)"
        )
    state = read_trainer_state(path)
    if state:
        source = "merit-train"
    return CheckpointRef(text, str(path), is_local=True, meta={"source": source, **state})


def _refuse_pickle_weights(folder: Path) -> None:
    """CheckpointError when the folder's weights are pickle files only (.bin, .pt, .pth, ...): those are
    never handed to transformers, whose loader would unpickle them (as inspect refuses them)."""
    from merit_core.diagnostics.checkpoints import PICKLE_SUFFIXES, refuse_pickle

    if runs.has_weights(folder):
        return
    pickles = sorted(p.name for p in folder.iterdir() if p.is_file() and p.suffix.lower() in PICKLE_SUFFIXES)
    if pickles:
        raise refuse_pickle(
            folder / pickles[0], f"a pickle-based checkpoint ({pickles[0]}) with no safetensors weights"
        )


def check_causal_lm(ref: CheckpointRef) -> Any:
    """Load the model config and check it describes a decoder-only causal LM; returns the config."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        config = AutoConfig.from_pretrained(ref.location)
    except (OSError, ValueError, KeyError) as exc:
        where = "a model folder" if ref.is_local else "a local folder, and the hub (or its cache) does not have it"
        raise CheckpointError(f"cannot read the model config of {ref.given} (not {where}): {first_line(exc)}") from None
    causal_classes = {
        c for v in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values() for c in ((v,) if isinstance(v, str) else v)
    }
    architectures = list(getattr(config, "architectures", None) or [])
    is_causal = (
        not getattr(config, "is_encoder_decoder", False)
        and config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        and (not architectures or any(a in causal_classes for a in architectures))
    )
    if not is_causal:
        kind = architectures[0] if architectures else f"a {config.model_type!r} model"
        raise CheckpointError(
            f"checkpoint {ref.given} holds {kind}, not a causal language model (…ForCausalLM / …LMHeadModel); "
            "merit eval scores decoder-only LMs"
        )
    return config


_DTYPES = {
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "float32": "float32",
    "fp32": "float32",
}


def resolve_dtype(dtype: str | None, device: str) -> str:
    """'auto'/None -> bfloat16 on CUDA, float32 elsewhere; otherwise a checked dtype name."""
    if dtype in (None, "", "auto"):
        return "bfloat16" if device.startswith("cuda") else "float32"
    if dtype.lower() not in _DTYPES:
        raise ConfigError(f"--dtype {dtype}: use auto, bfloat16, float16 or float32")
    return _DTYPES[dtype.lower()]


def load_model_and_tokenizer(ref: CheckpointRef, device: str, dtype: str) -> tuple[Any, Any]:
    """Load the causal LM (eval mode, on `device`, in `dtype`) and its tokenizer; no remote code."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_causal_lm(ref)
    try:
        tokenizer = AutoTokenizer.from_pretrained(ref.location)
    except (OSError, ValueError, KeyError) as exc:
        raise CheckpointError(f"cannot load the tokenizer of {ref.given}: {first_line(exc)}") from None
    try:
        safe = {"use_safetensors": True} if ref.is_local else {}  # never a pickle next to the safetensors
        model = AutoModelForCausalLM.from_pretrained(ref.location, dtype=getattr(torch, dtype), **safe)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise CheckpointError(f"cannot load the model weights of {ref.given}: {first_line(exc)}") from None
    return model.to(device).eval(), tokenizer
