"""Tokenizers for prepared data: a byte-level BPE trained on the corpus, or a pretrained one.

Either way the result is a transformers fast tokenizer with eos, bos and pad set (bos and pad
fall back to eos), so that it can be saved with a checkpoint and loaded by AutoTokenizer.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable, Iterator
from itertools import chain
from pathlib import Path

import numpy as np

from merit_core.data.meta import TOKENIZER_DIR, is_prepared, load_meta
from merit_core.durable_writes import atomic_write_json
from merit_core.errors import ConfigError
from merit_core.hub import looks_like_hub_id, prefer_offline

EOS_TOKEN = "<|endoftext|>"
MIN_BPE_VOCAB = 257  # the 256 byte symbols plus the end-of-text token
MAX_VOCAB = 2**32 - 1
TOKENIZER_CONFIG = "tokenizer_config.json"
# transformers 5 saves a tokenizer.json-backed tokenizer as "TokenizersBackend", a class that
# transformers 4.x does not have; "PreTrainedTokenizerFast" names the same thing in both.
PORTABLE_TOKENIZER_CLASS = "PreTrainedTokenizerFast"
_V5_ONLY_TOKENIZER_CLASSES = ("TokenizersBackend",)


def save_tokenizer(tok, folder: str | Path) -> None:
    """`tok.save_pretrained(folder)` in the form both transformers 4.5x and 5.x load."""
    tok.save_pretrained(str(folder))
    make_tokenizer_portable(folder)


def make_tokenizer_portable(folder: str | Path) -> None:
    """Rewrite a saved tokenizer's class to one transformers 4.x knows, when transformers 5 wrote its own.

    Only `tokenizer_class` changes, and only from a transformers-5-only name; the file is replaced
    atomically. A folder without tokenizer_config.json is left alone.
    """
    path = Path(folder) / TOKENIZER_CONFIG
    if not path.is_file():
        return
    config = json.loads(path.read_text(encoding="utf-8"))
    if config.get("tokenizer_class") not in _V5_ONLY_TOKENIZER_CLASSES:
        return
    config["tokenizer_class"] = PORTABLE_TOKENIZER_CLASS
    atomic_write_json(path, config, indent=2, ensure_ascii=False)


@contextlib.contextmanager
def rust_parallelism():
    """Let `tokenizers` use all cores for a batch call, whatever TOKENIZERS_PARALLELISM says outside it.

    The variable is restored afterwards; since it is then set, a later fork (DataLoader workers)
    quietly turns parallelism off in the child instead of warning.
    """
    key = "TOKENIZERS_PARALLELISM"
    previous = os.environ.get(key)
    os.environ[key] = "true"
    try:
        yield
    finally:
        os.environ[key] = previous if previous is not None else "false"


def train_bpe(texts: Iterable[str], vocab_size: int):
    """A byte-level BPE with `vocab_size` entries (fewer if the text is small), EOS = '<|endoftext|>'."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    with rust_parallelism():
        backend.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        clean_up_tokenization_spaces=False,
    )


def load_local_tokenizer(path: str | Path):
    """AutoTokenizer.from_pretrained on a local folder, errors as ConfigError."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"cannot load tokenizer from {path}: {str(exc).splitlines()[0]}") from None


def load_tokenizer(path: str | Path):
    """The transformers tokenizer saved in a prepared-data folder."""
    return load_local_tokenizer(load_meta(path).tokenizer_path)


def tokenizer_identity(tokenizer: str | None, vocab_size: int) -> str:
    """A string naming the tokenizer choice; a local tokenizer folder adds its newest file time."""
    if tokenizer is None:
        return f"bpe:{vocab_size}"
    path = Path(tokenizer).expanduser()
    if path.exists():
        stamp = max((p.stat().st_mtime_ns for p in path.rglob("*") if p.is_file()), default=0)
        return f"path:{path.resolve()}:{stamp}"
    return f"hub:{tokenizer}"


def load_pretrained_tokenizer(spec: str):
    """A tokenizer from a local folder (or prepared-data folder) or a hub name, ready for corpus use."""
    path = Path(spec).expanduser()
    if path.exists():
        tok = load_local_tokenizer(path / TOKENIZER_DIR if is_prepared(path) else path)
    elif looks_like_hub_id(spec):
        offline = prefer_offline()
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(spec, trust_remote_code=False)
        except (OSError, ValueError, TypeError, KeyError) as exc:
            if offline:
                raise ConfigError(
                    f"tokenizer {spec!r} is not available offline (the Hugging Face hub cannot be reached "
                    "and it is not cached); give a local tokenizer folder or omit --tokenizer to train a BPE"
                ) from None
            raise ConfigError(f"cannot load tokenizer {spec!r}: {str(exc).splitlines()[0]}") from None
    else:
        raise ConfigError(f"tokenizer not found: {spec}")
    return finish_tokenizer(tok, spec)


def finish_tokenizer(tok, name: str):
    """Check that `tok` is a fast tokenizer with an EOS token; default bos and pad to eos."""
    if getattr(tok, "backend_tokenizer", None) is None:
        raise ConfigError(f"tokenizer {name!r} has no fast (Rust) implementation; use a tokenizer.json-based one")
    if tok.eos_token_id is None:
        raise ConfigError(f"tokenizer {name!r} has no end-of-text (eos) token")
    if tok.bos_token is None:
        tok.bos_token = tok.eos_token
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def encode_documents(tok, texts: list[str], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of `texts`, each followed by EOS, as one flat array; plus each document's length.

    Special-token text inside a document ('<|endoftext|>' written out) is encoded as plain text,
    so that EOS only ever marks a document boundary.
    """
    backend = tok.backend_tokenizer
    eos = tok.eos_token_id
    previous = backend.encode_special_tokens
    backend.encode_special_tokens = True
    try:
        with rust_parallelism():
            encodings = backend.encode_batch_fast(texts, add_special_tokens=False)
    finally:
        backend.encode_special_tokens = previous
    id_lists = [e.ids for e in encodings]
    lengths = np.fromiter((len(ids) + 1 for ids in id_lists), dtype=np.int64, count=len(id_lists))
    flat = np.fromiter(chain.from_iterable(_with_eos(id_lists, eos)), dtype=dtype, count=int(lengths.sum()))
    return flat, lengths


def _with_eos(id_lists: list[list[int]], eos: int) -> Iterator[list[int]]:
    tail = [eos]
    for ids in id_lists:
        yield ids
        yield tail
