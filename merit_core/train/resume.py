"""Resuming a run: which checkpoints may continue it, whether they fit this run, which one loads.

`merit train --resume` continues from the newest complete checkpoint of the run folder (or the
one --resume-from names). Before anything is written:
- compatibility: the newest readable trainer_state.json speaks for the run; a checkpoint trained
  with another model, optimizer, batch or sequence length is refused (ResumeMismatch), and so is
  another seed, data or tokenizer unless --allow-changes;
- the run's metrics.jsonl must be readable (it is cut back to the checkpoint's step);
- fallback: when the newest checkpoint does not load, the next older one that does is used and
  the user is told in one line;
- the checkpoint loaded is checked whole before anything of the run is moved or cut back: its
  files against the checksums trainer_state.json records (unless --no-verify), trainer_state.pt's
  step, RNG and optimizer structure (merit_core.checkpoint.tensors), the step against the
  folder's; the optimizer state against the optimizer when the trainer loads it.
The timeline after a resume: metrics.jsonl keeps the records up to the checkpoint's step, and the
last log and eval records before it are what the summary reports until new ones are written.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from merit_core.checkpoint import runs
from merit_core.checkpoint.resolve import ALL, select_steps
from merit_core.checkpoint.runs import METRICS_FILE
from merit_core.checkpoint.safe import refuse_special_files
from merit_core.checkpoint.state import (
    SKIPPED,
    TrainerState,
    optional_trainer_state,
    read_trainer_state,
    verify_checkpoint,
)
from merit_core.checkpoint.tensors import check_trainer_state, load_model_weights, load_trainer_state
from merit_core.errors import CheckpointError, ResumeMismatch, first_line
from merit_core.metric_names import LOSS, VAL_LOSS
from merit_core.metrics import read_metrics
from merit_core.models import family_spec
from merit_core.train.config import TrainConfig


@dataclass
class ResumePlan:
    """The checkpoints a resume may load, newest first, and the trainer_state.json that speaks for them."""

    candidates: list[Path] = field(default_factory=list)
    info: TrainerState | None = None  # trainer_state.json of `ckpt`
    ckpt: Path | None = None
    verify: bool = True  # check each checkpoint's files against its recorded checksums

    def __bool__(self) -> bool:
        return bool(self.candidates)


def plan_resume(config: TrainConfig, run_dir: Path) -> ResumePlan:
    """The checkpoints to resume from, checked to fit `config` (an empty plan when not resuming)."""
    if not config.resume:
        return ResumePlan()
    candidates = _candidates(config, run_dir)
    plan = _compatible(config, candidates)
    plan.verify = config.verify
    _check_metrics(run_dir)
    return plan


def _candidates(config: TrainConfig, run_dir: Path) -> list[Path]:
    if config.resume_from:
        given = Path(config.resume_from).expanduser()
        path = given if given.is_dir() else run_dir / config.resume_from
        if path.is_dir():
            refuse_special_files(path)  # a FIFO in place of a file: said, rather than "not complete"
        if not runs.is_complete(path):
            found = ", ".join(p.name for _, p in runs.checkpoints(run_dir)) or "none"
            raise CheckpointError(
                f"--resume-from {config.resume_from}: not a complete checkpoint of {run_dir} (complete: {found})"
            )
        return [path]
    complete = runs.checkpoints(run_dir, "complete")
    newest = complete[-1][0] if complete else -1
    for step, path in runs.step_folders(run_dir):
        if step > newest:  # a newer checkpoint that a FIFO or device makes incomplete is not skipped silently
            refuse_special_files(path)
    if not complete:
        raise CheckpointError(
            f"nothing to resume: {run_dir} has no complete checkpoint; drop --resume to start a new run"
        )
    return [p for _, p in reversed(select_steps(run_dir, ALL, "complete"))]


def _compatible(config: TrainConfig, candidates: list[Path]) -> ResumePlan:
    """ResumeMismatch when the run's checkpoints were trained with other settings (the newest
    readable trainer_state.json speaks for the run; data and tokenizer are checked in `check_same_data`)."""
    for ckpt in candidates:
        info = optional_trainer_state(ckpt, strict=False)
        if info is not None:
            break
    else:
        return ResumePlan(candidates)
    c = config
    expected = {"model": c.model, "optimizer": c.optimizer, "global_batch_size": c.batch_size, "seq_len": c.seq_len}
    for key, value in expected.items():
        if info.get(key) != value:
            raise ResumeMismatch(
                f"{ckpt} was trained with {key} = {info.get(key)!r}, "
                f"but this run has {value!r}; resume with the run's own settings"
            )
    if not c.allow_changes and info.get("seed") is not None and info.get("seed") != c.seed:
        raise ResumeMismatch(
            f"{ckpt} was trained with another seed ({info.get('seed')} -> {c.seed}); resume with the run's own "
            "seed, or pass --allow-changes to continue anyway"
        )
    return ResumePlan(candidates, info, ckpt)


def _check_metrics(run_dir: Path) -> None:
    try:
        read_metrics(run_dir)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(
            f"{run_dir / METRICS_FILE} is not a metrics log ({first_line(exc)[:80]}); "
            "move it away to resume (training restarts its log from the checkpoint)"
        ) from None


def check_same_data(plan: ResumePlan, config: TrainConfig, meta) -> None:
    """ResumeMismatch when the prepared data or tokenizer differ from the ones the run trained on."""
    if plan.info is None or config.allow_changes:
        return
    for key, value in data_info(meta).items():
        saved = plan.info.get(key)
        if saved is not None and saved != value:
            raise ResumeMismatch(
                f"{plan.ckpt} was trained with another {key} than {meta.path}; resume with the run's own "
                f"{key}, or pass --allow-changes to continue anyway"
            )


def load_resumable(
    plan: ResumePlan, model, run_dir: Path, note: Callable[[str], None], load: Callable[[dict], Any] | None = None
) -> tuple[Path, dict[str, Any]]:
    """Load the newest candidate that loads into `model` and its trainer state (on the CPU); say in
    one line (`note`) when that is not the newest. `load` puts full weights into a sharded model
    (`Parallel.weights_loader`; None: the model's own load_state_dict)."""
    failures: list[str] = []
    for ckpt in plan.candidates:
        try:
            state, why = _load_checked(ckpt, model, plan.verify, load)
        except CheckpointError as exc:
            failures.append(f"{ckpt.name}: {exc}")
            continue
        except Exception as exc:  # noqa: BLE001 - whatever a crafted state raises is one line, never a traceback
            failures.append(f"{ckpt.name}: {runs.STATE_PT} is not a usable trainer state ({first_line(exc)[:120]})")
            continue
        if failures:
            note(f"{plan.candidates[0]} does not load ({failures[0]}); resuming from {ckpt} instead")
        if why is not None:
            note(f"{ckpt}: {why}")
        return ckpt, state
    raise CheckpointError(f"no checkpoint of {run_dir} loads: {'; '.join(failures)}"[:600])


def _load_checked(
    ckpt: Path, model: Any, verify: bool, load: Callable[[dict], Any] | None = None
) -> tuple[dict[str, Any], str | None]:
    """trainer_state.pt of `ckpt` checked whole and the weights loaded into `model`, with a note when
    the files were not verified (no checksums recorded, or --no-verify)."""
    refuse_special_files(ckpt)
    info = read_trainer_state(ckpt, verify=verify)
    named = runs.parse_step(ckpt.name)
    if named is not None and named != info.step:
        raise CheckpointError(f"{ckpt / runs.STATE_JSON} says step {info.step} but the folder is {ckpt.name}")
    state = load_trainer_state(ckpt, map_location="cpu")
    check_trainer_state(state, ckpt / runs.STATE_PT, step=info.step)
    load_model_weights(model, ckpt, rename=family_spec(model.config).model_name, load=load)
    # last: a truncated or swapped file is named by the checks above, a flipped byte only here
    why = verify_checkpoint(ckpt, info) if verify else SKIPPED
    return state, why


def to_device(state: Any, device) -> Any:
    """trainer_state.pt was read on the CPU; optimizer tensors go to `device` (RNG states stay put)."""
    import torch

    if isinstance(state, dict):
        return {k: (v if k == "rng" else to_device(v, device)) for k, v in state.items()}
    if isinstance(state, list):
        return [to_device(v, device) for v in state]
    if isinstance(state, torch.Tensor):
        return state.to(device)
    return state


def last_records(run_dir: Path, ckpt: Path | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The last log and eval records before a resumed run's first step ({} and {} for a new run)."""
    previous: list[dict[str, Any]] = [dict(r) for r in read_metrics(run_dir)] if ckpt is not None else []
    last_log: dict[str, Any] = next((r for r in reversed(previous) if LOSS in r), {})
    last_eval: dict[str, Any] = next((r for r in reversed(previous) if VAL_LOSS in r), {})
    return last_log, last_eval


def data_info(meta) -> dict[str, Any]:
    """What a checkpoint records about its training data: the data's identity and the tokenizer's digest."""
    return {"data": _data_identity(meta), "tokenizer": _tokenizer_digest(meta)}


def _data_identity(meta) -> dict[str, Any]:
    """What identifies the training data of a run, whatever folder it is read from."""
    return {key: getattr(meta, key) for key in ("source", "train_tokens", "val_tokens", "vocab_size")}


def _tokenizer_digest(meta) -> str | None:
    """sha256 over the prepared data's tokenizer files (None when it has no tokenizer folder)."""
    folder = meta.tokenizer_path
    files = runs.tokenizer_files(folder) if folder.is_dir() else []
    if not files:
        return None
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()
