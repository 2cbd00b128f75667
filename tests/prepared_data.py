"""A small prepared-data folder (merit-tokens-v1) for fast training tests.

Synthetic but learnable text (sentences from a tiny grammar) is tokenized by a byte-level BPE
trained on it with `tokenizers`, written as uint16 train.bin / val.bin with meta.json and the
tokenizer saved in Hugging Face format, exactly the layout `merit prepare` produces.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np

SUBJECTS = ["the cat", "a dog", "my friend", "the old man", "a small bird", "the teacher", "every child"]
VERBS = ["sees", "likes", "follows", "finds", "watches", "helps", "calls"]
OBJECTS = ["the ball", "a red car", "the garden", "a tall tree", "the river", "an open door", "the moon"]
ENDINGS = ["today", "at night", "again", "slowly", "with joy", "in the rain", "every morning"]


def synthetic_text(n_sentences: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    return " ".join(
        f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(ENDINGS)}."
        for _ in range(n_sentences)
    )


def write_prepared(folder: str | Path, n_sentences: int = 3000, vocab_size: int = 320, seed: int = 0) -> Path:
    """Write a prepared folder and return its path (about 30k train tokens with the defaults)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    text = synthetic_text(n_sentences, seed)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([text], trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>", unk_token="<|endoftext|>"
    )
    hf.save_pretrained(folder / "tokenizer")
    ids = np.asarray(tok.encode(text).ids, dtype=np.uint16)
    split = int(len(ids) * 0.9)
    ids[:split].tofile(folder / "train.bin")
    ids[split:].tofile(folder / "val.bin")
    meta = {
        "format": "merit-tokens-v1",
        "dtype": "uint16",
        "vocab_size": tok.get_vocab_size(),
        "eos_token_id": tok.token_to_id("<|endoftext|>"),
        "train_tokens": split,
        "val_tokens": len(ids) - split,
        "tokenizer": "tokenizer",
        "source": "synthetic test text",
        "documents": 1,
    }
    (folder / "meta.json").write_text(json.dumps(meta, indent=2))
    return folder


TINY_GPT2 = {
    "model_type": "gpt2",
    "n_layer": 2,
    "n_embd": 32,
    "n_head": 4,
    "n_positions": 64,
    "vocab_size": 320,
    "resid_pdrop": 0.0,
    "embd_pdrop": 0.0,
    "attn_pdrop": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 0,
}


def write_tiny_model_config(folder: str | Path, **changes) -> Path:
    """A 2-layer, 32-dim GPT-2 config.json (context 64) for fast tests."""
    path = Path(folder) / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**TINY_GPT2, **changes}))
    return path
