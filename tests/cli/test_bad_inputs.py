"""Bad input to every subcommand: exit code 2, at most 2 lines of output, no traceback, nothing changed.

Each case builds its arguments (and any broken file it needs) in its own folder, then runs the
CLI in-process. Checked for every case: exit code 2; at most two non-empty lines on stdout and
stderr together; no "Traceback"; every file that existed before (the shared fixtures and the
case's own folder) byte-identical afterwards; the case's folder holds nothing new unless the
case says where merit may write. `expect` is a text the message must contain.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from merit_cli.main import cli
from merit_core.checkpoint import runs
from tests.cli import hostile_file_cases, reliability_cases  # noqa: F401  (importing them adds their cases to CASES)
from tests.cli.bad_input_cases import CASES, INSPECT, World
from tests.cli.hostile_file_cases import fifo, with_auto_map
from tests.prepared_data import TINY_GPT2, write_prepared, write_tiny_model_config


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    from transformers import GPT2Config

    from merit_core.models import build_model

    root = tmp_path_factory.mktemp("world")
    data = write_prepared(root / "data", n_sentences=400)
    other = write_prepared(root / "other-data", n_sentences=400, seed=1)
    cfg = write_tiny_model_config(root / "model")
    w = World(root, data, cfg, root / "run", other, root / "gpt2", root / "corpus.txt")
    result = CliRunner().invoke(cli, w.train(w.run, "--save-every", "1"))
    assert result.exit_code == 0, result.output
    model = build_model(GPT2Config(**TINY_GPT2), seed=0)
    model.save_pretrained(w.gpt2)
    for item in (data / "tokenizer").iterdir():
        shutil.copy(item, w.gpt2 / item.name)
    w.text.write_text("\n\n".join(f"document {i} says hello to the world again." for i in range(50)))
    return w


def _snapshot(*roots: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under `roots`: its sha256 and mode."""
    found = {}
    for root in roots:
        for path in sorted(root.rglob("*")):
            if path.is_file() and not path.is_symlink():
                found[str(path)] = (hashlib.sha256(path.read_bytes()).digest(), path.stat().st_mode)
    return found


@pytest.mark.parametrize(("category", "name", "build", "expect"), CASES, ids=[f"{c[0]}: {c[1]}" for c in CASES])
def test_bad_input_is_one_line_and_exit_2(world, tmp_path, monkeypatch, no_hang, category, name, build, expect):
    case = tmp_path / "case"
    case.mkdir()
    monkeypatch.chdir(case)  # default output folders (runs/...) would land here
    args = build(world, case)
    before = _snapshot(world.root, case)
    entries = sorted(p.name for p in case.iterdir())
    result = CliRunner().invoke(cli, args)
    text = result.output  # stdout and stderr, as a terminal shows them
    lines = [line for line in text.splitlines() if line.strip()]
    assert result.exit_code == 2, f"exit {result.exit_code}: {text}{result.exception!r}"
    assert "Traceback" not in text
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert len(lines) <= 2, text
    if expect:
        assert expect in text, text
    after = _snapshot(world.root, case)
    changed = [p for p, v in before.items() if after.get(p) != v]
    assert not changed, f"changed or removed: {changed}"
    assert sorted(p.name for p in case.iterdir()) == entries, "nothing new may be written"


def test_the_table_is_big_enough():
    assert len(CASES) >= 80
    counts: dict[str, int] = {}
    for category, *_ in CASES:
        counts[category.split(":")[0]] = counts.get(category.split(":")[0], 0) + 1
    assert {"train", "prepare", "inspect", "eval", "compare"} <= set(counts)


# -- hostile files that are valid: they must work, not hang or fail --------------------------------------
def _ok(args: list[str]):
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, f"{result.output}{result.exception!r}"
    assert "Traceback" not in result.output
    return result


def test_inspect_reads_float8_tensors(world, tmp_path):
    from safetensors.torch import load_file, save_file

    weights = load_file(world.gpt2 / "model.safetensors")
    weights["transformer.h.0.mlp.c_fc.weight"] = torch.full((32, 128), 2.75).to(torch.float8_e4m3fn)
    save_file(weights, str(tmp_path / "f8.safetensors"))
    result = _ok([*INSPECT, "--layers", str(tmp_path / "f8.safetensors"), "-o", str(tmp_path / "r.json")])
    assert "transformer.h.0.mlp.c_fc.weight" in result.output and "2.75" in result.output  # exact in float8


def test_inspect_and_eval_accept_a_file_name_that_is_not_utf8(world, tmp_path):
    name = os.fsdecode(b"weights-\xff.safetensors")  # a surrogate-escaped byte, as Python lists such names
    shutil.copy(world.gpt2 / "model.safetensors", tmp_path / name)
    result = _ok([*INSPECT, "--layers", str(tmp_path / name)])
    assert "transformer.h.0.attn.c_attn.weight" in result.output


def test_a_fifo_named_like_the_trainer_state_is_not_read(world, tmp_path, no_hang):
    shutil.copy(world.gpt2 / "model.safetensors", tmp_path / "model.safetensors")
    fifo(tmp_path / runs.STATE_JSON)
    result = CliRunner().invoke(cli, [*INSPECT, str(tmp_path / "model.safetensors")])  # refused unread: no hang
    assert result.exit_code == 2 and "trainer_state.json is a FIFO" in result.output, result.output
    _ok([*INSPECT, "--no-verify", str(tmp_path / "model.safetensors")])  # unverified: the FIFO is no metadata


def test_an_unreadable_step_folder_is_skipped_with_a_note(world, tmp_path, monkeypatch):
    """A step folder of mode 000: skipped (and named) when this user cannot read it; read normally by
    root, who can. The refusal is also forced for root, by failing the folder's reads with EACCES."""
    run = world.copy_run(tmp_path)
    hidden = run / "step_1"
    hidden.chmod(0)
    try:
        result = _ok(["inspect", "--no-logits", str(run), "-o", str(tmp_path / "r.json")])
        steps = [c["step"] for c in json.loads((tmp_path / "r.json").read_text())["checkpoints"]]
        if os.access(hidden, os.R_OK | os.X_OK):  # root: mode bits do not stop it
            assert steps == [1, 2]
        else:
            assert steps == [2] and "step_1" in result.output
        real_stat = os.stat

        def denied(path, *args, **kwargs):
            if str(path).startswith(str(hidden) + os.sep):
                raise PermissionError(13, "Permission denied", str(path))
            return real_stat(path, *args, **kwargs)

        monkeypatch.setattr(os, "stat", denied)
        result = _ok(["inspect", "--no-logits", str(run), "-o", str(tmp_path / "r2.json")])
        assert "skipped" in result.output and "step_1" in result.output
        result = CliRunner().invoke(cli, ["inspect", "--no-logits", str(hidden)])
        assert result.exit_code == 2 and "permission denied" in result.output, result.output
        assert len(result.output.strip().splitlines()) == 1
    finally:
        hidden.chmod(0o755)


def test_prepare_into_a_folder_it_cannot_write_is_one_line(world, tmp_path, monkeypatch):
    """Root may write anywhere, so a read-only folder is simulated twice: by os.access (the check made
    before any work) and by the file system refusing the temp folder (EROFS, as a read-only mount does)."""
    import errno
    import tempfile

    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if Path(p) == locked else real_access(p, mode, **kw))
    result = CliRunner().invoke(cli, ["prepare", str(world.text), "--out", str(locked / "o")])
    assert result.exit_code == 2 and "cannot write into" in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1 and list(locked.iterdir()) == []
    monkeypatch.undo()

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(locked))

    monkeypatch.setattr(tempfile, "mkdtemp", read_only)
    result = CliRunner().invoke(cli, ["prepare", str(world.text), "--out", str(locked / "o")])
    assert result.exit_code == 2 and "Read-only file system" in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1 and list(locked.iterdir()) == []


def test_trust_remote_code_is_an_explicit_opt_in(world, tmp_path):
    from merit_core.errors import CheckpointError
    from merit_core.evaluation.checkpoint import resolve_checkpoint

    folder = with_auto_map(world, tmp_path, "gpt2")
    with pytest.raises(CheckpointError, match="--trust-remote-code"):
        resolve_checkpoint(folder)
    assert resolve_checkpoint(folder, trust_remote_code=True).is_local  # the user asked: the check steps aside
    assert not (folder / "CODE-RAN").exists()  # and resolving alone runs nothing
    help_text = CliRunner().invoke(cli, ["eval", "--help"]).output
    assert "--trust-remote-code" in help_text
