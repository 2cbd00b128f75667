"""Finding and validating safetensors checkpoints without loading (or unpickling) anything.

A user path resolves to one or more `Checkpoint`s:
- a `*.safetensors` file;
- a sharded checkpoint's `model.safetensors.index.json`;
- a Hugging Face folder (`model.safetensors` or the sharded index, `config.json` alongside);
- a `merit train` run folder: every complete `step_<N>/` subfolder, in step order
  (temporary `.tmp*` folders and folders without weights are skipped).

Every weight file's header is checked against the file size before safetensors opens it, so a
truncated or corrupt file gets a precise one-line `CheckpointError`. Pickle-based checkpoints
(`.bin`, `.pt`, ...) are refused on their name or magic bytes; they are never read further.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from merit_core import runs
from merit_core.checkpoints import (  # the one safe reader of a checkpoint, shared with eval and resume
    PICKLE_SUFFIXES,
    index_files,
    open_regular,
    opened_path,
    refuse_pickle,
    refuse_special_files,
    validate_safetensors,
)
from merit_core.errors import CheckpointError
from merit_core.fileio import display
from merit_core.runs import INDEX_NAME, WEIGHTS_NAME

__all__ = [
    "PICKLE_SUFFIXES",
    "Checkpoint",
    "SafetensorsReader",
    "find_checkpoints",
    "index_files",
    "open_regular",
    "refuse_pickle",
    "refuse_special_files",
    "validate_safetensors",
]


@dataclass
class Checkpoint:
    """One model's weights: the safetensors files, the folder holding them, and where it came from."""

    path: Path  # what identifies it: a file or a folder
    files: list[Path]  # the safetensors files holding its tensors
    folder: Path  # where config.json / tokenizer files would sit
    step: int | None = None  # training step, for `merit train` checkpoints
    run: Path | None = None  # the run folder it belongs to, if any
    notes: list[str] = field(default_factory=list)
    tensors: dict[str, tuple[Path, str, tuple[int, ...]]] = field(default_factory=dict)  # name -> (file, dtype, shape)

    @property
    def config_path(self) -> Path | None:
        p = self.folder / runs.MODEL_CONFIG
        return p if p.is_file() else None

    @property
    def label(self) -> str:
        return display(self.path)  # printable even when the file name is not UTF-8


def _read_step(folder: Path) -> int | None:
    return runs.state_step(folder)


def _folder_checkpoint(folder: Path) -> Checkpoint | None:
    refuse_special_files(folder)
    if (folder / WEIGHTS_NAME).is_file():
        files = [folder / WEIGHTS_NAME]
    elif (folder / INDEX_NAME).is_file():
        files = index_files(folder / INDEX_NAME)
    else:
        return None
    return Checkpoint(path=folder, files=files, folder=folder, step=_read_step(folder))


def _describe(folder: Path, limit: int = 8) -> str:
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir())
    if not names:
        return "it is empty"
    more = f", ... ({len(names)} entries)" if len(names) > limit else ""
    return "found: " + ", ".join(names[:limit]) + more


def _from_folder(folder: Path) -> list[Checkpoint]:
    single = _folder_checkpoint(folder)
    if single is not None:
        return [single]
    steps: list[Checkpoint] = []
    skipped: list[str] = []
    for step, sub in runs.step_folders(folder):
        try:
            ckpt = _folder_checkpoint(sub) if runs.has_weights(sub) else None
        except PermissionError:  # a step folder this user may not read: skipped, and said so
            ckpt = None
        if ckpt is None:
            skipped.append(sub.name)
            continue
        ckpt.run = folder
        if ckpt.step is None:
            ckpt.step = step
        steps.append(ckpt)
    if steps:
        steps.sort(key=lambda c: c.step or 0)  # every step is set above
        if skipped:
            steps[0].notes.append(f"skipped incomplete checkpoint folders: {', '.join(sorted(skipped))}")
        return steps
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix.lower() in PICKLE_SUFFIXES)
    if pickles:
        raise refuse_pickle(
            folder / pickles[0], f"a pickle-based checkpoint ({pickles[0]}) with no safetensors weights"
        )
    raise CheckpointError(
        f"no checkpoint in {folder}: expected {WEIGHTS_NAME}, {INDEX_NAME} or step_* folders; {_describe(folder)}"
    )


def find_checkpoints(path: str | Path) -> list[Checkpoint]:
    """Resolve a user path to its checkpoints (validated), in step order for a run folder."""
    path = Path(path).expanduser()
    try:
        return _find_checkpoints(path)
    except PermissionError as exc:
        raise CheckpointError(f"cannot read {display(exc.filename or path)}: permission denied") from None


def _find_checkpoints(path: Path) -> list[Checkpoint]:
    if not path.exists():
        raise CheckpointError(f"checkpoint not found: {display(path)}{runs.missing_step_hint(path)}")
    if path.is_dir():
        found = _from_folder(path)
    elif path.name.endswith(".index.json"):
        found = [Checkpoint(path=path, files=index_files(path), folder=path.parent, step=_read_step(path.parent))]
    else:
        found = [Checkpoint(path=path, files=[path], folder=path.parent, step=_read_step(path.parent))]
    for ckpt in found:
        for f in ckpt.files:
            for name, info in validate_safetensors(f).items():
                if name in ckpt.tensors:
                    raise CheckpointError(f"tensor {name!r} appears in two shards of {ckpt.path}")
                ckpt.tensors[name] = (f, info["dtype"], tuple(info["shape"]))
    return found


class SafetensorsReader(Mapping):
    """A read-only name -> tensor mapping over a checkpoint's files; each tensor is read when asked.

    Every read opens the file afresh, so the memory map lives only as long as the returned
    tensor: reading a whole checkpoint one tensor at a time never holds more than one in memory.
    """

    def __init__(self, checkpoint: Checkpoint):
        if not checkpoint.tensors:
            raise ValueError("checkpoint was not validated; get it from find_checkpoints()")
        self.checkpoint = checkpoint

    def shape(self, name: str) -> tuple[int, ...]:
        return self.checkpoint.tensors[name][2]

    def dtype(self, name: str) -> str:
        return self.checkpoint.tensors[name][1]

    def __getitem__(self, name: str):
        from safetensors import SafetensorError, safe_open

        file = self.checkpoint.tensors[name][0]
        try:
            with opened_path(file) as checked, safe_open(checked, framework="pt") as handle:
                return handle.get_tensor(name)
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"cannot read {name!r} from {display(file)}: {exc}") from None

    def __contains__(self, name) -> bool:  # without reading the tensor
        return name in self.checkpoint.tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self.checkpoint.tensors)

    def __len__(self) -> int:
        return len(self.checkpoint.tensors)
