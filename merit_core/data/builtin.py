"""The built-in corpus: docstrings of the installed Python standard library, prepared once and cached.

Every machine with Python has this text, so `merit train` works offline with no data. The
docstrings are read with `ast` from the source files (nothing is imported); the test suites,
idlelib, lib2to3 and site-packages are skipped, as are docstrings of 40 characters or fewer.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import os
import sys
import sysconfig
import warnings
from pathlib import Path

from merit_core.data.meta import FORMAT, is_prepared
from merit_core.data.prepare import batched, check_vocab_size, prepare_documents
from merit_core.data.publish import build_lock
from merit_core.data.tokenizer import tokenizer_identity
from merit_core.paths import cache_dir
from merit_core.progress import Progress, ProgressFn
from merit_core.settings import VOCAB_SIZE

SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"})
BUILTIN_VAL_FRACTION = 0.02  # ~1.6 MB corpus: 2% keeps the validation loss steady
_DOC_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def stdlib_dir() -> Path:
    """The folder holding the pure-Python standard library of the running interpreter."""
    return Path(sysconfig.get_paths()["stdlib"])


def _stdlib_files(root: Path) -> list[Path]:
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("."))
        files.extend(Path(dirpath, f) for f in sorted(filenames) if f.endswith(".py"))
    return files


def _file_docstrings(path: Path, min_chars: int) -> list[str]:
    try:
        with warnings.catch_warnings():  # old escape sequences in a few modules
            warnings.simplefilter("ignore")
            tree = ast.parse(path.read_bytes(), filename=str(path))
    except (SyntaxError, ValueError, OSError):
        return []
    docs = []
    for node in ast.walk(tree):
        if isinstance(node, _DOC_NODES):
            doc = ast.get_docstring(node, clean=True)
            if doc and len(doc) > min_chars:
                docs.append(doc)
    return docs


def builtin_corpus_documents(min_chars: int = 40) -> tuple[str, ...]:
    """Distinct stdlib docstrings longer than `min_chars`, in a fixed order (one document each).

    Gathered once per process, then served from memory.
    """
    return _gather(int(min_chars))


@functools.lru_cache(maxsize=4)
def _gather(min_chars: int) -> tuple[str, ...]:
    seen: set[str] = set()
    docs: list[str] = []
    for path in _stdlib_files(stdlib_dir()):
        for doc in _file_docstrings(path, min_chars):
            if doc not in seen:
                seen.add(doc)
                docs.append(doc)
    return tuple(docs)


def builtin_corpus_text(min_chars: int = 40) -> str:
    """The built-in corpus as one string: the documents separated by blank lines."""
    return "\n\n".join(builtin_corpus_documents(min_chars))


def builtin_key(vocab_size: int, tokenizer: str | None = None) -> str:
    """Cache-folder name of the prepared built-in corpus for this Python and tokenizer."""
    version = ".".join(map(str, sys.version_info[:3]))
    if tokenizer is None:
        return f"builtin-stdlib-py{version}-bpe{vocab_size}-{FORMAT}"
    digest = hashlib.sha256(tokenizer_identity(tokenizer, vocab_size).encode()).hexdigest()[:16]
    return f"builtin-stdlib-py{version}-tok{digest}-{FORMAT}"


def prepare_builtin(
    out_dir: str | Path,
    *,
    tokenizer: str | None = None,
    vocab_size: int = VOCAB_SIZE,
    val_fraction: float = BUILTIN_VAL_FRACTION,
    seed: int = 0,
    progress: ProgressFn | None = None,
):
    """Prepare the built-in corpus into `out_dir` (see `prepare_documents`); returns its DataMeta."""
    if progress is not None:
        progress(Progress("gathering stdlib docstrings"))
    docs = builtin_corpus_documents()
    return prepare_documents(
        lambda: batched(docs),
        out_dir,
        source=f"builtin: Python {sys.version.split()[0]} stdlib docstrings ({stdlib_dir()})",
        tokenizer=tokenizer,
        vocab_size=vocab_size,
        val_fraction=val_fraction,
        seed=seed,
        total=sum(map(len, docs)),
        progress=progress,
    )


def builtin_data(
    vocab_size: int = VOCAB_SIZE, *, tokenizer: str | None = None, progress: ProgressFn | None = None
) -> Path:
    """The prepared built-in corpus, built on first use and then cached in the user cache folder.

    With `tokenizer` None it uses a byte-level BPE of `vocab_size` trained on the corpus;
    otherwise the given hub or local tokenizer.
    """
    check_vocab_size(vocab_size)
    target = cache_dir("data") / builtin_key(vocab_size, tokenizer)
    if not is_prepared(target):
        with build_lock(target):
            if not is_prepared(target):  # another process may have built it while we waited
                prepare_builtin(target, tokenizer=tokenizer, vocab_size=vocab_size, progress=progress)
    return target
