"""The table of bad inputs that tests/cli/test_bad_inputs.py runs through every subcommand: the
shared fixture folder's shape (World), helpers that write broken inputs into a case's folder, and
the cases for train, prepare, inspect, eval and compare, each (category, name, build, expect)."""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from merit_core.checkpoint import runs
from tests.prepared_data import TINY_GPT2, write_tiny_model_config

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
add("inspect", "-o is a folder", lambda w, c: [*INSPECT, str(w.gpt2), "-o", str(c)], "is a directory")
add(
    "inspect",
    "-o under a file",
    lambda w, c: [*INSPECT, str(w.gpt2), "-o", str(fs_file(c) / "r.json")],
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
    "-o under a file",
    lambda w, c: ["eval", str(w.gpt2), "--tasks", "lambada", "-o", str(fs_file(c) / "r.json")],
    "-o/--out",
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
