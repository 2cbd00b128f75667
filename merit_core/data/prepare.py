"""Corpus -> tokenizer -> train.bin / val.bin / meta.json, written atomically.

Two streaming passes over the source: one to train the BPE (skipped for a pretrained tokenizer;
capped at `TOKENIZER_TRAIN_CHARS` characters), one to tokenize in batches into a single
temporary stream. Whole documents are then held out for validation by a seeded shuffle, and the
stream is split into train.bin and val.bin chunk by chunk, so memory stays bounded by the
per-document lengths array rather than by the corpus.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np

from merit_core.data.meta import (
    FORMAT,
    META_FILE,
    PREPARED_MARKER,
    TOKENIZER_DIR,
    DataMeta,
    dtype_for_vocab,
    load_meta,
    marker_text,
)
from merit_core.data.publish import (
    TMP_PREFIX,
    check_target,
    lock_path,
    publish,
    recover,
    staging_dir,
    writer_lock,
)
from merit_core.data.sources import resolve_source
from merit_core.data.tokenizer import (
    MIN_BPE_VOCAB,
    encode_documents,
    load_pretrained_tokenizer,
    save_tokenizer,
    train_bpe,
)
from merit_core.durable_writes import STAGING_MARKER
from merit_core.errors import ConfigError, DataError, MeritError
from merit_core.file_locks import pid_alive, remove_stale_lock
from merit_core.file_reading import read_head
from merit_core.output_checks import refuse_dangling_parents
from merit_core.progress import Progress, ProgressFn, report_to
from merit_core.settings import VOCAB_SIZE

Report = Callable[[str, int, "int | None"], None]  # report(stage, done, total): a Progress event each
Batches = Callable[[], Iterable[tuple[list[str], int]]]

MAX_VOCAB = 2**24
MIN_VAL_TOKENS = 1024  # a few sequences of a small model's context, whatever the fraction
TOKENIZER_TRAIN_CHARS = 100_000_000
SPLIT_CHUNK_TOKENS = 1 << 23


def check_vocab_size(vocab_size: int) -> None:
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not MIN_BPE_VOCAB <= vocab_size <= MAX_VOCAB:
        raise ConfigError(f"vocab size must be an integer from {MIN_BPE_VOCAB} to {MAX_VOCAB}, got {vocab_size!r}")


def check_val_fraction(val_fraction: float) -> None:
    if not isinstance(val_fraction, (int, float)) or not 0 < val_fraction < 0.5:
        raise ConfigError(f"val fraction must be between 0 and 0.5 (exclusive), got {val_fraction!r}")


def prepare_corpus(
    source: str,
    out_dir: str | Path,
    *,
    tokenizer: str | None = None,
    vocab_size: int = VOCAB_SIZE,
    val_fraction: float = 0.01,
    seed: int = 0,
    progress: ProgressFn | None = None,
    text_column: str = "text",
    dataset_config: str | None = None,
    split: str = "train",
    max_documents: int | None = None,
) -> DataMeta:
    """Prepare a local file / folder or a hub dataset into the prepared-data folder `out_dir`.

    `tokenizer` None trains a byte-level BPE of `vocab_size` on the corpus; otherwise it names a
    hub tokenizer or a local tokenizer folder (vocab_size is then ignored). `max_documents` caps
    how many documents are read (useful for large hub datasets). In a folder `merit prepare` made
    (it carries merit's mark) merit's entries are replaced and the user's other files kept; any
    other non-empty folder there is refused.
    """
    src = resolve_source(source, text_column=text_column, dataset_config=dataset_config, split=split)
    if max_documents is not None and max_documents < 2:
        raise ConfigError(f"max documents must be at least 2, got {max_documents}")

    def batches() -> Iterator[tuple[list[str], int]]:
        seen = 0
        for docs, size in src.batches():
            if max_documents is not None and seen + len(docs) >= max_documents:
                yield docs[: max_documents - seen], size
                return
            seen += len(docs)
            yield docs, size

    return prepare_documents(
        batches,
        out_dir,
        source=src.name,
        tokenizer=tokenizer,
        vocab_size=vocab_size,
        val_fraction=val_fraction,
        seed=seed,
        total=None if (src.is_hub or max_documents) else src.total_bytes,
        progress=progress,
    )


def batched(docs: Iterable[str], size: int = 1000) -> Iterator[tuple[list[str], int]]:
    """Group plain documents into (batch, characters) pairs for `prepare_documents`."""
    batch: list[str] = []
    for doc in docs:
        batch.append(doc)
        if len(batch) == size:
            yield batch, sum(map(len, batch))
            batch = []
    if batch:
        yield batch, sum(map(len, batch))


def prepare_documents(
    batches: Batches,
    out_dir: str | Path,
    *,
    source: str,
    tokenizer: str | None = None,
    vocab_size: int = VOCAB_SIZE,
    val_fraction: float = 0.01,
    seed: int = 0,
    total: int | None = None,
    progress: ProgressFn | None = None,
) -> DataMeta:
    """Prepare documents from `batches()` (called once or twice; yields (docs, input size)) into `out_dir`."""
    check_vocab_size(vocab_size)
    check_val_fraction(val_fraction)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"seed must be a non-negative integer, got {seed!r}")
    given = Path(out_dir).expanduser()
    refuse_dangling_parents(given, "output")  # resolve() would follow a link to nothing and write there
    target = given.resolve()
    check_target(target)  # refused before the lock file is made beside it
    with writer_lock(target):  # one writer of the folder at a time: a second prepare is refused
        return _prepare_locked(batches, target, source, tokenizer, vocab_size, val_fraction, seed, total, progress)


def _prepare_locked(
    batches: Batches,
    target: Path,
    source: str,
    tokenizer: str | None,
    vocab_size: int,
    val_fraction: float,
    seed: int,
    total: int | None,
    progress: ProgressFn | None,
) -> DataMeta:
    """`prepare_documents` once its writer lock on `target` is held."""
    remove_stale_temp(target)  # first: a killed re-prepare may have left the target mid-swap
    check_target(target)
    emit = report_to(progress)

    def report(stage: str, done: int, total: int | None) -> None:
        emit(Progress(stage, done, total))

    _check_two_documents(batches, source)
    start = time.perf_counter()
    with staging_dir(target) as tmp:
        (tmp / STAGING_MARKER).write_text(f"{os.getpid()}\n")  # what a later cleanup recognises as ours
        if tokenizer is None:
            tok = _train_tokenizer(batches, vocab_size, source, total, report)
            tokenizer_source = f"byte-level BPE ({vocab_size}) trained on the corpus"
        else:
            tok = load_pretrained_tokenizer(tokenizer)
            tokenizer_source = tokenizer
        vocab = len(tok)
        dtype = np.dtype(dtype_for_vocab(vocab))
        save_tokenizer(tok, tmp / TOKENIZER_DIR)

        stream = tmp / "all.bin"
        lengths, chars = _tokenize(batches, tok, dtype, stream, total, report)
        if len(lengths) == 0:
            raise DataError(f"no text in {source}: the corpus is empty")
        is_val = choose_validation(lengths, val_fraction, seed, source)
        report("splitting", 0, int(lengths.sum()))
        _split_stream(stream, lengths, is_val, dtype, tmp)
        stream.unlink()

        record = {
            "format": FORMAT,
            "dtype": dtype.name,
            "vocab_size": vocab,
            "eos_token_id": int(tok.eos_token_id),
            "train_tokens": int(lengths[~is_val].sum()),
            "val_tokens": int(lengths[is_val].sum()),
            "tokenizer": TOKENIZER_DIR,
            "source": source,
            "documents": int(len(lengths)),
            "train_documents": int((~is_val).sum()),
            "val_documents": int(is_val.sum()),
            "bos_token_id": int(tok.bos_token_id),
            "pad_token_id": int(tok.pad_token_id),
            "tokenizer_source": tokenizer_source,
            "text_characters": int(chars),
            "val_fraction": val_fraction,
            "seed": seed,
            "seconds": round(time.perf_counter() - start, 3),
            "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        }
        (tmp / META_FILE).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        (tmp / PREPARED_MARKER).write_text(marker_text(), encoding="utf-8")
        report("splitting", int(lengths.sum()), int(lengths.sum()))
        publish(tmp, target)
    return load_meta(target)


def _check_two_documents(batches: Batches, source: str) -> None:
    """DataError for a corpus of a single document, before any tokenizer is trained on it.

    Validation holds out whole documents, so one document can never be split; reading only up to
    the second document finds that in moments even when the one document is a 10 MB line (which
    the BPE trainer would otherwise chew on for minutes first)."""
    seen = 0
    for docs, _ in batches():
        seen += sum(1 for doc in docs if doc)
        if seen >= 2:
            return
    if seen == 1:
        raise DataError(
            f"corpus {source} is a single document; validation holds out whole documents, so it needs 2 or "
            "more (documents are separated by blank lines in text files, one per line/record in JSONL)"
        )


def remove_stale_temp(target: Path) -> list[Path]:
    """Delete what an interrupted prepare of `target` left beside it, and only that.

    The new or old copy of a killed publish (`.merit-tmp-<target name>-new-<pid>` / `-old-<pid>`)
    is finished or undone first (publish.recover: the user's entries go back into the target). A
    build folder counts as merit's when its name is `.merit-tmp-<target name>-...` and it holds
    the staging marker of a process that is gone; a lock file counts as stale when nobody holds it.
    """
    removed: list[Path] = []
    if not target.parent.is_dir():
        return removed
    removed += recover(target)
    prefix = f"{TMP_PREFIX}{target.name}-"
    for child in target.parent.iterdir():
        if not child.name.startswith(prefix) or not child.is_dir() or child.is_symlink():
            continue
        marker = child / STAGING_MARKER
        if not marker.is_file() or child.name.startswith((prefix + "new-", prefix + "old-")):
            continue
        pid = _read_pid(marker)
        if pid is not None and not pid_alive(pid):
            shutil.rmtree(child, ignore_errors=True)
            removed.append(child)
    if remove_stale_lock(lock_path(target)):
        removed.append(lock_path(target))
    return removed


def _read_pid(path: Path) -> int | None:
    """The PID in a staging marker (a bounded prefix of it: the file may be anything someone left)."""
    try:
        return _read_pid_text(read_head(path, 64)[:64].decode("ascii", "replace").strip())
    except (OSError, MeritError):
        return None


def _read_pid_text(text: str) -> int | None:
    return int(text) if text.isascii() and text.isdigit() else None


def _train_tokenizer(batches: Batches, vocab_size: int, source: str, total: int | None, report: Report):
    limit = TOKENIZER_TRAIN_CHARS
    shown_total = min(total, limit) if total else None
    seen = {"docs": 0, "chars": 0, "done": 0}

    def texts() -> Iterator[str]:
        for docs, size in batches():
            yield from docs
            seen["docs"] += len(docs)
            seen["chars"] += sum(map(len, docs))
            seen["done"] += size
            report("training tokenizer", min(seen["done"], shown_total or seen["done"]), shown_total)
            if seen["chars"] >= limit:
                return

    report("training tokenizer", 0, shown_total)
    tok = train_bpe(texts(), vocab_size)
    if seen["docs"] == 0:
        raise DataError(f"no text in {source}: the corpus is empty")
    return tok


def _tokenize(batches: Batches, tok, dtype: np.dtype, stream: Path, total: int | None, report: Report):
    lengths: list[np.ndarray] = []
    chars = done = 0
    report("tokenizing", 0, total)
    with open(stream, "wb") as out:
        for docs, size in batches():
            if docs:
                flat, lens = encode_documents(tok, docs, dtype)
                flat.tofile(out)
                lengths.append(lens)
                chars += sum(map(len, docs))
            done += size
            report("tokenizing", min(done, total) if total else done, total)
    return (np.concatenate(lengths) if lengths else np.zeros(0, np.int64)), chars


def choose_validation(
    lengths: np.ndarray, val_fraction: float, seed: int, source: str, min_val_tokens: int = MIN_VAL_TOKENS
) -> np.ndarray:
    """Mask of documents held out for validation: whole documents in a seeded random order, until
    the held-out tokens reach max(val_fraction of all tokens, min_val_tokens); at least one."""
    n, total = len(lengths), int(lengths.sum())
    want = max(math.ceil(val_fraction * total), min_val_tokens)
    order = np.random.default_rng(seed).permutation(n)
    taken = np.cumsum(lengths[order])
    count = int(np.searchsorted(taken, want)) + 1  # first prefix reaching `want`
    count = min(max(count, 1), n)
    val_tokens = int(taken[count - 1])
    if count >= n or total - val_tokens < want:
        raise DataError(
            f"corpus {source} is too small: {n} documents, {total} tokens; need at least "
            f"{2 * want} tokens in 2 or more documents to hold out {want} validation tokens"
        )
    mask = np.zeros(n, dtype=bool)
    mask[order[:count]] = True
    return mask


def _split_stream(stream: Path, lengths: np.ndarray, is_val: np.ndarray, dtype: np.dtype, out: Path) -> None:
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    tokens = np.memmap(stream, dtype=dtype, mode="r", shape=(int(offsets[-1]),))
    with open(out / "train.bin", "wb") as train, open(out / "val.bin", "wb") as val:
        i, n = 0, len(lengths)
        while i < n:
            j = max(int(np.searchsorted(offsets, offsets[i] + SPLIT_CHUNK_TOKENS, side="right")) - 1, i + 1)
            j = min(j, n)
            chunk = np.asarray(tokens[offsets[i] : offsets[j]])
            mask = np.repeat(is_val[i:j], lengths[i:j])
            chunk[~mask].tofile(train)
            chunk[mask].tofile(val)
            i = j
    del tokens
