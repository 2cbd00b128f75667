"""Corpora -> tokenizer -> memmapped token files, and the built-in corpus."""
