"""Checkpoints to evaluate: find the model folder, read its training metadata, load model and tokenizer.

A checkpoint is a Hugging Face causal-LM folder (config.json, weights, tokenizer files), a `merit train`
run folder (its latest `step_N/` is used: merit_core.checkpoint.resolve picks it), or a hub model name
when the hub (or its cache) has it. A merit checkpoint's files are verified against the checksums its
trainer_state.json records before anything loads them.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from merit_core.checkpoint import runs
from merit_core.checkpoint.hub_cache import check_config_size, fetch_snapshot
from merit_core.checkpoint.hub_revisions import HubRequest, parse_hub_model
from merit_core.checkpoint.resolve import LATEST, select_steps
from merit_core.checkpoint.safe import (
    PICKLE_SUFFIXES,
    check_special_tokens,
    index_files,
    refuse_pickle,
    refuse_special_files,
    validate_safetensors,
)
from merit_core.checkpoint.state import SKIPPED, optional_trainer_state, verify_checkpoint
from merit_core.errors import CheckpointError, ConfigError, first_line
from merit_core.file_reading import display
from merit_core.hub import looks_like_hub_id
from merit_core.models.limits import check_model_dims, check_model_size
from merit_core.progress import ProgressFn
from merit_core.settings import DTYPE_SPELLINGS

TOKENIZER_FILES = runs.TOKENIZER_FILES
# trainer_state.json fields copied into the output's `meta`.
TRAINER_STATE_FIELDS = ("optimizer", "step", "global_batch_size", "seq_len", "tokens")


@dataclass
class CheckpointRef:
    """Where a checkpoint's model lives, and what is known about how it was trained."""

    given: str  # as the user wrote it
    location: str  # model folder (absolute) or hub name
    is_local: bool
    meta: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # what the user is told once (checksums not verified)

    @property
    def label(self) -> str:
        """A short column title: 'run/step_N' for training steps, else the folder or hub name."""
        if not self.is_local or self.meta.get("source") == "hub":
            return self.given if self.is_local else self.location
        path = Path(self.location)
        return f"{path.parent.name}/{path.name}" if runs.parse_step(path.name) is not None else path.name


def trainer_meta(model_dir: Path) -> dict[str, Any]:
    """The TRAINER_STATE_FIELDS trainer_state.json records; {} when it is absent (or, unverified, unreadable)."""
    state = optional_trainer_state(model_dir, strict=False)
    if state is None:
        return {}
    return {key: state.get(key) for key in TRAINER_STATE_FIELDS if state.get(key) is not None}


def resolve_checkpoint(
    given: str | os.PathLike,
    trust_remote_code: bool = False,
    verify: bool = True,
    progress: ProgressFn | None = None,
    snapshot: Path | None = None,
) -> CheckpointRef:
    """Find the model folder for `given` and check it has config.json, safe weights and a tokenizer.

    Raises CheckpointError for a missing path, a run folder without steps, a folder without
    config.json or tokenizer files, weights that are pickles or not complete safetensors files, a
    FIFO or device among the files, or (without `trust_remote_code`) code the folder asks to run.
    A hub model ORG/NAME[@REV] that is not a local path is its snapshot folder in the hub cache
    (merit_core.checkpoint.hub_cache: downloaded first where needed, `progress` told); other strings
    shaped like hub ids pass through; `snapshot` is that folder where the caller has fetched it already
    (a revision held while it is scored: merit_core.checkpoint.resolve.Checkpoint.held). With `verify`, a
    merit checkpoint's files are checked against its recorded checksums (CheckpointError on a mismatch).
    """
    try:
        return _resolve_checkpoint(os.fspath(given), trust_remote_code, verify, progress, snapshot)
    except PermissionError as exc:
        raise CheckpointError(f"cannot read {display(exc.filename or given)}: permission denied") from None


def _resolve_checkpoint(
    text: str, trust_remote_code: bool, verify: bool, progress: ProgressFn | None, snapshot: Path | None
) -> CheckpointRef:
    path = Path(text).expanduser()
    hub = parse_hub_model(text) if not path.exists() else None
    if hub is not None and snapshot is not None:
        path = snapshot
    elif hub is not None:  # the one reader of hub models, as inspect's (merit_core.checkpoint.resolve)
        path = fetch_snapshot(hub, HubRequest(trust_remote_code=trust_remote_code, progress=progress))
    if not path.exists():
        if looks_like_hub_id(text):
            return CheckpointRef(text, text, is_local=False, meta={"source": "hub"})
        raise CheckpointError(f"checkpoint not found: {text}{runs.missing_step_hint(path)}")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {text} is a file; give the model folder that holds config.json")
    path = path.resolve()
    source = "hf-folder"
    refuse_special_files(path)
    if not (path / runs.MODEL_CONFIG).is_file():
        if not runs.checkpoints(path, "model"):
            raise CheckpointError(
                f"checkpoint {text} has no config.json and no step_N/ checkpoint folder: "
                "give a Hugging Face model folder or a `merit train` run folder"
            )
        ((_, path),) = select_steps(path, LATEST, "model")
        refuse_special_files(path)
    if not runs.tokenizer_files(path):
        raise CheckpointError(
            f"checkpoint {display(path)} has no tokenizer ({' / '.join(TOKENIZER_FILES[:2])}): "
            "save one next to the model with tokenizer.save_pretrained(folder)"
        )
    files = check_weight_files(path)
    if not trust_remote_code:
        refuse_custom_code(path)
    check_layers(path, files)
    note = verify_checkpoint(path) if verify else SKIPPED
    state = trainer_meta(path)
    if hub is not None:
        source = "hub"
    if state:
        source = "merit-train"
    notes = [note] if note is not None else []
    return CheckpointRef(
        text,
        str(path),
        is_local=True,
        meta={"source": source, **({"hub": str(hub)} if hub else {}), **state},
        notes=notes,
    )


def check_weight_files(folder: Path) -> list[Path]:
    """The safetensors files a loader will open for `folder`, each checked complete before it is.

    model.safetensors, or every shard its index maps a tensor to (a shard that is a pickle is
    refused like a lone pytorch_model.bin: transformers would unpickle it). Weights that are only
    pickle files (.bin, .pt, .pth, ...) are refused; they are never handed to transformers.
    """
    if (folder / runs.WEIGHTS_NAME).exists():
        files = [folder / runs.WEIGHTS_NAME]
    elif (folder / runs.INDEX_NAME).exists():
        files = index_files(folder / runs.INDEX_NAME)
    else:
        pickles = sorted(p.name for p in folder.iterdir() if p.suffix.lower() in PICKLE_SUFFIXES)
        if pickles:
            raise refuse_pickle(
                folder / pickles[0], f"a pickle-based checkpoint ({pickles[0]}) with no safetensors weights"
            )
        raise CheckpointError(f"checkpoint {display(folder)} has no weights ({runs.WEIGHTS_NAME} or its index)")
    for file in files:
        validate_safetensors(file)
    return files


_LAYER = re.compile(r"(?:^|\.)(?:h|layers|layer|blocks)\.(\d+)\.")  # a decoder layer's tensors: ...layers.N.
_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers")


def check_layers(folder: Path, files: list[Path]) -> None:
    """CheckpointError when the weights hold more decoder layers than config.json says, as inspect's
    loader refuses: transformers would build the smaller model and drop the extra layers silently."""
    config = folder / runs.MODEL_CONFIG
    check_config_size(config)
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return  # reported by the loader, as before
    key = next((k for k in _LAYER_KEYS if isinstance(data, dict) and k in data), None)
    said = data.get(key) if key is not None else None
    if not isinstance(said, int) or isinstance(said, bool):
        return
    extra = data.get("num_nextn_predict_layers")  # multi-token-prediction layers stored after the decoder's
    said_all = said + (extra if isinstance(extra, int) and not isinstance(extra, bool) else 0)
    found = {int(m.group(1)) for f in files for name in validate_safetensors(f) if (m := _LAYER.search(name))}
    if found and max(found) + 1 > said_all:
        raise CheckpointError(
            f"config.json of {display(folder)} does not match the weights: {key}={said} but the weights have "
            f"{max(found) + 1} layers"
        )


# Files of a model folder whose `auto_map` names Python code transformers would import from it.
CODE_CONFIGS = (runs.MODEL_CONFIG, "tokenizer_config.json", "processor_config.json", "preprocessor_config.json")


def refuse_custom_code(folder: Path) -> None:
    """CheckpointError when the folder's configs ask transformers to run code shipped with it (`auto_map`)
    or it ships .py files: merit eval runs such code only with --trust-remote-code."""
    for name in CODE_CONFIGS:
        path = folder / name
        if not path.is_file():
            continue
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError):
            continue  # unreadable configs are reported by the loader, as before
        if isinstance(data, dict) and data.get("auto_map"):
            raise CheckpointError(
                f"{display(path)} asks to run code shipped with the checkpoint (auto_map); merit eval never runs "
                "it unless you pass --trust-remote-code (only for checkpoints you trust)"
            )


def check_causal_lm(ref: CheckpointRef, trust_remote_code: bool = False) -> Any:
    """Load the model config and check it describes a decoder-only causal LM; returns the config."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        config = AutoConfig.from_pretrained(ref.location, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as exc:
        where = "a model folder" if ref.is_local else "a local folder, and the hub (or its cache) does not have it"
        raise CheckpointError(f"cannot read the model config of {ref.given} (not {where}): {first_line(exc)}") from None
    except Exception as exc:  # noqa: BLE001 - transformers' field validation of a crafted config.json (n_head: null)
        raise CheckpointError(f"config.json of {ref.given} is not a usable model config: {first_line(exc)}") from None
    check_model_dims(config, f"checkpoint {ref.given}")
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


_DTYPES = DTYPE_SPELLINGS  # the spellings every command reads (merit_core.settings)


def resolve_dtype(dtype: str | None, device: str) -> str:
    """'auto'/None -> bfloat16 on CUDA, float32 elsewhere; otherwise a checked dtype name."""
    if dtype in (None, "", "auto"):
        return "bfloat16" if device.startswith("cuda") else "float32"
    if dtype.lower() not in _DTYPES:
        raise ConfigError(f"--dtype {dtype}: use auto, bfloat16, float16 or float32")
    return _DTYPES[dtype.lower()]


def check_tokenizer(ref: CheckpointRef, trust_remote_code: bool = False) -> None:
    """Load the checkpoint's tokenizer once, before any task or model is loaded, and check that it
    has an end-of-text token (check_special_tokens): a broken tokenizer fails in seconds."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(ref.location, trust_remote_code=trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - transformers raises many types for a broken tokenizer folder
        raise CheckpointError(f"cannot load the tokenizer of {ref.given}: {first_line(exc)}") from None
    check_special_tokens(tokenizer, f"checkpoint {ref.given}")


def _load_error(exc: BaseException) -> str:
    """transformers' words for a failed load, without its pointer to a loading report merit silenced."""
    text = first_line(exc)
    if "above report" in text:
        if "mismatched_sizes" in text or "ignore_mismatched" in text:
            return "a tensor's shape differs from what its config.json describes"
        return "transformers could not convert its weights to the model its config.json describes"
    return text


def load_model_and_tokenizer(
    ref: CheckpointRef,
    device: str,
    dtype: str,
    trust_remote_code: bool = False,
    note: Callable[[str], None] | None = None,
) -> tuple[Any, Any]:
    """Load the causal LM (eval mode, on `device`, in `dtype`) and its tokenizer; code shipped with
    the checkpoint runs only with `trust_remote_code`, and weights are read from safetensors only.
    `note` is told (one line) when the weights leave parameters of the config at random init."""
    import torch
    from transformers import AutoModelForCausalLM

    config = check_causal_lm(ref, trust_remote_code)
    check_model_size(config, ref.given, device, bytes_per_parameter=getattr(torch, dtype).itemsize)
    remote = {"trust_remote_code": trust_remote_code}
    tokenizer = load_tokenizer(ref, trust_remote_code)
    try:
        # use_safetensors: never a pickle, not even one next to the safetensors or on the hub
        loaded: Any = AutoModelForCausalLM.from_pretrained(
            ref.location, dtype=getattr(torch, dtype), use_safetensors=True, output_loading_info=True, **remote
        )
        model, info = loaded  # (model, loading info) with output_loading_info=True
    except Exception as exc:  # noqa: BLE001 - a crafted file makes transformers / safetensors raise many types
        raise CheckpointError(f"cannot load the model weights of {ref.given}: {_load_error(exc)}") from None
    missing = sorted((info or {}).get("missing_keys") or [])
    if missing and note is not None:
        note(random_init_warning(ref.given, missing))
    # transformers' decorated PreTrainedModel.to loses its self in the annotations
    return model.to(device).eval(), tokenizer


def load_tokenizer(ref: CheckpointRef, trust_remote_code: bool = False) -> Any:
    """The checkpoint's tokenizer, checked to have an end-of-text token (CheckpointError if not)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(ref.location, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as exc:
        raise CheckpointError(f"cannot load the tokenizer of {ref.given}: {first_line(exc)}") from None
    check_special_tokens(tokenizer, f"checkpoint {ref.given}")
    return tokenizer


def random_init_warning(given: str, missing: list[str]) -> str:
    """One line: the checkpoint's weights leave these parameters of its config at random init."""
    shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
    return (
        f"warning: {given}: {len(missing)} parameters of its config.json are not in its weights and stay at "
        f"random init ({shown}); the scores are of a partly random model (does config.json describe these weights?)"
    )
