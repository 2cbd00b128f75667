"""Training data: corpus sources -> tokenizer -> memmapped train/val token files; the built-in corpus.

The prepared-data folder format is described in `merit_core.data.meta`.
"""

from merit_core.data.builtin import builtin_corpus_documents, builtin_corpus_text, builtin_data, prepare_builtin
from merit_core.data.data_folder import resolve_data
from merit_core.data.meta import (
    FORMAT,
    DataMeta,
    dtype_for_vocab,
    is_prepared,
    load_meta,
    open_tokens,
)
from merit_core.data.prepare import prepare_corpus, prepare_documents
from merit_core.data.tokenizer import load_tokenizer

__all__ = [
    "FORMAT",
    "DataMeta",
    "builtin_corpus_documents",
    "builtin_corpus_text",
    "builtin_data",
    "dtype_for_vocab",
    "is_prepared",
    "load_meta",
    "load_tokenizer",
    "open_tokens",
    "prepare_builtin",
    "prepare_corpus",
    "prepare_documents",
    "resolve_data",
]
