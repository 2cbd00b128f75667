"""Writing a checkpoint: `<run>/step_<N>/`, a complete Hugging Face model folder plus trainer state.

A checkpoint holds `config.json`, `model.safetensors`, the tokenizer files (so it loads with
`AutoModelForCausalLM.from_pretrained` / `AutoTokenizer.from_pretrained` and lm-eval on its
own), `trainer_state.json` (step, tokens, lr, model, optimizer, batch shape: what tools read)
and `trainer_state.pt` (optimizer state, RNG states, data position; tensors and plain
containers only, so it loads with `torch.load(weights_only=True)`). Under fsdp the optimizer
state is instead an `optimizer/` folder of torch.distributed.checkpoint shards, which every
process writes into the staged folder (`merit_core.checkpoint.runs.begin_staging`). It is written into
`<run>/.tmp-step_<N>`, fsynced and renamed into place, so a crash never leaves half a
checkpoint. What the folder layout is (naming, completeness, "latest", staging, durable
writes) belongs to `merit_core.checkpoint.runs`, reading the files to the rest of this package;
this module writes the files of one checkpoint and prunes old ones. During training the run
folder's owner (merit_core.train.run_folder) is its one caller.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from merit_core.checkpoint import runs
from merit_core.checkpoint.runs import STATE_PT
from merit_core.checkpoint.state import TrainerState, write_trainer_state
from merit_core.data.tokenizer import make_tokenizer_portable


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    *,
    model,
    state_dict: dict[str, torch.Tensor] | None,
    tokenizer_dir: str | Path | None,
    info: TrainerState,
    state: dict[str, Any],
    staging: Path | None = None,
) -> Path:
    """Write `step_<step>/` atomically and durably, and return its path.

    model: the unwrapped transformers model (its config and save_pretrained are used);
    state_dict: full weights to save instead of the model's own (sharded training);
    info: the trainer state for trainer_state.json (written last, with the sha256 of every
    other file); state: the tensor trainer state for trainer_state.pt;
    staging: the folder from `runs.begin_staging` when other files were already written into it.
    """
    run_dir = Path(run_dir)
    tmp = staging if staging is not None else runs.begin_staging(run_dir, step)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Writing model shards" bars would break the caller's progress display
    kwargs = {"state_dict": state_dict} if state_dict is not None else {}
    model.save_pretrained(tmp, **kwargs)
    if tokenizer_dir is not None:
        for item in runs.tokenizer_files(tokenizer_dir):
            shutil.copyfile(item, tmp / item.name)
        make_tokenizer_portable(tmp)  # data prepared by transformers 5 before tokenizers were saved portably
    torch.save(state, tmp / STATE_PT)
    write_trainer_state(tmp, info)
    return runs.publish_folder(tmp, runs.step_path(run_dir, step))


def prune_checkpoints(run_dir: str | Path, keep: int) -> None:
    """Keep only the newest `keep` checkpoints (keep <= 0 keeps all)."""
    if keep <= 0:
        return
    for _, path in runs.checkpoints(run_dir)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)
