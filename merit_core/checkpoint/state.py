"""`TrainerState`: what a checkpoint's trainer_state.json says, typed, and the one reader and writer of it.

trainer_state.json is what tools read about a checkpoint without torch: the step, tokens, lr,
model, optimizer, batch shape, losses, the data it trained on, and the sha256 of every other file
of the checkpoint folder (`checksums`). The file itself carries `state_sha256`, the sha256 of its
own content without that key (canonical JSON: sorted keys, no spaces), so a flipped byte in it is
caught too. `verify_checkpoint` checks both; checkpoints written before the checksums existed
load with a note that they were not verified.

A field that is present must have its type (a crafted `"step": -5` or `"step": "7"` is a
CheckpointError in one line, wherever it is read); fields a foreign or older checkpoint lacks are
None.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from merit_core.durable_writes import STAGING_MARKER, atomic_write
from merit_core.errors import CheckpointError
from merit_core.file_reading import display, open_regular

STATE_JSON = "trainer_state.json"
STATE_FORMAT = "merit-trainer-v1"
MAX_STATE_BYTES = 16 * 1024 * 1024  # a trainer_state.json is a few kB: a larger one is not merit's
SELF_KEY = "state_sha256"
NOT_VERIFIED = "not verified: no checksums recorded (written before merit recorded them)"
SKIPPED = "checksums not verified (--no-verify)"
_HASH_CHUNK = 1 << 20


@dataclass(frozen=True)
class TrainerState:
    """trainer_state.json of one checkpoint. Built by the training loop, written by `write_trainer_state`."""

    step: int
    tokens: int | None = None
    total_steps: int | None = None
    lr: float | None = None  # the lr of the update that led to `step`
    model: str | None = None
    optimizer: str | None = None
    global_batch_size: int | None = None
    micro_batch_size: int | None = None
    seq_len: int | None = None
    world_size: int | None = None
    parallel: str | None = None
    seed: int | None = None
    n_params: int | None = None
    loss: float | None = None
    val_loss: float | None = None
    max_attention_logit: list[float | None] | None = None  # per layer, at the last eval
    data: dict[str, Any] | None = None  # the prepared data's identity (source, token counts, vocabulary)
    tokenizer: str | None = None  # sha256 over the tokenizer files it trained with
    checksums: dict[str, str] = field(default_factory=dict)  # file (relative posix path) -> sha256
    format: str = STATE_FORMAT

    def to_dict(self) -> dict[str, Any]:
        return {"format": self.format, **{k: v for k, v in dataclasses.asdict(self).items() if k != "format"}}

    def get(self, key: str) -> Any:
        """The field `key` (None when the checkpoint did not record it): for tables of field names."""
        return getattr(self, key, None) if key in FIELDS else None


FIELDS = frozenset(f.name for f in dataclasses.fields(TrainerState))
_INTS = (
    "step",
    "tokens",
    "total_steps",
    "global_batch_size",
    "micro_batch_size",
    "seq_len",
    "world_size",
    "seed",
    "n_params",
)
_STRS = ("model", "optimizer", "parallel", "tokenizer", "format")
_FLOATS = ("lr", "loss", "val_loss")
_SHA = frozenset("0123456789abcdef")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    """An int or float (a diverged run records NaN or inf: what happened, kept)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_sha(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 64 and set(value) <= _SHA


def from_dict(raw: Any, where: str) -> TrainerState:
    """A TrainerState from trainer_state.json's object: every field present checked for its type and
    range (CheckpointError naming the first that is not), unknown keys ignored (newer writers)."""
    if not isinstance(raw, dict):
        raise CheckpointError(f"{where} is not a merit trainer state (not a JSON object)")

    def bad(key: str, what: str) -> CheckpointError:
        return CheckpointError(f"{where}: {key} is {_short(raw[key])}, expected {what}; the trainer state was altered")

    values: dict[str, Any] = {}
    if "step" not in raw:
        raise CheckpointError(f"{where} is not a merit trainer state (no step)")
    for key in _INTS:
        if raw.get(key) is not None:
            if not _is_int(raw[key]) or raw[key] < 0:
                raise bad(key, "a non-negative integer")
            values[key] = raw[key]
    if values.get("step") is None:
        raise bad("step", "a non-negative integer")
    for key in _STRS:
        if raw.get(key) is not None:
            if not isinstance(raw[key], str):
                raise bad(key, "a string")
            values[key] = raw[key]
    for key in _FLOATS:
        if raw.get(key) is not None:
            if not _is_real(raw[key]):
                raise bad(key, "a number")
            values[key] = float(raw[key])  # a diverged loss may be recorded as NaN: kept, it is what happened
    logits = raw.get("max_attention_logit")
    if logits is not None:
        if not isinstance(logits, list) or not all(v is None or _is_real(v) for v in logits):
            raise bad("max_attention_logit", "a list of numbers")
        values["max_attention_logit"] = [None if v is None else float(v) for v in logits]
    if raw.get("data") is not None:
        if not isinstance(raw["data"], dict):
            raise bad("data", "an object")
        values["data"] = raw["data"]
    sums = raw.get("checksums")
    if sums is not None:
        if not isinstance(sums, dict) or not all(isinstance(k, str) and _is_sha(v) for k, v in sums.items()):
            raise bad("checksums", "an object of file name -> sha256")
        for name in sums:
            _check_member(name, where)
        values["checksums"] = dict(sums)
    return TrainerState(**values)


def _short(value: Any) -> str:
    text = json.dumps(value, allow_nan=True) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _check_member(name: str, where: str) -> None:
    """CheckpointError unless `name` is a relative path inside the checkpoint folder."""
    parts = name.split("/")
    if not name or name.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\\" in name or "\0" in name:
        raise CheckpointError(f"{where}: checksums names {name!r}, which is not a file inside the checkpoint")


def _canonical(raw: dict[str, Any]) -> bytes:
    body = {k: v for k, v in raw.items() if k != SELF_KEY}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=True).encode()


def _read_raw(folder: Path) -> dict[str, Any]:
    path = folder / STATE_JSON
    try:
        with open_regular(path) as fh:  # a FIFO (which would block the read forever) is refused
            data = fh.read(MAX_STATE_BYTES + 1)
    except FileNotFoundError:
        raise CheckpointError(f"{display(folder)} is not a merit checkpoint (no {STATE_JSON})") from None
    except OSError as exc:
        raise CheckpointError(f"cannot read {display(path)}: {exc.strerror or exc}") from None
    if len(data) > MAX_STATE_BYTES:
        raise CheckpointError(f"{display(path)} is larger than {MAX_STATE_BYTES} bytes; it is not a trainer state")
    try:
        raw = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{display(path)} is unreadable: {str(exc)[:120]}") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{display(path)} is not a merit trainer state (not a JSON object)")
    return raw


def read_trainer_state(folder: str | Path, *, verify: bool = True) -> TrainerState:
    """The checkpoint folder's trainer_state.json, checked: CheckpointError when it is missing,
    unreadable, altered (its own checksum differs; not checked without `verify`) or a field has the
    wrong type."""
    folder = Path(folder)
    raw = _read_raw(folder)
    where = display(folder / STATE_JSON)
    recorded = raw.get(SELF_KEY)
    if (
        verify
        and recorded is not None
        and (not _is_sha(recorded) or hashlib.sha256(_canonical(raw)).hexdigest() != recorded)
    ):
        raise CheckpointError(f"{where} was altered since it was written (its checksum differs); refused")
    return from_dict(raw, where)


def has_trainer_state(folder: str | Path) -> bool:
    return os.path.lexists(Path(folder) / STATE_JSON)


def optional_trainer_state(folder: str | Path, *, strict: bool = True) -> TrainerState | None:
    """The trainer state of a folder that may not be a merit checkpoint: None without trainer_state.json;
    with `strict` False also None for one that is unreadable (metadata others only display)."""
    if not has_trainer_state(folder):
        return None
    try:
        return read_trainer_state(folder)
    except CheckpointError:
        if strict:
            raise
        return None


# -- checksums ---------------------------------------------------------------------------------
def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open_regular(path) as fh:
        while chunk := fh.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def checksum_files(folder: str | Path) -> dict[str, str]:
    """sha256 of every regular file in a checkpoint folder being written (subfolders included, as
    fsdp's optimizer/ shards), except trainer_state.json itself and the staging marker."""
    folder = Path(folder)
    found: dict[str, str] = {}
    for root, dirs, files in os.walk(folder):  # os.walk does not follow links into other folders
        dirs.sort()
        for name in sorted(files):
            path = Path(root) / name
            rel = path.relative_to(folder).as_posix()
            if rel in (STATE_JSON, STAGING_MARKER) or path.is_symlink() or not path.is_file():
                continue
            found[rel] = file_sha256(path)
    return found


def write_trainer_state(folder: str | Path, state: TrainerState) -> Path:
    """Write `state` as the folder's trainer_state.json, with the sha256 of every other file the folder
    holds now (write it last) and its own checksum. Returns the state as written."""
    folder = Path(folder)
    state = dataclasses.replace(state, checksums=checksum_files(folder))
    raw = state.to_dict()
    raw[SELF_KEY] = hashlib.sha256(_canonical(raw)).hexdigest()
    path = folder / STATE_JSON
    atomic_write(path, json.dumps(raw, indent=2, allow_nan=True) + "\n")
    return path


def verify_checkpoint(folder: str | Path, state: TrainerState | None = None) -> str | None:
    """Check every file trainer_state.json records against its sha256 (and the file's own checksum).

    CheckpointError in one line naming the first file that is missing or differs, or for a
    trainer_state.json that is unreadable or altered; returns NOT_VERIFIED when it records no
    checksums (written before they were), else None. A folder without trainer_state.json (not a
    merit checkpoint: nothing recorded) gives None."""
    folder = Path(folder)
    if state is None:
        if not has_trainer_state(folder):
            return None
        state = read_trainer_state(folder)
    if not state.checksums:
        return NOT_VERIFIED
    for name, expected in sorted(state.checksums.items()):
        path = folder / name
        try:
            actual = file_sha256(path)
        except FileNotFoundError:
            raise CheckpointError(
                f"{display(path)} is missing: the checkpoint's trainer_state.json records it"
            ) from None
        except (OSError, CheckpointError) as exc:
            raise CheckpointError(f"cannot verify {display(path)}: {str(exc)[:160]}") from None
        if actual != expected:
            raise CheckpointError(
                f"{display(path)} differs from the checksum its checkpoint recorded (corrupted or altered since "
                "it was written); pass --no-verify to use it anyway"
            )
    return None
