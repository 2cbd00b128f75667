"""merit_core.data and `merit prepare`: sources, round trip, split, atomic writes, caching, errors."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import merit_core.data.data_folder as resolve_mod
from merit_cli.main import cli
from merit_core.data import (
    DataMeta,
    builtin_corpus_documents,
    builtin_corpus_text,
    builtin_data,
    dtype_for_vocab,
    load_meta,
    load_tokenizer,
    open_tokens,
    prepare_corpus,
    resolve_data,
)
from merit_core.data.prepare import MIN_VAL_TOKENS, choose_validation
from merit_core.errors import ConfigError, DataError

VOCAB = 320
SUBJECTS = ["the optimizer", "a small model", "every row", "each column", "the learning rate", "our batch"]
VERBS = ["bounds", "scales", "clips", "tracks", "shrinks", "follows", "updates"]
OBJECTS = [
    "the largest weight",
    "its running average",
    "the attention logits",
    "a noisy gradient",
    "the update size",
    "the loss curve",
    "ünïcödé text ✓",
]


def make_docs(n: int, seed: int = 0, tag: str = "doc") -> list[str]:
    """`n` distinct documents of one to three made-up sentences."""
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        sentences = [
            f"{rng.choice(SUBJECTS).capitalize()} {rng.choice(VERBS)} {rng.choice(OBJECTS)}"
            for _ in range(rng.randint(1, 3))
        ]
        docs.append(f"{tag} {i}: " + ". ".join(sentences) + ".")
    return docs


def write_txt(path: Path, docs: list[str]) -> Path:
    path.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    return path


def split_documents(meta: DataMeta, split: str) -> list[str]:
    """Decode one split back into documents, cutting at EOS."""
    tok = load_tokenizer(meta.path)
    ids = np.asarray(open_tokens(meta.path, split))
    ends = np.flatnonzero(ids == meta.eos_token_id)
    assert ends[-1] == len(ids) - 1  # every document ends with EOS, the last one included
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [tok.decode(ids[s:e].tolist()) for s, e in zip(starts, ends)]


@pytest.fixture(scope="module")
def docs() -> list[str]:
    return make_docs(300)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, docs) -> DataMeta:
    root = tmp_path_factory.mktemp("txt")
    return prepare_corpus(str(write_txt(root / "corpus.txt", docs)), root / "out", vocab_size=VOCAB)


# ---------------------------------------------------------------- format and round trip


def test_txt_round_trip_meta_and_split(prepared, docs):
    meta = prepared
    raw = json.loads((meta.path / "meta.json").read_text())
    assert raw["format"] == "merit-tokens-v1" and raw["tokenizer"] == "tokenizer"
    assert raw["dtype"] == "uint16" and meta.np_dtype == np.uint16
    assert meta.documents == len(docs) == raw["train_documents"] + raw["val_documents"]
    assert meta.source.endswith("corpus.txt")
    tok = load_tokenizer(meta.path)
    assert meta.vocab_size == len(tok) <= VOCAB
    assert tok.eos_token_id == meta.eos_token_id and tok.bos_token is not None and tok.pad_token is not None
    for split, count in (("train", meta.train_tokens), ("val", meta.val_tokens)):
        assert (meta.path / f"{split}.bin").stat().st_size == 2 * count
        assert len(open_tokens(meta.path, split)) == count > 0
    assert int(np.asarray(open_tokens(meta.path, "train")).max()) < meta.vocab_size

    train, val = split_documents(meta, "train"), split_documents(meta, "val")
    # whole documents held out: each is in exactly one split, unchanged; train keeps corpus order
    assert sorted(train + val) == sorted(docs)
    assert train == [d for d in docs if d not in set(val)]
    assert len(val) == raw["val_documents"] >= 1
    assert meta.val_tokens >= MIN_VAL_TOKENS


def test_tokens_are_read_only_memmaps(prepared):
    tokens = open_tokens(prepared.path, "train")
    assert isinstance(tokens, np.memmap) and not tokens.flags.writeable


def test_jsonl_parquet_and_folder_sources(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    a, b, c = make_docs(120, 1, "json"), make_docs(120, 2, "parquet"), make_docs(120, 3, "text")
    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    with open(folder / "a.jsonl", "w", encoding="utf-8") as f:
        for i, d in enumerate(a):
            f.write(json.dumps({"id": i, "body": d}) + "\n")
    pq.write_table(pa.table({"body": b}), folder / "sub" / "b.parquet")
    write_txt(folder / "c.txt", c)
    (folder / "notes.md").write_text("not a corpus file")

    meta = prepare_corpus(str(folder / "a.jsonl"), tmp_path / "j", vocab_size=VOCAB, text_column="body")
    assert sorted(split_documents(meta, "train") + split_documents(meta, "val")) == sorted(a)
    meta = prepare_corpus(str(folder / "sub" / "b.parquet"), tmp_path / "p", vocab_size=VOCAB, text_column="body")
    assert sorted(split_documents(meta, "train") + split_documents(meta, "val")) == sorted(b)

    (folder / "c.txt").unlink()  # a folder of one type per column name; .md is ignored
    write_txt(folder / "sub" / "c.txt", c)
    with pytest.raises(DataError, match="no column 'body'"):
        prepare_corpus(str(folder), tmp_path / "f", vocab_size=VOCAB, text_column="body")
    (folder / "c.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in c))
    (folder / "a.jsonl").unlink()
    (folder / "sub" / "b.parquet").unlink()
    meta = prepare_corpus(str(folder), tmp_path / "f", vocab_size=VOCAB)
    assert meta.documents == 2 * len(c)  # sub/c.txt and c.jsonl
    assert sorted(split_documents(meta, "train") + split_documents(meta, "val")) == sorted(c + c)


def test_literal_eos_text_stays_inside_its_document(tmp_path, docs):
    tricky = docs[:150] + ["This docstring mentions <|endoftext|> in the middle."] + docs[150:]
    meta = prepare_corpus(str(write_txt(tmp_path / "t.txt", tricky)), tmp_path / "o", vocab_size=VOCAB)
    assert meta.documents == len(tricky)
    assert sorted(split_documents(meta, "train") + split_documents(meta, "val")) == sorted(tricky)


def test_dtype_rule_and_uint32_with_a_large_pretrained_tokenizer(tmp_path, docs):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    assert dtype_for_vocab(65536) == "uint16" and dtype_for_vocab(65537) == "uint32"
    words = sorted({w for d in docs for w in d.split()})
    vocab = {"<eos>": 0, "<unk>": 1} | {f"filler{i}": i + 2 for i in range(70_000)}
    vocab |= {w: 70_002 + i for i, w in enumerate(words)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>").save_pretrained(tmp_path / "tok")

    meta = prepare_corpus(str(write_txt(tmp_path / "c.txt", docs)), tmp_path / "o", tokenizer=str(tmp_path / "tok"))
    assert meta.dtype == "uint32" and meta.vocab_size == len(vocab) and meta.eos_token_id == 0
    ids = np.asarray(open_tokens(meta.path, "train"))
    assert ids.dtype == np.uint32 and ids.max() >= 70_002 and 1 not in ids  # every word known, no <unk>
    tok = load_tokenizer(meta.path)
    assert tok.pad_token == tok.bos_token == "<eos>"  # filled in from eos


# ---------------------------------------------------------------- validation split


def test_validation_split_is_seeded_whole_documents():
    lengths = np.random.default_rng(0).integers(5, 60, size=2000)
    a, b, c = (choose_validation(lengths, 0.05, seed, "x") for seed in (0, 0, 1))
    assert a.dtype == bool and np.array_equal(a, b) and not np.array_equal(a, c)
    held = int(lengths[a].sum())
    assert 0.05 * lengths.sum() <= held < 0.05 * lengths.sum() + 60
    tiny = np.full(3, 100)
    with pytest.raises(DataError, match="too small"):
        choose_validation(tiny, 0.01, 0, "tiny.txt")


def test_too_small_corpus_names_the_path(tmp_path):
    path = write_txt(tmp_path / "small.txt", make_docs(20))
    with pytest.raises(DataError, match=r"small\.txt is too small"):
        prepare_corpus(str(path), tmp_path / "o", vocab_size=VOCAB)
    assert not (tmp_path / "o").exists()


# ---------------------------------------------------------------- atomic writes


def test_failure_mid_way_leaves_nothing(tmp_path, docs, prepared):
    src = write_txt(tmp_path / "c.txt", docs)

    def explode(event):
        if event.stage == "tokenizing" and event.done > 0:
            raise RuntimeError("simulated crash")

    with pytest.raises(RuntimeError, match="simulated"):
        prepare_corpus(str(src), tmp_path / "out", vocab_size=VOCAB, progress=explode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.txt"]  # no target, no temp folder

    # replacing an existing prepared folder: a failure keeps the old one intact
    old = prepare_corpus(str(src), tmp_path / "out", vocab_size=VOCAB)
    before = (old.path / "meta.json").read_bytes()
    with pytest.raises(RuntimeError):
        prepare_corpus(str(src), tmp_path / "out", vocab_size=VOCAB + 40, progress=explode)
    assert (old.path / "meta.json").read_bytes() == before and load_meta(old.path).vocab_size == old.vocab_size
    new = prepare_corpus(str(src), tmp_path / "out", vocab_size=VOCAB + 40, seed=3)
    assert new.extra["seed"] == 3 and sorted(p.name for p in tmp_path.iterdir()) == ["c.txt", "out"]


def test_refuses_to_overwrite_a_folder_that_is_not_prepared_data(tmp_path, docs):
    (tmp_path / "precious").mkdir()
    (tmp_path / "precious" / "thesis.tex").write_text("keep me")
    with pytest.raises(DataError, match="refusing to overwrite"):
        prepare_corpus(str(write_txt(tmp_path / "c.txt", docs)), tmp_path / "precious", vocab_size=VOCAB)
    assert (tmp_path / "precious" / "thesis.tex").read_text() == "keep me"


# ---------------------------------------------------------------- resolve_data and its cache


def test_resolve_data_prepares_once_and_again_when_the_file_changes(tmp_path, docs, prepared, monkeypatch):
    src = write_txt(tmp_path / "c.txt", docs)
    first = resolve_data(str(src), vocab_size=VOCAB)
    assert load_meta(first).documents == len(docs) and first.parent.name == "data"

    def forbidden(*args, **kwargs):
        raise AssertionError("re-tokenized a cached source")

    monkeypatch.setattr(resolve_mod, "prepare_corpus", forbidden)
    assert resolve_data(str(src), vocab_size=VOCAB) == first
    monkeypatch.undo()

    write_txt(src, docs + make_docs(10, 9, "more"))
    second = resolve_data(str(src), vocab_size=VOCAB)
    assert second != first and load_meta(second).documents == len(docs) + 10
    assert resolve_data(str(src), vocab_size=VOCAB + 8) not in (first, second)  # the vocab is part of the key
    assert resolve_data(str(prepared.path)) == prepared.path  # a prepared folder is used as it is


def test_missing_and_bad_inputs(tmp_path):
    with pytest.raises(DataError, match="data path not found: .*nope.txt"):
        resolve_data(str(tmp_path / "nope.txt"))
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.txt").write_text("\n\n   \n\n")
    for name in ("empty.txt", "blank.txt"):
        with pytest.raises(DataError, match=rf"no text in .*{name}: the corpus is empty"):
            prepare_corpus(str(tmp_path / name), tmp_path / "o")
    (tmp_path / "img.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)))
    with pytest.raises(DataError, match="unsupported data file .*img.png"):
        prepare_corpus(str(tmp_path / "img.png"), tmp_path / "o")
    (tmp_path / "binary.txt").write_bytes(bytes(range(128, 256)) * 20)
    with pytest.raises(DataError, match="binary.txt: not UTF-8 text"):
        prepare_corpus(str(tmp_path / "binary.txt"), tmp_path / "o")
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(DataError, match="no .txt.* files in folder"):
        prepare_corpus(str(tmp_path / "empty_dir"), tmp_path / "o")
    src = write_txt(tmp_path / "ok.txt", make_docs(300))
    for bad in (0, 100, -5, 2**30):
        with pytest.raises(ConfigError, match="vocab size"):
            prepare_corpus(str(src), tmp_path / "o", vocab_size=bad)
    with pytest.raises(ConfigError, match="val fraction"):
        prepare_corpus(str(src), tmp_path / "o", val_fraction=0.7)
    with pytest.raises(ConfigError, match="tokenizer not found"):
        prepare_corpus(str(src), tmp_path / "o", tokenizer=str(tmp_path / "no_tok_dir"))
    assert not (tmp_path / "o").exists()


def test_corrupt_prepared_folder(prepared, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(prepared.path, bad)
    (bad / "meta.json").write_text("{not json")
    with pytest.raises(DataError, match="corrupt"):
        load_meta(bad)
    shutil.copy(prepared.path / "meta.json", bad / "meta.json")
    with open(bad / "val.bin", "r+b") as f:
        f.truncate(10)
    with pytest.raises(DataError, match="val.bin does not hold"):
        open_tokens(bad, "val")
    with pytest.raises(DataError, match="not a prepared data folder"):
        load_meta(tmp_path)


def test_offline_dataset_name_fails_fast():
    for name in ("openwebtext", "allenai/c4"):
        start = time.perf_counter()
        with pytest.raises(DataError, match=rf"dataset '{name}' is not available.*offline"):
            resolve_data(name)
        assert time.perf_counter() - start < 5


# ---------------------------------------------------------------- built-in corpus


@pytest.fixture(scope="session")
def builtin_docs() -> tuple[str, ...]:
    return builtin_corpus_documents()  # ~2-9 s; cached in-process, reused by builtin_data


def test_builtin_corpus_text(builtin_docs):
    text = builtin_corpus_text()
    assert len(text.encode()) > 1_000_000 and len(builtin_docs) > 3000
    assert "JSON (JavaScript Object Notation)" in text  # json/__init__.py
    assert "Heap queue algorithm (a.k.a. priority queue)." in text  # heapq.py
    assert all(len(d) > 40 for d in builtin_docs) and len(set(builtin_docs)) == len(builtin_docs)


def test_builtin_data_is_prepared_once_and_cached(builtin_docs, monkeypatch):
    path = builtin_data()
    meta = load_meta(path)
    assert meta.documents == len(builtin_docs) and meta.vocab_size == 4096 and meta.dtype == "uint16"
    assert meta.train_tokens > 300_000 and meta.val_tokens > 4000
    assert "stdlib docstrings" in meta.source
    import merit_core.data.builtin as builtin_mod

    monkeypatch.setattr(builtin_mod, "prepare_builtin", lambda *a, **k: pytest.fail("rebuilt the cache"))
    start = time.perf_counter()
    assert builtin_data() == path == resolve_data(None) == resolve_data("builtin")
    assert time.perf_counter() - start < 0.5


def test_data_builtin_names_the_built_in_corpus_and_an_empty_name_is_refused(monkeypatch, tmp_path):
    """`--data builtin` is the built-in corpus (what the errors suggest), even beside a folder of that name
    (`./builtin` is the folder); `--set data=""` is refused instead of reading the working directory."""
    import merit_core.data.data_folder as resolve_mod

    monkeypatch.setattr(resolve_mod, "builtin_data", lambda vocab_size, **kw: ("builtin", vocab_size))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "builtin").mkdir()
    assert resolve_data("builtin", vocab_size=512) == ("builtin", 512)
    with pytest.raises(DataError, match="data path .*builtin is neither|no .* files in folder"):
        resolve_data("./builtin")
    for empty in ("", "  "):
        with pytest.raises(DataError, match=r"^--data is empty; .* 'builtin' for the built-in corpus$"):
            resolve_data(empty)


# ---------------------------------------------------------------- CLI


def one_error_line(result) -> str:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    return lines[0]


def test_cli_prepare_table_and_json(tmp_path, docs):
    src = write_txt(tmp_path / "c.txt", docs)
    runner = CliRunner()
    result = runner.invoke(cli, ["prepare", str(src), "--out", str(tmp_path / "o"), "--vocab-size", str(VOCAB)])
    assert result.exit_code == 0, result.output
    for word in ("Prepared data", "documents", "tokens train", "tokens val", "uint16", f"{len(docs)} ("):
        assert word in result.stdout
    result = runner.invoke(
        cli,
        [
            "prepare",
            str(src),
            "--out",
            str(tmp_path / "o"),
            "--vocab-size",
            str(VOCAB),
            "--val-fraction",
            "0.2",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert record["documents"] == len(docs) and record["val_fraction"] == 0.2
    assert record["val_tokens"] >= 0.2 * (record["train_tokens"] + record["val_tokens"])
    assert Path(record["path"]) == (tmp_path / "o").resolve()


def test_cli_bad_inputs_are_one_line_exit_2(tmp_path):
    runner = CliRunner()
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "x.bin").write_bytes(b"\0\1\2")
    ok = write_txt(tmp_path / "ok.txt", make_docs(300))
    out = str(tmp_path / "o")
    cases = {
        "data path not found": ["prepare", str(tmp_path / "missing.txt"), "--out", out],
        "corpus is empty": ["prepare", str(tmp_path / "empty.txt"), "--out", out],
        "unsupported data file": ["prepare", str(tmp_path / "x.bin"), "--out", out],
        "vocab size must be": ["prepare", str(ok), "--out", out, "--vocab-size", "10"],
        "--vocab-size must be an integer": ["prepare", str(ok), "--out", out, "--vocab-size", "many"],
        "'openwebtext' is not available": ["prepare", "openwebtext", "--out", out],
        "--out DIR is required": ["prepare", str(ok)],
        "nothing to prepare": ["prepare"],
    }
    for expected, args in cases.items():
        assert expected in one_error_line(runner.invoke(cli, args))
    assert not (tmp_path / "o").exists()
