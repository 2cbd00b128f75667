"""`--data` as the user gives it -> a prepared-data folder (preparing and caching raw sources)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from merit_core.data.builtin import builtin_data
from merit_core.data.meta import FORMAT, is_prepared
from merit_core.data.prepare import check_vocab_size, prepare_corpus
from merit_core.data.publish import build_lock
from merit_core.data.sources import resolve_source
from merit_core.data.tokenizer import tokenizer_identity
from merit_core.errors import DataError
from merit_core.paths import cache_dir
from merit_core.progress import ProgressFn
from merit_core.settings import VOCAB_SIZE

BUILTIN = "builtin"  # `--data builtin`: the built-in corpus, as giving no --data


def cache_key(
    source: str, *, tokenizer: str | None, vocab_size: int, text_column: str = "text", dataset_config: str | None = None
) -> str:
    """Cache-folder name for a raw source: changes with the files (path, size, mtime) and the tokenizer."""
    src = resolve_source(source, text_column=text_column, dataset_config=dataset_config)
    identity = "\n".join([FORMAT, src.identity(), tokenizer_identity(tokenizer, vocab_size)])
    stem = Path(src.name).name if not src.is_hub else src.name.replace("/", "--")
    return f"{stem[:40]}-{hashlib.sha256(identity.encode()).hexdigest()[:16]}"


def resolve_data(
    data: str | None,
    *,
    tokenizer: str | None = None,
    vocab_size: int = VOCAB_SIZE,
    progress: ProgressFn | None = None,
    text_column: str = "text",
    dataset_config: str | None = None,
) -> Path:
    """None or ``builtin`` (:data:`BUILTIN`) -> the built-in corpus; a prepared folder -> itself; a raw
    file, folder or dataset name -> prepared once into the user cache (keyed by source identity,
    tokenizer and vocab size). A folder named ``builtin`` is ``./builtin``; an empty name is refused
    (it would be the working directory)."""
    check_vocab_size(vocab_size)
    if data is not None and not data.strip():
        raise DataError(f"--data is empty; give a file, folder or dataset name, or '{BUILTIN}' for the built-in corpus")
    if data is None or data == BUILTIN:
        return builtin_data(vocab_size, tokenizer=tokenizer, progress=progress)
    path = Path(data).expanduser()
    if is_prepared(path):
        return path.resolve()
    key = cache_key(
        data, tokenizer=tokenizer, vocab_size=vocab_size, text_column=text_column, dataset_config=dataset_config
    )
    target = cache_dir("data") / key
    if not is_prepared(target):
        with build_lock(target):
            if not is_prepared(target):
                prepare_corpus(
                    data,
                    target,
                    tokenizer=tokenizer,
                    vocab_size=vocab_size,
                    progress=progress,
                    text_column=text_column,
                    dataset_config=dataset_config,
                )
    return target
