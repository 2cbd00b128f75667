"""Names and paths from users and files reach the terminal as text, and valid odd inputs just work.

Every name merit prints goes through merit_core.errors.printable (control characters and
non-UTF-8 bytes as escapes) and, where rich reads markup, merit_cli.render.shown: a tensor named
ESC[2J must not clear the screen, a folder named `[/bold]` must not crash rich. Also here: the
other inputs of the same families that are valid and must succeed (an empty 2-D tensor, a
non-finite weight in --json, a config.json without token ids, a huge sparse marker, a prepare
refused while another holds the folder).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from merit_cli.main import cli
from merit_core.data.meta import PREPARED_MARKER
from merit_core.data.publish import lock_path
from merit_core.errors import one_line, printable
from merit_core.file_locks import FileLock
from tests.family_checks import HOSTILE_NAMES, assert_no_raw_controls
from tests.prepared_data import TINY_GPT2

DATA_SENTENCES = 400  # the data_dir fixture (tests/conftest.py): small and quick
HOSTILE = [*HOSTILE_NAMES, "t\tab"]


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory, data_dir) -> Path:
    """A Hugging Face folder of a tiny GPT-2: config.json, model.safetensors, the data's tokenizer."""
    from transformers import GPT2Config

    from merit_core.models import build_model

    folder = tmp_path_factory.mktemp("gpt2")
    build_model(GPT2Config(**TINY_GPT2), seed=0).save_pretrained(folder)
    for item in (data_dir / "tokenizer").iterdir():
        shutil.copy(item, folder / item.name)
    return folder


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("\n\n".join(f"document {i} tells of folder {i % 7} and name {i * 13}." for i in range(300)))
    return path


def _run(args: list, code: int = 0) -> str:
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exit_code == code, f"exit {result.exit_code}: {result.output}{result.exception!r}"
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    return result.output


def _snapshot(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


def test_printable_escapes_what_a_terminal_would_act_on():
    cases = {
        "plain name.safetensors": "plain name.safetensors",
        "a\x1b[2Jb": "a\\x1b[2Jb",
        "line\nbreak": "line\\nbreak",
        "e\x9b31m": "e\\x9b31m",
        "r\u202eevil": "r\\u202eevil",
        os.fsdecode(b"w-\xff.bin"): "w-\\xff.bin",
        "caf\u00e9 \u00a0": "caf\u00e9 \u00a0",  # printable text stays as it is
        "[/bold]": "[/bold]",  # markup is rich's business: merit_cli.render.shown escapes it
    }
    for raw, expected in cases.items():
        assert printable(raw) == expected
    assert printable(b"\xfe\x1b") == "\\xfe\\x1b"


def test_tensor_names_with_markup_and_control_characters_print_as_text(gpt2, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "ckpt"
    shutil.copytree(gpt2, folder)
    weights = load_file(folder / "model.safetensors")
    for i, name in enumerate(HOSTILE):
        weights[name] = torch.full((2, 3), float(i + 1))
    save_file(weights, str(folder / "model.safetensors"))
    out = _run(["inspect", "--no-logits", folder, "--weights"])
    assert_no_raw_controls(out)
    for name in HOSTILE:
        assert printable(name) in out, name  # shown, escaped, never interpreted


@pytest.mark.parametrize("name", HOSTILE, ids=[repr(n) for n in HOSTILE])
def test_paths_with_markup_and_control_characters_in_prepare_and_inspect(gpt2, data_dir, corpus, tmp_path, name):
    out = _run(["prepare", corpus, "-o", tmp_path / f"data{name}", "--tokenizer", data_dir / "tokenizer"])
    assert_no_raw_controls(out)
    assert printable(f"data{name}") in out
    assert (tmp_path / f"data{name}" / "meta.json").is_file()
    folder = tmp_path / f"ckpt{name}"
    shutil.copytree(gpt2, folder)
    out = _run(["inspect", "--no-logits", folder, "-o", tmp_path / f"r{name}.json"])
    assert_no_raw_controls(out)
    assert f"wrote {printable(tmp_path / f'r{name}.json')}" in out
    out = _run(["eval", tmp_path / f"missing{name}", "--tasks", "lambada"], code=2)  # the red error line
    assert_no_raw_controls(out)
    assert printable(one_line(f"missing{name}")) in out and len(out.strip().splitlines()) == 1  # a tab: a space


def test_a_run_folder_named_with_markup_and_an_escape_trains(model_cfg, data_dir, tmp_path):
    run = tmp_path / "[/bold]run\x1b[2J"
    args = ["train", "--model", model_cfg, "--data", data_dir, "--seq-len", "16", "--batch-size", "2"]
    out = _run([*args, "--steps", "1", "--out", run, "--set", "eval_batches=1", "--set", "eval_batch_size=2"])
    assert_no_raw_controls(out)
    assert printable(run) in out and (run / "step_1" / "model.safetensors").is_file()


def test_a_non_utf8_source_prepares_and_prints_escaped(data_dir, corpus, tmp_path):
    source = tmp_path / os.fsdecode(b"corpus-\xff.txt")
    shutil.copy(corpus, source)
    out = _run(["prepare", source, "-o", tmp_path / "data", "--tokenizer", data_dir / "tokenizer"])
    assert "corpus-\\xff.txt" in out and (tmp_path / "data" / "train.bin").is_file()


# -- inspect: odd but valid weights ----------------------------------------------------------------
def test_an_empty_2d_tensor_is_left_out_of_the_weight_table(gpt2, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "ckpt"
    shutil.copytree(gpt2, folder)
    weights = load_file(folder / "model.safetensors")
    weights["extra.empty"], weights["extra.full"] = torch.zeros(4, 0), torch.ones(2, 2)
    save_file(weights, str(folder / "model.safetensors"))
    out = _run(["inspect", "--no-logits", folder, "--weights", "-o", tmp_path / "r.json"])
    assert "extra.full" in out and "extra.empty" not in out  # no max-norm of nothing


def test_inspect_json_writes_null_for_values_that_are_not_finite_and_says_so(gpt2, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "ckpt"
    shutil.copytree(gpt2, folder)
    weights = load_file(folder / "model.safetensors")
    weights["transformer.h.0.attn.c_attn.weight"][0, 0] = float("inf")
    weights["transformer.h.1.mlp.c_fc.weight"][1, 1] = float("nan")
    save_file(weights, str(folder / "model.safetensors"))
    out = _run(["inspect", "--no-logits", folder, "-o", tmp_path / "r.json"])
    assert "not finite" in out and "null in the JSON" in out

    def refuse(constant: str):
        raise AssertionError(f"{constant} is not JSON")

    json.loads((tmp_path / "r.json").read_text(), parse_constant=refuse)  # strict JSON: no NaN, no Infinity
    assert "null" in (tmp_path / "r.json").read_text()
    finite = _run(["inspect", "--no-logits", gpt2, "-o", tmp_path / "f.json"])
    assert "not finite" not in finite  # said only when it happened


# -- train: a config.json without token ids ------------------------------------------------------------
@pytest.mark.parametrize("ids", [None, 50256], ids=["no token ids", "GPT-2's 50256"])
def test_a_model_config_without_fitting_token_ids_gets_the_datas(model_cfg, data_dir, tmp_path, ids):
    config = json.loads(Path(model_cfg).read_text())
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        config.pop(key, None)
        if ids is not None and key != "pad_token_id":
            config[key] = ids
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(config))
    run = tmp_path / "run"
    args = ["train", "--model", cfg, "--data", data_dir, "--seq-len", "16", "--batch-size", "2", "--steps", "1"]
    _run([*args, "--out", run, "--set", "eval_batches=1", "--set", "eval_batch_size=2"])
    saved = json.loads((run / "step_1" / "config.json").read_text())
    eos = json.loads((data_dir / "meta.json").read_text())["eos_token_id"]
    assert saved["bos_token_id"] == saved["eos_token_id"] == eos < saved["vocab_size"]


# -- prepared folders: a huge sparse mark or meta.json is read through a bounded prefix ----------------
def _sparse(path: Path, size: int = 64 * 2**30) -> Path:
    with open(path, "wb") as fh:
        fh.truncate(size)
    return path


def test_a_64_gib_sparse_mark_or_meta_json_is_refused_at_once(data_dir, corpus, tmp_path, model_cfg):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    _sparse(mine / PREPARED_MARKER)
    start = time.perf_counter()
    out = _run(["prepare", corpus, "-o", mine], code=2)
    assert "refusing" in out and len(out.strip().splitlines()) == 1
    data = tmp_path / "data"
    shutil.copytree(data_dir, data)
    _sparse(data / "meta.json")
    args = ["train", "--model", model_cfg, "--data", data, "--seq-len", "16", "--steps", "1", "--out", tmp_path / "run"]
    out = _run(args, code=2)
    assert "larger than" in out and len(out.strip().splitlines()) == 1
    assert time.perf_counter() - start < 30  # read whole, either would take minutes or run out of memory
    assert (mine / PREPARED_MARKER).stat().st_size == 64 * 2**30 and (mine / "notes.txt").read_text() == "keep"


# -- prepare: one writer per folder -------------------------------------------------------------------------
def test_prepare_is_refused_in_one_line_while_another_process_holds_the_folder(data_dir, corpus, tmp_path):
    target = tmp_path / "out"
    _run(["prepare", corpus, "-o", target, "--tokenizer", data_dir / "tokenizer"])
    (target / "notes.txt").write_text("mine")
    before = _snapshot(target)
    lock = FileLock(lock_path(target))
    assert lock.acquire()
    try:
        out = _run(["prepare", corpus, "-o", target, "--tokenizer", data_dir / "tokenizer"], code=2)
    finally:
        lock.release()
    assert f"being prepared by merit process {os.getpid()}" in out and len(out.strip().splitlines()) == 1
    assert _snapshot(target) == before
    _run(["prepare", corpus, "-o", target, "--tokenizer", data_dir / "tokenizer"])  # free again: it works
    assert (target / "notes.txt").read_text() == "mine"


def test_a_staging_folder_whose_marker_holds_no_ascii_pid_is_left_alone(data_dir, corpus, tmp_path):
    side = tmp_path / ".merit-tmp-out-x1"
    side.mkdir()
    (side / ".merit-staging").write_text("²\n")
    (side / "keep.txt").write_text("not known to be merit's")
    _run(["prepare", corpus, "-o", tmp_path / "out", "--tokenizer", data_dir / "tokenizer"])
    assert (side / "keep.txt").read_text() == "not known to be merit's"


def test_a_progress_bar_shows_a_hostile_item_name_as_text():
    """On a terminal the live bars read their description as markup: a checkpoint named `[/bold]`
    would crash rich, an ESC would reach the screen."""
    import io

    from rich.console import Console

    from merit_cli.render import ProgressView
    from merit_core.progress import Progress

    buf = io.StringIO()
    out = Console(file=buf, force_terminal=True, width=120, highlight=False)
    with ProgressView(out) as view:
        view(Progress("loading model", item="[/bold]ck\x1b[2J"))
    with ProgressView(out, one_line=True) as view:
        view(Progress("scoring", item="[red]x[/red]"))
    text = buf.getvalue()
    assert "[/bold]ck\\x1b[2J" in text and "[red]x[/red]" in text and "\x1b[2J" not in text
