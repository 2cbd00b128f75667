"""Reading an fsdp checkpoint's optimizer shards (torch.distributed.checkpoint) without running its code.

torch.distributed.checkpoint keeps two pickles in the `optimizer/` folder of a checkpoint: the
`.metadata` file (read with plain `pickle.load`) and every non-tensor value of the state (the
param groups' hyperparameters, stored as `torch.save` bytes and read back with
`weights_only=False`). A run folder may come from anywhere, and unpickling either can run
arbitrary code, so resume reads them here instead:

- `.metadata` through an unpickler that builds only the metadata records of
  torch.distributed.checkpoint (its dataclasses, torch.Size, dtypes, the layout and memory
  format codes, the shard file paths); any other global is refused before it is called;
- each shard file it names must be a plain name in the folder and a regular file (not a link,
  FIFO or device, which could hang the read or point outside the checkpoint);
- non-tensor values must load under `torch.load(weights_only=True)` (numbers, strings, tuples,
  tensors) before torch reads them its own way.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import stat
from pathlib import Path, PurePosixPath
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo

from merit_core.errors import CheckpointError, MeritError, first_line
from merit_core.file_reading import display, open_regular

METADATA_FILE = ".metadata"

# Globals a metadata pickle may name besides the record classes of torch.distributed.checkpoint.metadata.
_ALLOWED = {
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,  # layout name -> torch.layout
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("pathlib", "PosixPath"): PurePosixPath,  # the checkpoint id it was saved under: kept as a name only
    ("pathlib", "PurePosixPath"): PurePosixPath,
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only the records a torch.distributed.checkpoint `.metadata` file holds."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return _ALLOWED[module, name]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == dcp_metadata.__name__ and "." not in name:
            found = getattr(dcp_metadata, name, None)
            if isinstance(found, type) and found.__module__ == module:  # a record class defined there
                return found
        raise pickle.UnpicklingError(f"it names {module}.{name}, which a checkpoint's metadata never holds")


class SafeShardReader(FileSystemReader):
    """torch's file-system reader with a `.metadata` that cannot run code and shard files checked."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        rank = kwargs.get("rank")
        folder = Path(self.path)
        path = folder / (METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}")
        try:
            with open_regular(path) as fh:
                raw = fh.read()
        except OSError as exc:
            raise CheckpointError(f"cannot read {display(path)}: {exc.strerror or exc}") from None
        try:
            metadata = _MetadataUnpickler(io.BytesIO(raw)).load()
        except MeritError:
            raise
        except Exception as exc:  # noqa: BLE001 - an allowed constructor given a crafted argument raises anything (KeyError)
            raise CheckpointError(
                f"{display(path)} is not checkpoint metadata merit can read safely ({first_line(exc)}); "
                "merit never unpickles code from a checkpoint"
            ) from None
        if not isinstance(metadata, dcp_metadata.Metadata):
            raise CheckpointError(f"{display(path)} is not torch.distributed.checkpoint metadata")
        for info in (metadata.storage_data or {}).values():
            _check_shard_file(folder, info)
        storage_meta = getattr(metadata, "storage_meta", None)
        if storage_meta is None:
            storage_meta = metadata.storage_meta = dcp_metadata.StorageMeta()
        storage_meta.load_id = self.load_id
        return metadata


def _check_shard_file(folder: Path, info: Any) -> None:
    """CheckpointError unless `info` names a regular file directly inside `folder`."""
    name = getattr(info, "relative_path", None)
    if not isinstance(name, str) or not name or os.sep in name or "/" in name or name in (".", ".."):
        raise CheckpointError(f"{display(folder)}: its metadata names a shard outside the folder: {name!r}")
    try:
        mode = os.lstat(folder / name).st_mode
    except OSError as exc:
        raise CheckpointError(f"{display(folder / name)} is missing ({exc.strerror or exc})") from None
    if not stat.S_ISREG(mode):
        raise CheckpointError(f"{display(folder / name)} is not a regular file; merit reads only regular files")


class SafeLoadPlanner(DefaultLoadPlanner):
    """torch's default planner, but a non-tensor value must load with `weights_only=True` first."""

    refusal: CheckpointError | None = None  # kept: torch wraps what load_bytes raises in its own error

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        raw = value.getvalue()
        try:
            torch.load(io.BytesIO(raw), weights_only=True)
        except Exception as exc:  # an unpickling error: a global that is not plain data
            self.refusal = CheckpointError(
                f"optimizer value {read_item.dest_index.fqn!r} of the checkpoint is not plain data "
                f"({_weights_only_refusal(exc)}); merit never unpickles code from a checkpoint"
            )
            raise self.refusal from None
        super().load_bytes(read_item, io.BytesIO(raw))  # the same bytes, now known to be plain data


def load_sharded(target: dict[str, Any], folder: Path) -> None:
    """Fill `target` (a state dict, as from get_optimizer_state_dict) from the shards in `folder`.

    The metadata is read (and checked) once before torch's loader, which otherwise logs a failed
    read and retries with per-rank metadata. Whatever fails (a refusal, shards of another model, an
    unreadable shard) is raised as merit's own one-line CheckpointError."""
    reader, planner = SafeShardReader(folder), SafeLoadPlanner()
    reader.read_metadata()
    try:
        dcp.load(target, storage_reader=reader, planner=planner)
    except CheckpointError:
        raise
    except (CheckpointException, Exception) as exc:  # CheckpointException (a BaseException): what failed per rank
        if planner.refusal is not None:
            raise planner.refusal from None
        failure = next(iter(exc.failures.values()), exc) if isinstance(exc, CheckpointException) else exc
        cause = failure[0] if isinstance(failure, tuple) else failure  # (exception, traceback) per rank
        raise CheckpointError(f"{display(folder)} cannot be loaded into this optimizer: {first_line(cause)}") from None


def _weights_only_refusal(exc: BaseException) -> str:
    """The global torch's weights_only loader refused, from its long message (else its first line)."""
    found = re.search(r"(?:Unsupported global: |unsupported )GLOBAL ([\w.]+)", str(exc))
    return f"it names {found.group(1)}" if found else first_line(exc)
