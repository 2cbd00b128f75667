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
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from merit_cli.main import cli
from merit_core import runs
from tests.prepared_data import TINY_GPT2, write_prepared, write_tiny_model_config

TRAIN_SETS = ["--set", "eval_batches=1", "--set", "eval_batch_size=2", "--set", "log_every=1"]


@dataclass
class World:
    root: Path
    data: Path
    model_cfg: Path
    run: Path  # a finished 2-step run (step_1, step_2), seed 0
    other_data: Path
    gpt2: Path  # a Hugging Face folder: config.json, model.safetensors, tokenizer files
    text: Path  # a small raw text corpus

    def train(self, out: Path, *extra: str) -> list[str]:
        return [
            "train",
            "--model",
            str(self.model_cfg),
            "--data",
            str(self.data),
            "--seq-len",
            "16",
            "--batch-size",
            "2",
            "--steps",
            "2",
            "--out",
            str(out),
            *TRAIN_SETS,
            *extra,
        ]

    def resume(self, run: Path, *extra: str) -> list[str]:
        return ["train", "--resume", "--out", str(run), *extra]

    def copy_run(self, case: Path) -> Path:
        dst = case / "run"
        shutil.copytree(self.run, dst)
        return dst


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


# -- helpers that write broken inputs into the case folder -----------------------------------------
def model_json(case: Path, **changes) -> str:
    return str(write_tiny_model_config(case / "m", **changes))


def user_folder(case: Path) -> Path:
    folder = case / "mine"
    folder.mkdir()
    (folder / "config.toml").write_text("# my own notes\n")
    (folder / "curves.png").write_bytes(b"not really a png")
    (folder / "metrics.jsonl").write_text('{"mine": 1}\n')
    (folder / ".tmp-keep").mkdir()
    (folder / ".tmp-keep" / "precious.txt").write_text("do not delete")
    return folder


def fake_parquet(case: Path) -> str:
    path = case / "corpus.parquet"
    path.write_text("this is not parquet at all\n")
    return str(path)


def safetensors_file(case: Path, header: dict, data: bytes = b"", name: str = "model.safetensors") -> Path:
    raw = json.dumps(header).encode()
    path = case / name
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def pickle_folder(case: Path, name: str = "pytorch_model.bin", with_config: bool = True) -> Path:
    folder = case / "pickled"
    folder.mkdir()
    torch.save({"w": torch.zeros(2)}, folder / name)
    if with_config:
        (folder / "config.json").write_text(json.dumps({**TINY_GPT2, "architectures": ["GPT2LMHeadModel"]}))
        (folder / "tokenizer.json").write_text("{}")
    return folder


def corrupt(run: Path, name: str, content: bytes | Callable[[Path], None]) -> Path:
    target = run / "step_2" / name if name != "metrics.jsonl" else run / name
    if callable(content):
        content(target)
    else:
        target.write_bytes(content)
    return run


def bad_rng(path: Path) -> None:
    state = torch.load(path, weights_only=True)
    state["rng"]["torch"] = torch.zeros(5, dtype=torch.uint8)
    torch.save(state, path)


def wrong_shape(path: Path) -> None:
    from safetensors.torch import save_file
    from transformers import GPT2Config

    from merit_core.models import build_model

    model = build_model(GPT2Config(**{**TINY_GPT2, "n_embd": 64}), seed=0)
    save_file({k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}, path)


def fs_file(case: Path) -> Path:
    path = case / "a-file"
    path.write_text("x")
    return path


# -- the cases: (category, name, build(world, case) -> args, expected text) --------------------------
CASES: list[tuple[str, str, Callable[[World, Path], list[str]], str]] = []


def case(category: str, name: str, expect: str = ""):
    def register(build):
        CASES.append((category, name, build, expect))
        return build

    return register


def add(category: str, name: str, build: Callable[[World, Path], list[str]], expect: str = "") -> None:
    CASES.append((category, name, build, expect))


# train: values
for key, value, expect in [
    ("lr", "inf", "lr must be a finite number"),
    ("lr", "nan", "lr must be a finite number"),
    ("lr", "-inf", "lr must be a finite number"),
    ("min_lr", "nan", "min_lr must be a finite number"),
    ("grad_clip", "nan", "grad_clip must be a finite number"),
    ("grad_clip", "inf", "grad_clip must be a finite number"),
    ("warmup_ratio", "nan", "warmup_ratio must be a finite number"),
    ("weight_decay", "inf", "weight_decay must be a finite number"),
    ("min_lr_ratio", "nan", "min_lr_ratio must be a finite number"),
    ("save_every_minutes", "nan", "save_every_minutes must be a finite number"),
    ("save_every_minutes", "-1", "save_every_minutes must be >= 0"),
    ("warmup_ratio", "2", "at most 1"),
    ("eval_batches", "0", "eval_batches must be positive"),
    ("eval_batch_size", "100000000", "batch sizes too large"),
    ("dtype", "float8", "dtype must be one of"),
    ("nonsense", "1", "unknown config key 'nonsense'"),
    ("optimizer_args.bogus", "1", "bogus"),
    ("log_every", "0", "log_every must be positive"),
    ("keep_checkpoints", "-1", "keep_checkpoints must be >= 0"),
    ("lr", "'fast'", "lr must be a number"),
]:
    add(
        "train: config values",
        f"{key}={value}",
        lambda w, c, k=key, v=value: w.train(c / "run", "--set", f"{k}={v}"),
        expect,
    )

for option, value, expect in [
    ("--seed", "-1", "seed must be from 0"),
    ("--lr", "0", "lr must be positive"),
    ("--lr", "-1", "lr must be positive"),
    ("--lr", "abc", "--lr must be a number"),
    ("--batch-size", "0", "batch_size must be positive"),
    ("--batch-size", "-4", "batch_size must be positive"),
    ("--batch-size", "1000000000000", "batch sizes too large"),
    ("--seq-len", "0", "seq_len must be positive"),
    ("--seq-len", "100000", "beyond the context"),
    ("--steps", "0", "steps must be positive"),
    ("--steps", "-3", "steps must be positive"),
    ("--tokens", "-1", "tokens must be positive"),
    ("--micro-batch-size", "3", "not divisible"),
    ("--optimizer", "adamx", "unknown optimizer 'adamx'"),
    ("--device", "tpu", "--device tpu: use auto, cpu, cuda or cuda:N"),
    ("--parallel", "xyz", "'xyz' is not one of"),
    ("--model", "gpt3-tiny", "unknown model"),
    ("--save-every-minutes", "soon", "--save-every-minutes must be a number"),
    ("--vocab-size", "many", "--vocab-size must be an integer"),
]:
    add("train: options", f"{option} {value}", lambda w, c, o=option, v=value: w.train(c / "run", o, v), expect)

add("train: options", "unknown option", lambda w, c: w.train(c / "run", "--bogus"), "No such option")
add("train: options", "--set without =", lambda w, c: w.train(c / "run", "--set", "lr"), "--set expects KEY=VALUE")

# train: model config.json
for name, changes in [
    ("n_head 0", {"n_head": 0}),
    ("n_head -4", {"n_head": -4}),
    ("n_head 'x'", {"n_head": "x"}),
    ("n_head not dividing n_embd", {"n_head": 5}),
    ("unknown activation", {"activation_function": "wiggle"}),
    ("n_positions 1e11", {"n_positions": 100_000_000_000}),
    ("n_layer 0", {"n_layer": 0}),
    ("unknown model_type", {"model_type": "frobnet"}),
]:
    add("train: model config", name, lambda w, c, ch=changes: w.train(c / "run", "--model", model_json(c, **ch)))
add(
    "train: model config",
    "config.json not JSON",
    lambda w, c: (c / "bad.json").write_text("{nope") and w.train(c / "run", "--model", str(c / "bad.json")),
)
add("train: model config", "model path is a folder", lambda w, c: w.train(c / "run", "--model", str(c)))

# train: config file
add("train: config file", "config is a folder", lambda w, c: ["train", str(c)], "is a folder")
add("train: config file", "config missing", lambda w, c: ["train", str(c / "none.toml")], "config file not found")
add(
    "train: config file",
    "config not TOML",
    lambda w, c: (c / "x.toml").write_text("lr = = 3") and ["train", str(c / "x.toml")],
    "not valid TOML",
)
add(
    "train: config file",
    "config binary",
    lambda w, c: (c / "x.toml").write_bytes(b"\xff\xfe\x00") and ["train", str(c / "x.toml")],
)

# train: --out
add("train: --out", "--out is a file", lambda w, c: w.train(fs_file(c)), "not a folder")
add("train: --out", "--out folder of user files", lambda w, c: w.train(user_folder(c)), "not a merit run")
add("train: --out", "--out under a file", lambda w, c: w.train(fs_file(c) / "run"), "not a folder")
add(
    "train: --out",
    "--out is the current folder with user files",
    lambda w, c: (user_folder(c), w.train(c / "mine"))[1],
    "not a merit run",
)
add("train: --out", "finished run without --resume", lambda w, c: w.train(w.copy_run(c)), "already holds checkpoints")

# train: data
add("train: data", "missing data", lambda w, c: w.train(c / "run", "--data", str(c / "none.txt")), "none.txt")
add("train: data", "fake parquet", lambda w, c: w.train(c / "run", "--data", fake_parquet(c)), "parquet")


def _meta_changed(w: World, c: Path, **changes) -> list[str]:
    folder = c / "data"
    shutil.copytree(w.data, folder)
    meta = json.loads((folder / "meta.json").read_text())
    (folder / "meta.json").write_text(json.dumps({**meta, **changes}))
    return w.train(c / "run", "--data", str(folder))


add("train: data", "prepared data: ids beyond vocab", lambda w, c: _meta_changed(w, c, vocab_size=50), "token id")
add("train: data", "prepared data: wrong token count", lambda w, c: _meta_changed(w, c, train_tokens=10**9), "corrupt")
add("train: data", "prepared data: bad dtype", lambda w, c: _meta_changed(w, c, dtype="float64"), "corrupt")
add("train: data", "prepared data: bad format", lambda w, c: _meta_changed(w, c, format="v0"), "format")
add(
    "train: data",
    "prepared data: meta.json not JSON",
    lambda w, c: (
        shutil.copytree(w.data, c / "d"),
        (c / "d" / "meta.json").write_text("{"),
        w.train(c / "run", "--data", str(c / "d")),
    )[2],
    "corrupt",
)
add(
    "train: data",
    "vocab size too small",
    lambda w, c: w.train(c / "run", "--data", str(w.text), "--vocab-size", "5"),
    "vocab size",
)

# train: resume
add("train: resume", "--resume without --out", lambda w, c: ["train", "--resume"], "--resume needs the run folder")
add("train: resume", "nothing to resume", lambda w, c: w.train(c / "run", "--resume"), "nothing to resume")
add(
    "train: resume",
    "--resume-from a missing step",
    lambda w, c: w.resume(w.copy_run(c), "--resume-from", "step_9"),
    "step_9",
)
add("train: resume", "changed seed", lambda w, c: w.resume(w.copy_run(c), "--seed", "7"), "another seed")
add(
    "train: resume",
    "changed data",
    lambda w, c: w.resume(w.copy_run(c), "--data", str(w.other_data)),
    "another data",
)
add("train: resume", "changed optimizer", lambda w, c: w.resume(w.copy_run(c), "--optimizer", "adamw"), "optimizer")
add(
    "train: resume",
    "changed batch size",
    lambda w, c: w.resume(w.copy_run(c), "--batch-size", "4"),
    "global_batch_size",
)
add(
    "train: resume",
    "wrong-shaped model.safetensors",
    lambda w, c: w.resume(only_last(w, c, "model.safetensors", wrong_shape)),
    "does not match the model",
)
add(
    "train: resume",
    "empty trainer_state.pt",
    lambda w, c: w.resume(only_last(w, c, "trainer_state.pt", b"")),
    "cannot be loaded safely",
)
add(
    "train: resume",
    "bad RNG state",
    lambda w, c: w.resume(only_last(w, c, "trainer_state.pt", bad_rng)),
    "trainer state",
)
add(
    "train: resume",
    "trainer_state.json garbage",
    lambda w, c: w.resume(only_last(w, c, "trainer_state.json", b"\x00\x01garbage")),
    "unreadable",
)
add(
    "train: resume",
    "binary metrics.jsonl",
    lambda w, c: w.resume(corrupt(w.copy_run(c), "metrics.jsonl", bytes(range(256)) * 4)),
    "metrics.jsonl",
)


def only_last(w: World, c: Path, name: str, content) -> Path:
    """A copy of the run with only step_2, whose `name` is broken (no older checkpoint to fall back to)."""
    run = w.copy_run(c)
    for _, path in runs.checkpoints(run)[:-1]:
        shutil.rmtree(path)
    return corrupt(run, name, content)


# prepare
add("prepare", "no source", lambda w, c: ["prepare"], "nothing to prepare")
add("prepare", "source and --builtin", lambda w, c: ["prepare", str(w.text), "--builtin"], "not both")
add("prepare", "no --out", lambda w, c: ["prepare", str(w.text)], "--out DIR is required")
add("prepare", "missing source", lambda w, c: ["prepare", str(c / "none.txt"), "--out", str(c / "o")], "none.txt")
add("prepare", "fake parquet", lambda w, c: ["prepare", fake_parquet(c), "--out", str(c / "o")], "parquet")
add(
    "prepare",
    "vocab too small",
    lambda w, c: ["prepare", str(w.text), "--out", str(c / "o"), "--vocab-size", "10"],
    "vocab size",
)
add(
    "prepare",
    "vocab not a number",
    lambda w, c: ["prepare", str(w.text), "--out", str(c / "o"), "--vocab-size", "x"],
    "integer",
)
add(
    "prepare",
    "val fraction 0.7",
    lambda w, c: ["prepare", str(w.text), "--out", str(c / "o"), "--val-fraction", "0.7"],
    "val fraction",
)
add(
    "prepare",
    "val fraction -1",
    lambda w, c: ["prepare", str(w.text), "--out", str(c / "o"), "--val-fraction", "-1"],
    "val fraction",
)
add("prepare", "--out is a file", lambda w, c: ["prepare", str(w.text), "--out", str(fs_file(c))], "is a file")
add(
    "prepare",
    "--out folder of user files",
    lambda w, c: ["prepare", str(w.text), "--out", str(user_folder(c))],
    "refusing",
)
add(
    "prepare",
    "--max-documents 1",
    lambda w, c: ["prepare", str(w.text), "--out", str(c / "o"), "--max-documents", "1"],
    "max documents",
)
add(
    "prepare",
    "empty text file",
    lambda w, c: (c / "e.txt").write_text("") == 0 and ["prepare", str(c / "e.txt"), "--out", str(c / "o")],
    "empty",
)
add("prepare", "unknown option", lambda w, c: ["prepare", "--frob"], "No such option")
add("prepare", "--seed -1", lambda w, c: ["prepare", str(w.text), "--out", str(c / "o"), "--seed", "-1"], "seed")
add(
    "prepare",
    "folder without text files",
    lambda w, c: (c / "empty-dir").mkdir() or ["prepare", str(c / "empty-dir"), "--out", str(c / "o")],
)
add(
    "prepare",
    "jsonl without the text column",
    lambda w, c: (
        (c / "d.jsonl").write_text('{"body": "hi"}\n') and ["prepare", str(c / "d.jsonl"), "--out", str(c / "o")]
    ),
    "text",
)

# inspect
INSPECT = ["inspect", "--no-logits"]
add("inspect", "missing path", lambda w, c: [*INSPECT, str(c / "none")], "not found")
add("inspect", "pickle .bin", lambda w, c: [*INSPECT, str(pickle_folder(c) / "pytorch_model.bin")], "never unpickles")
add("inspect", "pickle .pt", lambda w, c: [*INSPECT, str(pickle_folder(c, "model.pt") / "model.pt")], "never unpickles")
add("inspect", "folder of pickle weights", lambda w, c: [*INSPECT, str(pickle_folder(c))], "never unpickles")
add("inspect", "empty folder", lambda w, c: (c / "e").mkdir() or [*INSPECT, str(c / "e")], "no checkpoint")
add(
    "inspect",
    "truncated safetensors",
    lambda w, c: [
        *INSPECT,
        str(safetensors_file(c, {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 4)),
    ],
    "truncated",
)
add(
    "inspect",
    "string data_offsets",
    lambda w, c: [
        *INSPECT,
        str(safetensors_file(c, {"w": {"dtype": "F32", "shape": [1], "data_offsets": ["0", "4"]}}, b"\0" * 4)),
    ],
    "corrupt",
)
add(
    "inspect",
    "header not JSON",
    lambda w, c: (
        (c / "x.safetensors").write_bytes(struct.pack("<Q", 4) + b"{{{{"),
        [*INSPECT, str(c / "x.safetensors")],
    )[1],
    "corrupt",
)
add(
    "inspect",
    "unknown dtype",
    lambda w, c: [
        *INSPECT,
        str(safetensors_file(c, {"w": {"dtype": "Q7", "shape": [1], "data_offsets": [0, 1]}}, b"\0")),
    ],
    "corrupt",
)
add("inspect", "--json is a folder", lambda w, c: [*INSPECT, str(w.gpt2), "--json", str(c)], "is a directory")
add(
    "inspect",
    "--json under a file",
    lambda w, c: [*INSPECT, str(w.gpt2), "--json", str(fs_file(c) / "r.json")],
    "not a folder",
)
add(
    "inspect",
    "--plot under a file",
    lambda w, c: [*INSPECT, str(w.gpt2), "--plot", str(fs_file(c) / "p.png")],
    "not a folder",
)
add("inspect", "--plot bad suffix", lambda w, c: [*INSPECT, str(w.gpt2), "--plot", str(c / "p.txt")], "--plot")
add("inspect", "--text empty", lambda w, c: ["inspect", str(w.gpt2), "--text", "  "], "--text is empty")
add(
    "inspect",
    "--text and --text-file",
    lambda w, c: ["inspect", str(w.gpt2), "--text", "a", "--text-file", str(w.text)],
    "not both",
)
add("inspect", "--seq-len 1", lambda w, c: ["inspect", str(w.gpt2), "--seq-len", "1"], "--seq-len")
add("inspect", "--heads 0", lambda w, c: [*INSPECT, str(w.gpt2), "--heads", "0"], "--heads")
add(
    "inspect",
    "run folder with incomplete steps only",
    lambda w, c: (c / "r" / "step_3").mkdir(parents=True) or [*INSPECT, str(c / "r")],
    "no checkpoint",
)
add(
    "inspect",
    "index without weight_map",
    lambda w, c: (
        (c / "model.safetensors.index.json").write_text("{}"),
        [*INSPECT, str(c / "model.safetensors.index.json")],
    )[1],
    "weight_map",
)

# eval
add("eval", "no checkpoint", lambda w, c: ["eval", "--tasks", "lambada"], "no checkpoint given")
add("eval", "no tasks", lambda w, c: ["eval", str(w.gpt2)], "no task given")
add("eval", "missing checkpoint", lambda w, c: ["eval", str(c / "none"), "--tasks", "lambada"], "not found")
add("eval", "checkpoint is a file", lambda w, c: ["eval", str(fs_file(c)), "--tasks", "lambada"], "is a file")
add("eval", "pickle weights", lambda w, c: ["eval", str(pickle_folder(c)), "--tasks", "lambada"], "never unpickles")
add(
    "eval",
    "pickle .pth weights",
    lambda w, c: ["eval", str(pickle_folder(c, "model.pth")), "--tasks", "lambada"],
    "never unpickles",
)
add(
    "eval",
    "run folder without steps",
    lambda w, c: (c / "r").mkdir() or ["eval", str(c / "r"), "--tasks", "lambada"],
    "step_N",
)
add(
    "eval",
    "--output under a file",
    lambda w, c: ["eval", str(w.gpt2), "--tasks", "lambada", "-o", str(fs_file(c) / "r.json")],
    "--output",
)
add("eval", "--device tpu", lambda w, c: ["eval", str(w.gpt2), "--tasks", "lambada", "--device", "tpu"], "--device")
add("eval", "--dtype int8", lambda w, c: ["eval", str(w.gpt2), "--tasks", "lambada", "--dtype", "int8"], "dtype")
add("eval", "--limit abc", lambda w, c: ["eval", str(w.gpt2), "--tasks", "lambada", "--limit", "abc"], "--limit")
add(
    "eval", "--batch-size foo", lambda w, c: ["eval", str(w.gpt2), "--tasks", "lambada", "--batch-size", "foo"], "batch"
)
add("eval", "unknown option", lambda w, c: ["eval", "--frob"], "No such option")

# compare
COMPARE = ["compare", "--quick"]
add("compare", "--seq-len 0", lambda w, c: [*COMPARE, "--seq-len", "0", "--out", str(c / "o")], "seq_len")
add("compare", "--tokens -5", lambda w, c: [*COMPARE, "--tokens", "-5", "--out", str(c / "o")], "tokens")
add("compare", "unknown optimizer", lambda w, c: [*COMPARE, "--optimizers", "nope", "--out", str(c / "o")], "nope")
add("compare", "--batch-sizes abc", lambda w, c: [*COMPARE, "--batch-sizes", "abc", "--out", str(c / "o")], "abc")
add("compare", "--lrs abc", lambda w, c: [*COMPARE, "--lrs", "abc", "--out", str(c / "o")], "abc")
add("compare", "--jobs 0", lambda w, c: [*COMPARE, "--jobs", "0", "--out", str(c / "o")], "jobs")
add("compare", "config missing", lambda w, c: ["compare", str(c / "none.toml")], "not found")
add("compare", "--set unknown key", lambda w, c: [*COMPARE, "--set", "lrr=1", "--out", str(c / "o")], "lrr")
add("compare", "unknown model", lambda w, c: [*COMPARE, "--model", "gpt3-tiny", "--out", str(c / "o")], "gpt3-tiny")
add("compare", "--set lr=nan", lambda w, c: [*COMPARE, "--set", "grad_clip=nan", "--out", str(c / "o")], "grad_clip")
add("compare", "unknown option", lambda w, c: ["compare", "--frob"], "No such option")


# -- hostile files: code, pickles, FIFOs, absurd sizes -----------------------------------------------
def fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def model_copy(w: World, c: Path, name: str = "m") -> Path:
    """A copy of the Hugging Face folder (config, model.safetensors, tokenizer) to spoil."""
    folder = c / name
    shutil.copytree(w.gpt2, folder)
    return folder


def with_auto_map(w: World, c: Path, model_type: str = "evil") -> Path:
    """A model folder whose config.json maps the Auto classes to evil.py, which would leave a file if run."""
    folder = model_copy(w, c)
    (folder / "evil.py").write_text(
        "from pathlib import Path\nPath(__file__).with_name('CODE-RAN').write_text('pwned')\n"
        "from transformers import GPT2Config as EvilConfig, GPT2LMHeadModel as EvilModel\n"
    )
    config = json.loads((folder / "config.json").read_text())
    config.update(
        model_type=model_type,
        auto_map={"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"},
    )
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def index_to(w: World, c: Path, shard: str, make_shard: bool = True) -> Path:
    """A model folder whose model.safetensors is replaced by an index mapping every tensor to `shard`."""
    from safetensors.torch import load_file

    folder = model_copy(w, c)
    weights = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    if make_shard:
        torch.save(weights, folder / shard)
    index = {"metadata": {}, "weight_map": dict.fromkeys(weights, shard)}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


def weights_file(w: World, c: Path, data: bytes) -> Path:
    folder = model_copy(w, c)
    raw = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data if data != b"half" else raw[: len(raw) // 2])
    return folder


def index_values(c: Path, value) -> Path:
    safetensors_file(c, {"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4)
    path = c / "model.safetensors.index.json"
    path.write_text(json.dumps({"weight_map": {"w": value}}))
    return path


EVAL = ["--tasks", "lambada"]
add("eval", "auto_map to local code", lambda w, c: ["eval", str(with_auto_map(w, c)), *EVAL], "--trust-remote-code")
add(
    "eval",
    "auto_map on a known model_type",
    lambda w, c: ["eval", str(with_auto_map(w, c, "gpt2")), *EVAL],
    "auto_map",
)
add(
    "eval",
    "index mapping every tensor to pytorch_model.bin",
    lambda w, c: ["eval", str(index_to(w, c, "pytorch_model.bin")), *EVAL],
    "never unpickles",
)
add(
    "eval",
    "index mapping to a pickle named .safetensors",
    lambda w, c: ["eval", str(index_to(w, c, "shard.safetensors")), *EVAL],
    "never unpickles",
)
add(
    "eval",
    "index mapping outside the folder",
    lambda w, c: ["eval", str(index_to(w, c, "../gpt2/model.safetensors", make_shard=False)), *EVAL],
    "not a shard file name",
)
add("eval", "0-byte model.safetensors", lambda w, c: ["eval", str(weights_file(w, c, b"")), *EVAL], "only 0 bytes")
add("eval", "truncated model.safetensors", lambda w, c: ["eval", str(weights_file(w, c, b"half")), *EVAL], "truncated")
add(
    "eval",
    "config.json is a FIFO",
    lambda w, c: (
        (model_copy(w, c) / "config.json").unlink(),
        fifo(c / "m" / "config.json"),
        ["eval", str(c / "m"), *EVAL],
    )[2],
    "FIFO",
)
add(
    "eval",
    "tokenizer.json is a FIFO",
    lambda w, c: (
        (model_copy(w, c) / "tokenizer.json").unlink(),
        fifo(c / "m" / "tokenizer.json"),
        ["eval", str(c / "m"), *EVAL],
    )[2],
    "FIFO",
)
add("inspect", "checkpoint is a FIFO", lambda w, c: [*INSPECT, str(fifo(c / "model.safetensors"))], "FIFO")
add(
    "inspect",
    "model.safetensors in a folder is a FIFO",
    lambda w, c: ((c / "m").mkdir(), fifo(c / "m" / "model.safetensors"), [*INSPECT, str(c / "m")])[2],
    "FIFO",
)
add(
    "inspect",
    "--text-file is a FIFO",
    lambda w, c: ["inspect", str(w.gpt2), "--text-file", str(fifo(c / "probe.txt"))],
    "FIFO",
)
add("inspect", "weight_map value a number", lambda w, c: [*INSPECT, str(index_values(c, 5))], "weight_map value 5")
add("inspect", "weight_map value null", lambda w, c: [*INSPECT, str(index_values(c, None))], "weight_map value None")
add(
    "inspect",
    "weight_map value a path outside",
    lambda w, c: [*INSPECT, str(index_values(c, "/etc/passwd"))],
    "not a shard file name",
)
add(
    "inspect",
    "index.json is a FIFO",
    lambda w, c: [*INSPECT, str(fifo(c / "model.safetensors.index.json"))],
    "FIFO",
)
for name, changes, expect in [
    ("n_embd 2^20", {"n_embd": 2**20, "n_head": 4}, "too large"),
    ("vocab 2^40", {"vocab_size": 2**40}, "too large"),
    ("n_inner -5", {"n_inner": -5}, "MLP width must be a positive integer"),
    ("n_layer 10^9", {"n_layer": 10**9}, "too large"),
    ("n_inner 2.5", {"n_inner": 2.5}, "n_inner"),
]:
    add(
        "train: model config", name, lambda w, c, ch=changes: w.train(c / "run", "--model", model_json(c, **ch)), expect
    )
    add(
        "inspect",
        f"checkpoint config {name}",
        lambda w, c, ch=changes: (
            model_copy(w, c),
            (c / "m" / "config.json").write_text(json.dumps({**TINY_GPT2, **ch})),
            ["inspect", str(c / "m"), "--seq-len", "8"],
        )[2],
    )  # refused as too large, or as not matching the weights: one line either way
add(
    "prepare",
    "--out under a FIFO",
    lambda w, c: ["prepare", str(w.text), "--out", str(fifo(c / "pipe") / "o")],
    "not a folder",
)
add(
    "prepare",
    "source is a FIFO",
    lambda w, c: ["prepare", str(fifo(c / "corpus.txt")), "--out", str(c / "o")],
    "neither a file nor a folder",
)
add(
    "prepare",
    "a single 10 MB line",
    lambda w, c: (
        (c / "line.txt").write_text("the cat sees the moon " * 460_000 + "\n"),
        ["prepare", str(c / "line.txt"), "--out", str(c / "o")],
    )[1],
    "single document",
)
add(
    "train: data",
    "a single 10 MB line",
    lambda w, c: (
        (c / "line.txt").write_text("the cat sees the moon " * 460_000 + "\n"),
        w.train(c / "run", "--data", str(c / "line.txt")),
    )[1],
    "single document",
)
add("compare", "--out is a file", lambda w, c: [*COMPARE, "--out", str(fs_file(c))], "not a folder")
add(
    "compare",
    "--out folder of user files",
    lambda w, c: [*COMPARE, "--out", str(user_folder(c))],
    "not a merit comparison",
)


def compare_with_link(case: Path, where: str) -> Path:
    """A comparison folder with a symbolic link planted at `where` (pointing at a user's folder or
    file, which must stay untouched)."""
    out, mine = case / "cmp", case / "mine"
    (out / "logs").mkdir(parents=True)
    mine.mkdir()
    (mine / "notes.txt").write_text("mine\n")
    if where == "logs":
        (out / "logs").rmdir()
        (out / "logs").symlink_to(mine)
    elif where == "runs":
        (out / "runs").symlink_to(mine)
    else:
        (out / "logs" / where).symlink_to(mine / "notes.txt")
    return out


for where in ("logs", "runs", "gpt2-tiny_merit_b8_lr0.001.log"):
    add(
        "compare",
        f"--out with {where} a planted link",
        lambda w, c, where=where: [*COMPARE, "--out", str(compare_with_link(c, where))],
        "symbolic link",
    )
add(
    "train: resume",
    "metrics.jsonl line is a number",
    lambda w, c: w.resume(corrupt(w.copy_run(c), "metrics.jsonl", b'{"step": 1, "tokens": 32, "loss": 5.0}\n42\n')),
    "metrics.jsonl",
)
add(
    "train: resume",
    "metrics.jsonl line is a list",
    lambda w, c: w.resume(corrupt(w.copy_run(c), "metrics.jsonl", b'[1, 2]\n{"step": 1, "tokens": 32}\n')),
    "metrics.jsonl",
)
add(
    "train: resume",
    "metrics.jsonl step not an integer",
    lambda w, c: w.resume(corrupt(w.copy_run(c), "metrics.jsonl", b'{"step": "two"}\n')),
    "metrics.jsonl",
)


def wrong_moment(path: Path) -> None:
    state = torch.load(path, weights_only=True)
    moments = state["optimizer"]["state"]
    first = next(iter(moments))
    moments[first]["exp_avg"] = torch.zeros(3, 3)
    torch.save(state, path)


add(
    "train: resume",
    "exp_avg of the wrong shape",
    lambda w, c: w.resume(only_last(w, c, "trainer_state.pt", wrong_moment)),
    "exp_avg",
)


# -- a shared run folder someone prepared to hurt its next user -----------------------------------------
def victim_file(c: Path) -> Path:
    victim = c / "victim.txt"
    victim.write_text("precious, and not merit's\n")
    victim.chmod(0o600)
    return victim


def victim_dir(c: Path) -> Path:
    folder = c / "victim"
    folder.mkdir()
    (folder / "secret.txt").write_text("private")
    (folder / "secret.txt").chmod(0o600)  # merit must never chmod it to the umask's 0644
    return folder


def planted(w: World, c: Path, name: str, target: Path | str) -> Path:
    """A copy of the finished run with a symbolic link `name` -> `target` planted in it."""
    run = w.copy_run(c)
    if os.path.lexists(run / name):
        path = run / name
        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    os.symlink(target, run / name)
    return run


def marked_folder(c: Path, name: str, target: Path | str) -> Path:
    """An otherwise empty folder holding a run marker (anyone can write one) and a planted link."""
    folder = c / "shared"
    folder.mkdir()
    (folder / runs.RUN_MARKER).write_text('{"format": "merit-run-v1"}\n')
    os.symlink(target, folder / name)
    return folder


for name, what, target in [
    (runs.LOCK_FILE, "a victim file", victim_file),
    (runs.LOCK_FILE, "a missing file", lambda c: c / "made-through-the-link.txt"),  # O_CREAT would make it
    (f"{runs.TMP_PREFIX}step_3", "a victim folder", victim_dir),
    (f"{runs.TMP_PREFIX}old-step_2", "a victim folder", victim_dir),
    (runs.METRICS_FILE, "a victim file", victim_file),
    (runs.CONFIG_FILE, "a victim file", victim_file),
    (runs.CURVES_FILE, "a victim file", victim_file),
    ("step_2", "a victim folder", victim_dir),
]:
    add(
        "train: planted links",
        f"resume with {name} -> {what}",
        lambda w, c, n=name, t=target: w.resume(planted(w, c, n, t(c))),
        "symbolic link",
    )
    add(
        "train: planted links",
        f"new run in a marked folder with {name} -> {what}",
        lambda w, c, n=name, t=target: w.train(marked_folder(c, n, t(c))),
        "symbolic link",
    )
add(
    "train: planted links",
    "lock file is a folder",
    lambda w, c: ((w.copy_run(c) / runs.LOCK_FILE).mkdir(), w.resume(c / "run"))[1],
    "is a folder",
)
add(
    "train: planted links",
    "lock file is a FIFO",
    lambda w, c: (fifo(w.copy_run(c) / runs.LOCK_FILE), w.resume(c / "run"))[1],
    "FIFO",
)
add(
    "train: --out",
    "--out is a dangling symlink",
    lambda w, c: (os.symlink(c / "nowhere", c / "lnk"), w.train(c / "lnk"))[1],
    "does not exist",
)
add(
    "train: --out",
    "--out is a dangling symlink under a missing folder",
    lambda w, c: (os.symlink(c / "a" / "b", c / "lnk"), w.train(c / "lnk"))[1],
    "does not exist",
)


def _snapshot(*roots: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under `roots`: its sha256 and mode."""
    found = {}
    for root in roots:
        for path in sorted(root.rglob("*")):
            if path.is_file() and not path.is_symlink():
                found[str(path)] = (hashlib.sha256(path.read_bytes()).digest(), path.stat().st_mode)
    return found


@pytest.fixture
def no_hang():
    """Fail a case that blocks (a FIFO opened for reading waits for a writer forever) instead of hanging."""
    import signal

    def stuck(signum, frame):
        raise TimeoutError("blocked for 120 s (a FIFO read?)")

    previous = signal.signal(signal.SIGALRM, stuck)
    signal.alarm(120)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


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
    result = _ok([*INSPECT, str(tmp_path / "f8.safetensors"), "--json", str(tmp_path / "r.json")])
    assert "transformer.h.0.mlp.c_fc.weight" in result.output and "2.75" in result.output  # exact in float8


def test_inspect_and_eval_accept_a_file_name_that_is_not_utf8(world, tmp_path):
    name = os.fsdecode(b"weights-\xff.safetensors")  # a surrogate-escaped byte, as Python lists such names
    shutil.copy(world.gpt2 / "model.safetensors", tmp_path / name)
    result = _ok([*INSPECT, str(tmp_path / name)])
    assert "transformer.h.0.attn.c_attn.weight" in result.output


def test_a_fifo_named_like_the_trainer_state_is_not_read(world, tmp_path, no_hang):
    shutil.copy(world.gpt2 / "model.safetensors", tmp_path / "model.safetensors")
    fifo(tmp_path / runs.STATE_JSON)
    _ok([*INSPECT, str(tmp_path / "model.safetensors")])


def test_an_unreadable_step_folder_is_skipped_with_a_note(world, tmp_path, monkeypatch):
    """A step folder of mode 000: skipped (and named) when this user cannot read it; read normally by
    root, who can. The refusal is also forced for root, by failing the folder's reads with EACCES."""
    run = world.copy_run(tmp_path)
    hidden = run / "step_1"
    hidden.chmod(0)
    try:
        result = _ok(["inspect", "--no-logits", str(run), "--json", str(tmp_path / "r.json")])
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
        result = _ok(["inspect", "--no-logits", str(run), "--json", str(tmp_path / "r2.json")])
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
