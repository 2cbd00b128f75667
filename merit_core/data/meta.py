"""The prepared-data folder: meta.json, train.bin / val.bin token streams and the tokenizer.

Layout (format "merit-tokens-v1")::

    meta.json      DataMeta fields (see below) plus extra information
    train.bin      flat token ids, dtype from meta.json, every document followed by EOS
    val.bin        same, for the held-out documents
    tokenizer/     a Hugging Face tokenizer (save_pretrained), with eos/bos/pad set
    .merit-prepared   merit's mark on a folder it prepared (the merit version and format), so
                      that re-preparing replaces merit's entries and never a folder of the user's
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np

from merit_core.errors import DataError, MeritError
from merit_core.file_reading import display, read_head
from merit_core.version import __version__

FORMAT = "merit-tokens-v1"
META_FILE = "meta.json"
TOKENIZER_DIR = "tokenizer"
SPLITS = ("train", "val")
PREPARED_MARKER = ".merit-prepared"
# The entries `merit prepare` writes into a folder; anything else there is the user's and is kept.
MARKER_LIMIT = 4 * 1024  # bytes of PREPARED_MARKER read: merit writes well under 200
META_LIMIT = 16 * 2**20  # bytes of meta.json read: merit writes about one kilobyte
PREPARED_ENTRIES = frozenset({META_FILE, TOKENIZER_DIR, PREPARED_MARKER, *(f"{split}.bin" for split in SPLITS)})


def dtype_for_vocab(vocab_size: int) -> str:
    """'uint16' when every id fits in 16 bits, else 'uint32'."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


@dataclass(frozen=True)
class DataMeta:
    """What meta.json says about a prepared-data folder, plus where the folder is."""

    format: str
    dtype: str
    vocab_size: int
    eos_token_id: int
    train_tokens: int
    val_tokens: int
    tokenizer: str
    source: str
    documents: int
    path: Path
    extra: dict = field(default_factory=dict)  # every other meta.json key (seed, timings, ...)

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(self.dtype)

    @property
    def tokenizer_path(self) -> Path:
        return self.path / self.tokenizer

    def split_path(self, split: str) -> Path:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        return self.path / f"{split}.bin"

    def to_json(self) -> dict:
        """The meta.json content: the fixed fields first, then the extras."""
        record = {k: v for k, v in asdict(self).items() if k not in ("path", "extra")}
        return {**record, **self.extra}


_FIELDS = {f.name: f.type for f in fields(DataMeta) if f.name not in ("path", "extra")}
_INT_FIELDS = ("vocab_size", "eos_token_id", "train_tokens", "val_tokens", "documents")


SMALL_VAL_TOKENS = 4096  # fewer held-out tokens than this: a validation loss over a handful of sequences


def data_notes(meta: DataMeta, planned_tokens: int | None = None) -> list[str]:
    """What a user should know about prepared data before trusting a run on it (one line each): a
    validation split so small that the validation loss is noisy, and, given the tokens a run will
    train on, that it repeats the training split several times."""
    notes = []
    if meta.val_tokens < SMALL_VAL_TOKENS:
        notes.append(
            f"only {meta.val_tokens:,} validation tokens are held out: the validation loss averages a few "
            f"sequences and is noisy; prepare with a larger --val-fraction for a steadier one"
        )
    if planned_tokens and meta.train_tokens and planned_tokens > 1.5 * meta.train_tokens:
        epochs = planned_tokens / meta.train_tokens
        notes.append(
            f"this run trains on {planned_tokens:,} tokens, {epochs:.1f} epochs over the {meta.train_tokens:,} "
            "training tokens: repeated text is memorised, so watch the validation loss (or use more data)"
        )
    return notes


def is_prepared(path: str | Path) -> bool:
    """True when `path` is a folder with a meta.json (a prepared-data folder, maybe corrupt)."""
    return Path(path, META_FILE).is_file()


def marker_text() -> str:
    """What `merit prepare` writes into PREPARED_MARKER: the merit version and the data format."""
    return json.dumps({"written_by": f"merit {__version__}", "format": FORMAT}) + "\n"


def is_merit_prepared(path: str | Path) -> bool:
    """True when `path` carries merit's own mark (a regular PREPARED_MARKER file naming a merit data
    format): the only evidence that lets `merit prepare` replace what is there. A meta.json alone
    is not: a user's folder may hold one."""
    marker = Path(path, PREPARED_MARKER)
    if marker.is_symlink() or not marker.is_file():
        return False
    try:
        head = read_head(marker, MARKER_LIMIT)
        if len(head) > MARKER_LIMIT:
            return False
        raw = json.loads(head)
    except (OSError, ValueError, MeritError):  # unreadable, not JSON, or not a regular file
        return False
    return isinstance(raw, dict) and str(raw.get("format", "")).startswith("merit-tokens-")


def load_meta(path: str | Path) -> DataMeta:
    """Read and check the meta.json of a prepared-data folder; DataError if missing or corrupt."""
    path = Path(path).expanduser()
    meta_file = path / META_FILE
    if not path.exists():
        raise DataError(f"data path not found: {path}")
    if not meta_file.is_file():
        raise DataError(f"{path} is not a prepared data folder (no {META_FILE}); run `merit prepare` on it first")
    try:
        head = read_head(meta_file, META_LIMIT)
        if len(head) > META_LIMIT:
            raise DataError(f"corrupt {display(meta_file)}: larger than {META_LIMIT // 2**20} MiB")
        raw = json.loads(head.decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"corrupt {display(meta_file)}: {exc}") from None
    except MeritError as exc:  # a FIFO or device named meta.json
        raise DataError(str(exc)) from None
    if not isinstance(raw, dict):
        raise DataError(f"corrupt {meta_file}: expected a JSON object")
    missing = [k for k in _FIELDS if k not in raw]
    if missing:
        raise DataError(f"corrupt {meta_file}: missing {', '.join(missing)}")
    if raw["format"] != FORMAT:
        raise DataError(f"{meta_file} has format {raw['format']!r}, expected {FORMAT!r}; prepare the data again")
    if raw["dtype"] not in ("uint16", "uint32") or not all(
        isinstance(raw[k], int) and raw[k] >= 0 for k in _INT_FIELDS
    ):
        raise DataError(f"corrupt {meta_file}: bad dtype or token counts")
    known = {k: raw[k] for k in _FIELDS}
    extra = {k: v for k, v in raw.items() if k not in _FIELDS}
    return DataMeta(**known, path=path, extra=extra)


def open_tokens(path: str | Path, split: str = "train") -> np.memmap:
    """The token ids of one split ('train' or 'val') as a read-only 1-D memmap."""
    meta = load_meta(path)
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}; use 'train' or 'val'")
    file = meta.split_path(split)
    expected = meta.train_tokens if split == "train" else meta.val_tokens
    itemsize = meta.np_dtype.itemsize
    if not file.is_file() or file.stat().st_size != expected * itemsize:
        raise DataError(f"corrupt prepared data in {meta.path}: {file.name} does not hold {expected} tokens")
    if expected == 0:
        raise DataError(f"prepared data in {meta.path} has no {split} tokens; prepare it again")
    return np.memmap(file, dtype=meta.np_dtype, mode="r", shape=(expected,))
