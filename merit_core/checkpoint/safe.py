"""The one safe reader of a checkpoint's files, shared by inspect, eval and resume.

Nothing here loads a tensor or unpickles anything: a safetensors file's 8-byte length and JSON
header are checked against the file (sizes, dtypes, non-negative shapes, offsets that tile the
data exactly, the header-size limit of the safetensors library), so every crafted or truncated
file is refused with one `CheckpointError` line before a library opens it; pickle-based files
are refused on their name or magic bytes; FIFOs, sockets and devices are never opened
(`open_regular`, `opened_path` for the libraries that load a checked file by name). The
tokenizer's special tokens (`check_special_tokens`) are checked here too, so inspect and eval
refuse the same files (a model config's sizes: merit_core.models.limits.check_model_dims).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from merit_core.errors import CheckpointError
from merit_core.file_reading import display, open_regular, special_entries

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
_MAX_HEADER = 100_000_000  # the safetensors library's own limit (bytes, decimal): a larger header it refuses


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
            start = fh.read(9)  # the length, and the header's first byte: "{" in every safetensors file
            head = start[:8]
            if head[:4] == b"PK\x03\x04":
                raise refuse_pickle(path, "a torch.save zip archive (pickle inside)")
            # a pickle's protocol mark; a header length with low byte 0x80 starts alike, then the JSON
            if head[:1] == b"\x80" and len(head) > 1 and 2 <= head[1] <= 5 and start[8:9] != b"{":
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
            raw = start[8:] + fh.read(n - len(start[8:]))
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
    spans = []
    for name, info in header.items():
        try:
            dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in (begin, end, *shape)):
                raise TypeError("offsets and shape must be integers")
            nbytes = _DTYPE_BYTES[dtype] * math.prod(shape)
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path} has a corrupt safetensors header: bad entry for {name!r}") from None
        if any(v < 0 for v in shape):
            raise CheckpointError(f"{path} has a corrupt safetensors header: negative shape {shape} of {name!r}")
        if not (0 <= begin <= end) or end - begin != nbytes:
            raise CheckpointError(f"{path} has a corrupt safetensors header: offsets of {name!r} do not fit its shape")
        if end > available:
            raise CheckpointError(
                f"{path} is truncated: tensor {name!r} ends at byte {end} of the data but only {available} are there"
            )
        spans.append((begin, end, name))
    if not header:
        raise CheckpointError(f"{path} holds no tensors")
    spans.sort()
    reached = 0  # the tensors tile the data exactly, as the safetensors library requires
    for begin, end, name in spans:
        if begin != reached:
            what = "overlaps another tensor" if begin < reached else f"leaves a gap of {begin - reached} bytes"
            raise CheckpointError(f"{path} has a corrupt safetensors header: tensor {name!r} {what}")
        reached = end
    if reached != available:
        raise CheckpointError(
            f"{path} is not a clean safetensors file: {available - reached} bytes after the last tensor's data"
        )
    return header


@contextlib.contextmanager
def opened_path(path: Path) -> Iterator[str]:
    """A name of `path` for a library that opens files by name (safetensors), through a descriptor
    `open_regular` checked: /proc/self/fd/N while it is open, so no FIFO swapped in since the check
    is opened, and a file name that is not UTF-8 (which safetensors cannot take) still opens. The
    path itself where /proc is absent."""
    with open_regular(path) as fh:
        fd_path = f"/proc/self/fd/{fh.fileno()}"
        yield fd_path if os.path.exists(fd_path) else str(path)


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


def check_special_tokens(tokenizer: Any, where: str) -> None:
    """CheckpointError when a tokenizer has no end-of-text token: scoring (and the attention probe)
    needs it to end documents, and a tokenizer config that lost it fails deep inside the harness."""
    if getattr(tokenizer, "eos_token_id", None) is None:
        raise CheckpointError(
            f"{where}: the tokenizer has no end-of-text token (eos_token); its tokenizer_config.json lost its "
            "special tokens: save the tokenizer again with eos_token set"
        )
