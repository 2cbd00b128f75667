"""`merit prepare`: tokenize a corpus into memmapped train/val token files (or the built-in corpus)."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import click
from rich.console import Console

from merit_cli.options import check_output, number_option
from merit_cli.render import ProgressView, print_key_values, shown
from merit_core.errors import ConfigError
from merit_core.settings import VOCAB_SIZE


def _summary(meta, seconds: float) -> list[tuple[str, str]]:
    """The summary's rows (merit_cli.render.print_key_values escapes and prints them, paths whole)."""
    extra = meta.extra
    documents = (
        f"{meta.documents:,} ({extra.get('train_documents', '?'):,} train, {extra.get('val_documents', '?'):,} val)"
    )
    return [
        ("source", meta.source),
        ("folder", meta.path),
        ("documents", documents),
        ("tokens train", f"{meta.train_tokens:,}"),
        ("tokens val", f"{meta.val_tokens:,}"),
        ("vocab", f"{meta.vocab_size:,} ({extra.get('tokenizer_source', meta.tokenizer)})"),
        ("dtype", meta.dtype),
        ("time", f"{seconds:.1f} s"),
    ]


@click.command("prepare", context_settings={"show_default": True})
@click.argument("source", required=False)
@click.option(
    "-o",
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    metavar="DIR",
    help="Write the prepared data into this folder (train.bin, val.bin, meta.json, tokenizer/). Required with SOURCE. A non-empty "
    "folder is refused unless merit prepared it; then merit's files are replaced and the rest kept.",
)
@click.option(
    "--builtin",
    is_flag=True,
    help="Prepare the built-in corpus (stdlib docstrings) into the merit cache, or into --out.",
)
@click.option(
    "--tokenizer",
    default=None,
    metavar="NAME|PATH",
    help="Hub tokenizer (e.g. gpt2) or local folder. Default: train a byte-level BPE on the corpus.",
)
@number_option("--vocab-size", int, default=VOCAB_SIZE, help="Vocabulary size of the trained BPE.")
@number_option(
    "--val-fraction",
    float,
    help="Share of tokens held out (whole documents) for validation. [default: 0.01; builtin 0.02]",
)
@click.option("--text-column", default="text", metavar="NAME", help="Column holding the text (.jsonl/.parquet/hub).")
@click.option("--dataset-config", default=None, help="Configuration of a hub dataset (e.g. 'en' for allenai/c4).")
@click.option("--split", default="train", help="Split of a hub dataset to read.")
@number_option("--max-documents", int, help="Read at most this many documents (for large hub datasets).")
@number_option("--seed", int, default=0, help="Seed of the validation hold-out.")
@click.option("--json", "as_json", is_flag=True, help="Print meta.json (with its path) instead of a table.")
def prepare(
    source,
    out,
    builtin,
    tokenizer,
    vocab_size,
    val_fraction,
    text_column,
    dataset_config,
    split,
    max_documents,
    seed,
    as_json,
):
    """Tokenize SOURCE (a .txt/.jsonl/.json/.parquet file or folder, or a hub dataset name) into --out.

    A .txt file holds one document per blank-line-separated block; other formats one per row.

    \b
    Examples:
      merit prepare notes.txt -o data/notes         # then: merit train --data data/notes
      merit prepare corpus/ -o data/corpus --tokenizer gpt2 --val-fraction 0.02
      merit prepare allenai/c4 --dataset-config en --max-documents 100000 -o data/c4
      merit prepare --builtin                       # the built-in corpus, into merit's cache
    """
    from merit_core.data import load_meta

    if builtin and source:
        raise ConfigError("give either SOURCE or --builtin, not both")
    if not builtin and not source:
        raise ConfigError("nothing to prepare: give a SOURCE file, folder or dataset name, or --builtin")
    if source and out is None:
        raise ConfigError("--out DIR is required: the folder to write the prepared data to")
    check_output(out, folder=True)  # before the corpus is read

    err = Console(stderr=True)
    start = time.perf_counter()
    with ProgressView(err) if not as_json else contextlib.nullcontext() as progress:
        if builtin:
            from merit_core.data.builtin import BUILTIN_VAL_FRACTION, builtin_data, prepare_builtin

            if out is None:
                path = builtin_data(vocab_size, tokenizer=tokenizer, progress=progress)
                meta = load_meta(path)
            else:
                meta = prepare_builtin(
                    out,
                    tokenizer=tokenizer,
                    vocab_size=vocab_size,
                    seed=seed,
                    val_fraction=val_fraction or BUILTIN_VAL_FRACTION,
                    progress=progress,
                )
        else:
            from merit_core.data import prepare_corpus

            meta = prepare_corpus(
                source,
                out,
                tokenizer=tokenizer,
                vocab_size=vocab_size,
                val_fraction=0.01 if val_fraction is None else val_fraction,
                seed=seed,
                progress=progress,
                text_column=text_column,
                dataset_config=dataset_config,
                split=split,
                max_documents=max_documents,
            )
    seconds = time.perf_counter() - start

    if as_json:
        click.echo(json.dumps({**meta.to_json(), "path": str(meta.path)}, indent=2))
        return
    console = Console()
    print_key_values(console, "Prepared data", _summary(meta, seconds), key_style="bold")
    from merit_core.data.meta import data_notes

    for note in data_notes(meta):
        console.print(f"[yellow]note:[/] {shown(note)}", soft_wrap=True)
    console.print(f"Train on it with: [bold]merit train --data {shown(meta.path)}[/]", soft_wrap=True)
