"""Where documents come from: local .txt/.jsonl/.json/.parquet files or folders, or a hub dataset.

Everything is read through `datasets` in streaming mode (constant memory, no Arrow cache copy).
A .txt file holds one document per blank-line-separated block (paragraph), so a single large
text file still yields many documents to split into train and validation. JSON lines, JSON and
Parquet files hold one document per row, in the `text_column` column. Documents are stripped
of surrounding whitespace; empty ones are skipped.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from merit_core.errors import DataError, first_line
from merit_core.hub import looks_like_hub_id, prefer_offline

BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
SUPPORTED = ", ".join(BUILDERS)
BATCH = 1000


@dataclass
class Source:
    """A resolved corpus source: a set of local files or a hub dataset."""

    name: str  # absolute path, or the dataset name
    files: list[Path] = field(default_factory=list)  # empty for a hub dataset
    text_column: str = "text"
    dataset_config: str | None = None
    split: str = "train"

    @property
    def is_hub(self) -> bool:
        return not self.files

    @property
    def total_bytes(self) -> int | None:
        return sum(f.stat().st_size for f in self.files) if self.files else None

    def identity(self) -> str:
        """A string that changes whenever the source's content may have changed (path, size, mtime)."""
        if self.is_hub:
            parts = [f"hub:{self.name}:{self.dataset_config}:{self.split}"]
        else:
            parts = [self.name] + [f"{f}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in self.files]
        parts.append(f"column={self.text_column}")
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()

    def batches(self) -> Iterator[tuple[list[str], int]]:
        """Lists of documents, each with how many input bytes (estimated) it covers."""
        if self.is_hub:
            yield from _hub_batches(self)
        else:
            yield from _file_batches(self)


def resolve_source(
    source: str, *, text_column: str = "text", dataset_config: str | None = None, split: str = "train"
) -> Source:
    """Turn a path or dataset name into a Source; DataError if it does not exist or is not text."""
    path = Path(source).expanduser()

    def resolved(name: str, files: list[Path]) -> Source:
        return Source(name, files, text_column=text_column, dataset_config=dataset_config, split=split)

    if path.is_file():
        if path.suffix.lower() not in BUILDERS:
            raise DataError(f"unsupported data file {path}: expected one of {SUPPORTED}")
        return resolved(str(path.resolve()), [path.resolve()])
    if path.is_dir():
        files = sorted(
            p.resolve()
            for p in path.rglob("*")
            if p.is_file()
            and p.suffix.lower() in BUILDERS
            and not any(s.startswith(".") for s in p.relative_to(path).parts)
        )
        if not files:
            raise DataError(f"no {SUPPORTED} files in folder {path}")
        return resolved(str(path.resolve()), files)
    if path.exists():
        raise DataError(f"data path {path} is neither a file nor a folder")
    if looks_like_hub_id(source):
        if prefer_offline():
            raise DataError(
                f"dataset {source!r} is not available: it is not a local path and the Hugging Face hub cannot "
                "be reached (offline); use a local .txt/.jsonl/.parquet file or folder, or --data builtin (the built-in corpus)"
            )
        return resolved(source, [])
    raise DataError(f"data path not found: {source}")


@contextlib.contextmanager
def _quiet_datasets():
    logger = logging.getLogger("datasets")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _texts(batch: dict, source: Source, where: str) -> list[str]:
    if source.text_column not in batch:
        columns = ", ".join(batch) or "none"
        raise DataError(f"no column {source.text_column!r} in {where} (columns: {columns}); pass --text-column")
    docs = []
    for value in batch[source.text_column]:
        if value is None:
            continue
        if not isinstance(value, str):
            raise DataError(f"column {source.text_column!r} in {where} holds {type(value).__name__}, not text")
        value = value.strip()
        if value:
            docs.append(value)
    return docs


def _file_batches(source: Source) -> Iterator[tuple[list[str], int]]:
    import datasets

    groups: dict[str, list[Path]] = {}
    for f in source.files:
        groups.setdefault(BUILDERS[f.suffix.lower()], []).append(f)
    for builder, files in groups.items():
        kwargs = {"sample_by": "paragraph"} if builder == "text" else {}
        bytes_per_row = None
        where = files[0] if len(files) == 1 else f"{len(files)} {builder} files in {source.name}"
        try:
            if builder == "parquet":  # compressed: spread the file size over its rows
                import pyarrow.parquet as pq

                rows = sum(pq.ParquetFile(f).metadata.num_rows for f in files)
                bytes_per_row = sum(f.stat().st_size for f in files) / max(rows, 1)
            with _quiet_datasets():
                ds = datasets.load_dataset(
                    builder, data_files=[str(f) for f in files], split="train", streaming=True, **kwargs
                )
                for batch in ds.iter(batch_size=BATCH):
                    docs = _texts(batch, source, str(where))
                    rows = len(next(iter(batch.values()), []))
                    size = rows * bytes_per_row if bytes_per_row else sum(len(d) for d in docs)
                    yield docs, int(size)
        except UnicodeDecodeError:
            raise DataError(f"cannot read {where}: not UTF-8 text") from None
        except (ValueError, OSError, datasets.exceptions.DatasetGenerationError) as exc:
            raise DataError(f"cannot read {where}: {first_line(exc)}") from None


def _hub_batches(source: Source) -> Iterator[tuple[list[str], int]]:
    name = source.name
    import datasets

    try:
        with _quiet_datasets():
            ds = datasets.load_dataset(name, source.dataset_config, split=source.split, streaming=True)
            for batch in ds.iter(batch_size=BATCH):
                docs = _texts(batch, source, f"dataset {name!r}")
                yield docs, len(docs)
    except ConnectionError as exc:
        raise DataError(f"dataset {name!r} cannot be reached on the Hugging Face hub: {first_line(exc)}") from None
    except (ValueError, OSError, datasets.exceptions.DatasetNotFoundError) as exc:
        raise DataError(f"cannot load dataset {name!r}: {first_line(exc)}") from None
