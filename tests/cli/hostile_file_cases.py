"""More cases of the bad-input table (tests/cli/bad_input_cases.py): hostile files (code in a
checkpoint, pickles, FIFOs, absurd sizes) and run folders planted to hurt their next user."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from merit_core.checkpoint import runs
from tests.cli.bad_input_cases import (
    COMPARE,
    INSPECT,
    World,
    add,
    corrupt,
    fs_file,
    model_json,
    only_last,
    safetensors_file,
    user_folder,
)
from tests.prepared_data import TINY_GPT2


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


def rehashed(run: Path) -> Path:
    """The run with its latest checkpoint's checksums recorded again, as someone who changed a file on
    purpose would: what refuses the change is then the state's own check, not the checksum."""
    from merit_core.checkpoint.state import read_trainer_state, write_trainer_state

    folder = runs.checkpoints(run)[-1][1]
    write_trainer_state(folder, read_trainer_state(folder, verify=False))
    return run


def wrong_moment(path: Path) -> None:
    state = torch.load(path, weights_only=True)
    moments = state["optimizer"]["state"]
    first = next(iter(moments))
    moments[first]["exp_avg"] = torch.zeros(3, 3)
    torch.save(state, path)


add(
    "train: resume",
    "exp_avg of the wrong shape",
    lambda w, c: w.resume(rehashed(only_last(w, c, "trainer_state.pt", wrong_moment))),
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


# -- resume reads its checkpoint through the one safe reader ---------------------------------------------
def truncated(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-16])  # the header's offsets now run past the end


def fifo_instead(path: Path) -> None:
    path.unlink()
    fifo(path)


add(
    "train: resume",
    "truncated model.safetensors",
    lambda w, c: w.resume(only_last(w, c, "model.safetensors", truncated)),
    "is truncated",
)
add(
    "train: resume",
    "trainer_state.pt is a FIFO",
    lambda w, c: w.resume(only_last(w, c, "trainer_state.pt", fifo_instead)),
    "trainer_state.pt is a FIFO",
)
add(
    "train: resume",
    "--resume-from a checkpoint whose trainer_state.pt is a FIFO",
    lambda w, c: w.resume(corrupt(w.copy_run(c), "trainer_state.pt", fifo_instead), "--resume-from", "step_2"),
    "trainer_state.pt is a FIFO",
)
add(
    "train: resume",
    "trainer_state.json is a FIFO",
    lambda w, c: w.resume(only_last(w, c, "trainer_state.json", fifo_instead)),
    "trainer_state.json is a FIFO",
)
add(
    "train: resume",
    "metrics.jsonl is a FIFO",
    lambda w, c: (fifo_instead(w.copy_run(c) / runs.METRICS_FILE), w.resume(c / "run"))[1],
    "metrics.jsonl is a FIFO",
)
