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

import json
import math
import os
import stat
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from merit_core import runs
from merit_core.errors import CheckpointError
from merit_core.fileio import display, special_entries, special_file
from merit_core.runs import INDEX_NAME, WEIGHTS_NAME

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
_DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
_MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit


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


def refuse_pickle(path: Path, why: str) -> CheckpointError:
    return CheckpointError(
        f"{path} is {why}; merit never unpickles checkpoints (arbitrary code could run). "
        "Convert it to safetensors first, e.g. with transformers: "
        "AutoModelForCausalLM.from_pretrained(folder).save_pretrained(out) in a trusted environment."
    )


def validate_safetensors(path: Path) -> dict[str, dict]:
    """Check a file is a complete safetensors file; return its header's tensor entries (name -> info).

    Reads only the 8-byte length and the JSON header. Raises CheckpointError naming the problem:
    missing, a pickle, not safetensors, truncated, corrupt header, or tensor data past the end.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint not found: {display(path)}")
    if path.is_dir():
        raise CheckpointError(f"{display(path)} is a folder, expected a .safetensors file")
    if path.suffix.lower() in PICKLE_SUFFIXES:
        raise refuse_pickle(path, f"a pickle-based checkpoint ({display(path.suffix)})")
    try:
        with open_regular(path) as fh:
            size = os.fstat(fh.fileno()).st_size
            head = fh.read(8)
            if head[:4] == b"PK\x03\x04":
                raise refuse_pickle(path, "a torch.save zip archive (pickle inside)")
            if head[:1] == b"\x80" and len(head) > 1 and 2 <= head[1] <= 5:
                raise refuse_pickle(path, "a pickle file")
            if len(head) < 8:
                raise CheckpointError(f"{display(path)} is not a safetensors file: only {size} bytes")
            (n,) = struct.unpack("<Q", head)
            if n == 0 or n > _MAX_HEADER:
                raise CheckpointError(f"{display(path)} is not a safetensors file: implausible header length {n}")
            if 8 + n > size:
                raise CheckpointError(
                    f"{display(path)} is truncated or not safetensors: header of {n} bytes but the file has {size}"
                )
            raw = fh.read(n)
    except OSError as exc:
        raise CheckpointError(f"cannot read {display(path)}: {exc.strerror or exc}") from None
    try:
        header = json.loads(raw.decode("utf-8"))
        if not isinstance(header, dict):
            raise ValueError("not a JSON object")
    except (UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"{path} has a corrupt safetensors header ({exc})") from None
    header.pop("__metadata__", None)
    available = size - 8 - n
    for name, info in header.items():
        try:
            dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
            nbytes = _DTYPE_BYTES[dtype] * math.prod(shape)
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in (begin, end, *shape)):
                raise TypeError("offsets and shape must be integers")
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path} has a corrupt safetensors header: bad entry for {name!r}") from None
        if not (0 <= begin <= end) or end - begin != nbytes:
            raise CheckpointError(f"{path} has a corrupt safetensors header: offsets of {name!r} do not fit its shape")
        if end > available:
            raise CheckpointError(
                f"{path} is truncated: tensor {name!r} ends at byte {end} of the data but only {available} are there"
            )
    if not header:
        raise CheckpointError(f"{path} holds no tensors")
    return header


def open_regular(path: Path):
    """`path` opened for binary reading, refused (CheckpointError) unless it is a regular file.

    Opened without blocking and checked on the open descriptor, so a FIFO swapped in after a
    check cannot hang the read."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            what = special_file(path) or "not a regular file"
            raise CheckpointError(f"{display(path)} is {what}; merit reads only regular files")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


def refuse_special_files(folder: Path) -> None:
    """CheckpointError when a checkpoint folder holds a FIFO, socket or device: a loader opening it
    (config.json, a tokenizer file, a weight file) would block forever or read without end."""
    found = special_entries(folder)
    if found:
        name, what = found[0]
        raise CheckpointError(f"{display(folder / name)} is {what}; merit reads only regular files from a checkpoint")


def index_files(index: Path) -> list[Path]:
    """The shard files a sharded checkpoint's index maps tensors to (each a plain name in its folder)."""
    try:
        with open_regular(index) as fh:
            data = json.loads(fh.read().decode("utf-8"))
        names = data["weight_map"].values()
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError):
        raise CheckpointError(f"{display(index)} is not a valid sharded-checkpoint index (no weight_map)") from None
    bad = [n for n in names if not isinstance(n, str) or n in ("", ".", "..") or "/" in n or "\\" in n]
    if bad:
        raise CheckpointError(
            f"{display(index)} is not a valid sharded-checkpoint index: weight_map value {bad[0]!r} is not a "
            "shard file name in its folder"
        )
    files = [index.parent / name for name in sorted(set(names))]
    for f in files:
        if not f.exists():
            raise CheckpointError(f"{display(index)} names shard {display(f.name)}, which is missing")
    if not files:
        raise CheckpointError(f"{display(index)} lists no shards")
    return files


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
        steps.sort(key=lambda c: c.step)
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
            with open_regular(file) as fh:
                # Through the checked descriptor: no FIFO swapped in since validation, and a file name
                # that is not UTF-8 (which safetensors cannot take) still opens.
                fd_path = f"/proc/self/fd/{fh.fileno()}"
                with safe_open(fd_path if os.path.exists(fd_path) else str(file), framework="pt") as handle:
                    return handle.get_tensor(name)
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"cannot read {name!r} from {display(file)}: {exc}") from None

    def __contains__(self, name) -> bool:  # without reading the tensor
        return name in self.checkpoint.tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self.checkpoint.tensors)

    def __len__(self) -> int:
        return len(self.checkpoint.tensors)
