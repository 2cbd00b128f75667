"""Every bad input to `merit inspect` is one line on stderr and exit code 2, never a traceback or an unpickle."""

import json
import pickle
import shutil
import struct

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from merit_cli.main import cli
from merit_core.checkpoint.resolve import find_checkpoints
from merit_core.errors import CheckpointError
from tests.diagnostics.planted_models import diag_gpt2, diag_llama


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    folder = tmp_path_factory.mktemp("good") / "gpt2"
    diag_gpt2().save_pretrained(folder)
    return folder


@pytest.fixture
def no_unpickling(monkeypatch):
    """Fail the test if anything tries to unpickle."""

    def boom(*args, **kwargs):
        raise AssertionError("a checkpoint was unpickled")

    class Unpickler:
        def __init__(self, *args, **kwargs):
            boom()

    monkeypatch.setattr(pickle, "load", boom)
    monkeypatch.setattr(pickle, "loads", boom)
    monkeypatch.setattr(pickle, "Unpickler", Unpickler)
    monkeypatch.setattr(torch, "load", boom)


def _fails(args, *expected):
    res = CliRunner().invoke(cli, ["inspect", *map(str, args), "--no-logits"])
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, res.stderr
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


def _copy(good, tmp_path):
    dst = tmp_path / "ck"
    shutil.copytree(good, dst)
    return dst


def test_missing_path(tmp_path):
    _fails([tmp_path / "nope"], "not found")


def test_not_safetensors(tmp_path):
    bad = tmp_path / "model.safetensors"
    bad.write_text("hello, I am plain text and not a checkpoint at all")
    _fails([bad], "not a safetensors file")
    tiny = tmp_path / "tiny.safetensors"
    tiny.write_bytes(b"abc")
    _fails([tiny], "not a safetensors file")


def test_truncated_file(good, tmp_path):
    data = (good / "model.safetensors").read_bytes()
    cut = tmp_path / "model.safetensors"
    cut.write_bytes(data[: len(data) // 2])
    _fails([cut], "truncated")
    (n,) = struct.unpack("<Q", data[:8])
    cut.write_bytes(data[: 8 + n // 2])  # cut inside the header
    _fails([cut], "truncated")


def test_corrupt_header(good, tmp_path):
    data = bytearray((good / "model.safetensors").read_bytes())
    data[10:30] = b"#" * 20  # same length, not JSON any more
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(bytes(data))
    _fails([bad], "corrupt safetensors header")
    # valid JSON whose offsets do not fit the shape
    header = json.dumps({"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 8]}}).encode()
    bad.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 8)
    _fails([bad], "offsets")


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.safetensors"])
def test_pickle_is_refused_and_never_unpickled(tmp_path, no_unpickling, name):
    path = tmp_path / name
    torch.save({"w": torch.zeros(2, 2)}, path)  # saving is fine; loading must never happen
    line = _fails([path], "never unpickles")
    assert "pickle" in line or "torch.save" in line
    # a folder with only a .bin gets the same refusal
    _fails([tmp_path], "never unpickles")


def test_unknown_architecture(good, tmp_path):
    ck = _copy(good, tmp_path)
    config = json.loads((ck / "config.json").read_text())
    (ck / "config.json").write_text(json.dumps({**config, "model_type": "bert"}))
    _fails([ck], "unknown architecture", "bert")
    odd = tmp_path / "odd.safetensors"
    save_file({"encoder.layer.0.attention.self.query.weight": torch.zeros(4, 4)}, odd)
    _fails([odd], "unknown architecture", "encoder.layer.0.attention.self.query.weight")


@pytest.mark.parametrize(
    "key,value,expected",
    [
        ("n_embd", 64, "n_embd=64"),
        ("n_layer", 3, "n_layer=3"),
        ("n_head", 5, "5 heads"),
        ("vocab_size", 300, "vocab_size=300"),
    ],
)
def test_config_does_not_match_weights(good, tmp_path, key, value, expected):
    ck = _copy(good, tmp_path)
    config = json.loads((ck / "config.json").read_text())
    (ck / "config.json").write_text(json.dumps({**config, key: value}))
    _fails([ck], expected)


def test_config_mismatch_found_while_building_the_model(good, tmp_path):
    ck = _copy(good, tmp_path)
    config = json.loads((ck / "config.json").read_text())
    (ck / "config.json").write_text(json.dumps({**config, "n_positions": 32}))  # wpe is [64, 32]
    res = CliRunner().invoke(cli, ["inspect", str(ck), "--seq-len", "8"])
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert res.stderr.count("\n") == 1 and "transformer.wpe.weight is [64, 32]" in res.stderr


def test_llama_key_heads_mismatch(tmp_path):
    diag_llama(kv_heads=2).save_pretrained(tmp_path / "l")
    config = json.loads((tmp_path / "l" / "config.json").read_text())
    (tmp_path / "l" / "config.json").write_text(json.dumps({**config, "num_key_value_heads": 4}))
    _fails([tmp_path / "l"], "16 key features, not 4 key heads of 8")


def test_empty_folder_lists_what_it_found(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    _fails([tmp_path], "no checkpoint", "notes.txt")


def test_sharded_index_with_missing_shard(tmp_path):
    diag_gpt2().save_pretrained(tmp_path / "s", max_shard_size="20KB")
    shard = sorted((tmp_path / "s").glob("model-*.safetensors"))[0]
    shard.unlink()
    _fails([tmp_path / "s"], "missing", shard.name)


def test_conflicting_text_options_and_bad_plot_name(good, tmp_path):
    (tmp_path / "t.txt").write_text("some text")
    _fails([good, "--text", "a", "--text-file", tmp_path / "t.txt"], "not both")
    _fails([good, "--plot", tmp_path / "x.bmpx"], ".png")


def test_probe_text_file_errors(good, tmp_path):
    _fails([good, "--text-file", tmp_path / "missing.txt"], "cannot read probe text")


def test_library_raises_checkpoint_errors(tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        find_checkpoints(tmp_path / "nothing")


def test_probe_text_without_a_tokenizer_is_one_line(good):
    res = CliRunner().invoke(cli, ["inspect", str(good), "--text", "hello world"])
    assert res.exit_code == 2 and "Traceback" not in res.output
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "no tokenizer" in lines[0], res.stderr


def test_unknown_family_in_config_is_one_line(good, tmp_path):
    ck = tmp_path / "mamba"
    shutil.copytree(good, ck)
    config = json.loads((ck / "config.json").read_text())
    (ck / "config.json").write_text(json.dumps({**config, "model_type": "mamba"}))
    _fails([ck], "'mamba' is not supported", "gpt_neox")
