"""Hostile and unlucky inputs, family by family: each is refused in one line with exit code 2 (or
works, where the input is valid), never a traceback, and a decoy folder of the user's stays
byte-identical. Families: prepare's output folder, task folders as code, crafted checkpoints in
eval (refused as inspect refuses them), OS errors on paths, and the words of the messages."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from merit_cli.main import cli
from tests.data.test_prepare_durability import snapshot

REPO = Path(__file__).resolve().parents[2]
LONG = "n" * 300  # one name over the 255 bytes file systems allow


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """A user's folder: a decoy of theirs, a tiny corpus, a tiny GPT-2 checkpoint with a tokenizer."""
    from tests.data.test_data import make_docs, write_txt
    from tests.diagnostics.planted_models import diag_gpt2
    from tests.prepared_data import write_prepared

    root = tmp_path_factory.mktemp("hostile")
    decoy = root / "decoy"
    (decoy / "sub").mkdir(parents=True)
    (decoy / "meta.json").write_text('{"mine": true}\n')
    (decoy / "sub" / "notes.txt").write_text("keep\n")
    write_txt(root / "corpus.txt", make_docs(60))
    ckpt = root / "ckpt"
    diag_gpt2().save_pretrained(ckpt)
    data = write_prepared(root / "data", n_sentences=200, vocab_size=256)
    for item in (data / "tokenizer").iterdir():
        shutil.copy(item, ckpt / item.name)
    return {"root": root, "decoy": decoy, "ckpt": ckpt, "before": snapshot(decoy)}


def run_cli(args, home, expect: int = 2, *needles: str) -> str:
    result = CliRunner().invoke(cli, [str(a) for a in args])
    text = (result.stdout + result.stderr).strip()
    assert result.exit_code == expect, text
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in text
    if expect == 2:
        assert len(result.stderr.strip().splitlines()) <= 2, result.stderr
    for needle in needles:
        assert needle in text, text
    assert snapshot(home["decoy"]) == home["before"]
    return text


# ---------------------------------------------------------------- prepare's output folder
def _folder(root: Path, name: str, entries: dict[str, str]) -> Path:
    folder = root / name
    for rel, text in entries.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_text(text)
    folder.mkdir(exist_ok=True)
    return folder


PREPARE_CASES = {
    "the user's meta.json beside their files": ({"meta.json": "{}", "results.csv": "1"}, "refusing to overwrite"),
    "an old prepared layout without the mark": (
        {"meta.json": '{"format": "merit-tokens-v1"}', "train.bin": "", "val.bin": "", "tokenizer/x": ""},
        "refusing to overwrite",
    ),
    "a planted mark that is a folder": ({".merit-prepared/x": ""}, "refusing to overwrite"),
    "a mark that is not merit's": ({".merit-prepared": "[1]", "thesis.tex": "x"}, "refusing to overwrite"),
}


@pytest.mark.parametrize("case", list(PREPARE_CASES))
def test_prepare_refuses_a_folder_that_is_not_merits(home, tmp_path, case):
    entries, needle = PREPARE_CASES[case]
    folder = _folder(tmp_path, "out", entries)
    before = snapshot(folder)
    run_cli(["prepare", home["root"] / "corpus.txt", "-o", folder, "--vocab-size", "300"], home, 2, needle)
    assert snapshot(folder) == before


@pytest.mark.parametrize(
    ("where", "needle"),
    [
        (lambda t: t / LONG, "255"),
        (lambda t: t / "a" / LONG / "b", "255"),
        (lambda t: t / "afile" / "out", "not a folder"),
    ],
    ids=["long name", "long name inside", "through a file"],
)
def test_prepare_output_paths(home, tmp_path, where, needle):
    (tmp_path / "afile").write_text("x")
    run_cli(["prepare", home["root"] / "corpus.txt", "-o", where(tmp_path)], home, 2, needle)


# ---------------------------------------------------------------- task folders are code
def _task_folder(root: Path) -> Path:
    folder = root / "tasks"
    folder.mkdir(exist_ok=True)
    (folder / "utils.py").write_text(f"open({str(root / 'PWNED')!r}, 'w').write('ran')\n")
    (folder / "t.yaml").write_text(
        "task: evil\ndataset_path: json\ndataset_kwargs: {data_files: {test: x.jsonl}}\ntest_split: test\n"
        "process_docs: !function utils.process\ndoc_to_text: \"{{ cycler.__init__.__globals__.os.system('touch "
        f"{root / 'PWNED2'}') }}\"\ndoc_to_target: ''\noutput_type: loglikelihood\n"
    )
    return folder


@pytest.mark.parametrize(
    "args",
    [
        lambda h, t: ["eval", h["ckpt"], "--tasks", "evil", "--include-path", t],
        lambda h, t: ["eval", h["ckpt"], "--include-path", t, "--tasks", "lambada"],
        lambda h, t: ["eval", "--list-tasks", "--include-path", t],
        lambda h, t: ["eval", h["ckpt"], "--tasks", "evil", "--include_path", t, "--trust-remote-code"],
        lambda h, t: ["compare", "--out", t.parent / "cmp", "--eval", "evil", "--include-path", t],
    ],
    ids=["eval", "with an alias", "list-tasks", "trust-remote-code is not trust-task-code", "compare"],
)
def test_a_task_folder_needs_trust_task_code(home, tmp_path, args):
    tasks = _task_folder(tmp_path)
    run_cli(args(home, tasks), home, 2, "--trust-task-code", "code")
    assert not (tmp_path / "PWNED").exists() and not (tmp_path / "PWNED2").exists()


def test_the_shipped_aliases_need_no_flag(home):
    run_cli(["eval", "--list-tasks"], home, 0, "lambada", "superglue")


# ---------------------------------------------------------------- crafted checkpoints: eval refuses what inspect does
def _rewrite_header(src: Path, dst: Path, edit, trailing: bytes = b"", header_len: int | None = None) -> None:
    raw = src.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    text = json.dumps(header).encode()
    dst.write_bytes(struct.pack("<Q", header_len or len(text)) + text + raw[8 + n :] + trailing)


def _first_tensor(header) -> dict:
    return header[next(k for k in header if k != "__metadata__")]


def _overlap(header):
    names = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])
    a, b = header[names[0]], header[names[1]]
    if a["dtype"] == b["dtype"] and a["shape"] == b["shape"]:
        b["data_offsets"] = list(a["data_offsets"])
    else:
        b["shape"], b["dtype"], b["data_offsets"] = a["shape"], a["dtype"], list(a["data_offsets"])


def _negative(header):
    t = _first_tensor(header)
    if len(t["shape"]) == 2:
        t["shape"] = [-t["shape"][0], -t["shape"][1]]
    else:
        t["shape"] = [-1, -t["shape"][0]]


WEIGHT_CASES = {
    "overlapping offsets": (dict(edit=_overlap), "overlaps"),
    "trailing bytes": (dict(edit=lambda h: None, trailing=b"\0" * 64), "after the last tensor"),
    "negative shape": (dict(edit=_negative), "negative shape"),
    "header near 100 MB": (dict(edit=lambda h: None, header_len=100_000_001), "header length"),
}


@pytest.mark.parametrize("case", list(WEIGHT_CASES))
@pytest.mark.parametrize("command", ["eval", "inspect"])
def test_crafted_weights_are_refused_alike(home, tmp_path, case, command):
    kwargs, needle = WEIGHT_CASES[case]
    ckpt = tmp_path / "ck"
    shutil.copytree(home["ckpt"], ckpt)
    _rewrite_header(home["ckpt"] / "model.safetensors", ckpt / "model.safetensors", **kwargs)
    args = ["eval", ckpt, "--tasks", "lambada"] if command == "eval" else ["inspect", ckpt, "--no-logits"]
    run_cli(args, home, 2, needle)


CONFIG_CASES = {
    "n_head 0": ({"n_head": 0}, "attention heads"),
    "n_head null": ({"n_head": None}, "n_head"),
    "n_layer -1": ({"n_layer": -1}, "layers"),
    "n_embd a string": ({"n_embd": "64"}, "n_embd"),
    "heads do not divide": ({"n_head": 3}, "divisible"),
}


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_eval_refuses_a_config_that_cannot_build_a_model(home, tmp_path, case):
    changes, needle = CONFIG_CASES[case]
    ckpt = tmp_path / "ck"
    shutil.copytree(home["ckpt"], ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, **changes}))
    run_cli(["eval", ckpt, "--tasks", "lambada"], home, 2, needle)


def test_eval_refuses_a_tokenizer_without_special_tokens(home, tmp_path):
    ckpt = tmp_path / "ck"
    shutil.copytree(home["ckpt"], ckpt)
    config = json.loads((ckpt / "tokenizer_config.json").read_text())
    for key in ("eos_token", "bos_token", "unk_token", "pad_token"):
        config.pop(key, None)
    (ckpt / "tokenizer_config.json").write_text(json.dumps(config))
    run_cli(["eval", ckpt, "--tasks", "lambada"], home, 2, "end-of-text")


EVAL_ARG_CASES = {
    "limit 2**63": (lambda h, t: ["--limit", str(2**63)], "--limit"),
    "num-fewshot huge": (lambda h, t: ["--num-fewshot", "100000000"], "--num-fewshot"),
    "-o through a dangling link": (lambda h, t: ["-o", t / "gone" / "r.json"], "symbolic link"),
    "-o name too long": (lambda h, t: ["-o", t / f"{LONG}.json"], "255"),
    "-o in a folder named too long": (lambda h, t: ["-o", t / LONG / "r.json"], "255"),
    "-o through a file": (lambda h, t: ["-o", t / "afile" / "r.json"], "cannot write"),
    "empty pretrained=": (lambda h, t: ["--model_args", "pretrained="], "pretrained= is empty"),
}


@pytest.mark.parametrize("case", list(EVAL_ARG_CASES))
def test_eval_arguments_are_checked_before_any_scoring(home, tmp_path, case):
    make, needle = EVAL_ARG_CASES[case]
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")
    (tmp_path / "afile").write_text("x")
    args = ["eval", home["ckpt"], "--tasks", "lambada", *make(home, tmp_path)]
    if case == "empty pretrained=":
        args = ["eval", "--model", "hf", "--tasks", "lambada", *make(home, tmp_path)]
    run_cli(args, home, 2, needle)


# ---------------------------------------------------------------- OS errors and sizes
OS_CASES = {
    "train --out name too long": (lambda t: ["train", "--out", t / LONG, "--steps", "1"], "255"),
    "train CONFIG name too long": (lambda t: ["train", t / f"{LONG}.toml"], "long"),
    "inspect a name too long": (lambda t: ["inspect", t / LONG], "long"),
    "inspect --json in a folder named too long": (
        lambda t: ["inspect", t / "x", "-o", t / LONG / "r.json"],
        "255",
    ),
    "inspect -o /proc/version": (lambda t: ["inspect", t / "x", "-o", "/proc/version"], "--out"),
    "inspect --hessian-iters 100000000": (lambda t: ["inspect", t / "x", "--hessian-iters", "100000000"], "1000"),
    "--set nested thousands deep": (lambda t: ["train", "--set", "lr=" + "[" * 5000 + "]" * 5000], "nested"),
    "a TOML file nested thousands deep": (lambda t: ["train", t / "deep.toml"], "nested"),
    "a huge --set value is cut short": (lambda t: ["train", "--set", "lr='" + "x" * 200_000 + "'"], "left out"),
}


@pytest.mark.parametrize("case", list(OS_CASES))
def test_os_errors_and_sizes_are_one_line(home, tmp_path, case):
    make, needle = OS_CASES[case]
    (tmp_path / "x").mkdir()
    (tmp_path / "deep.toml").write_text("a = " + "[" * 5000 + "]" * 5000 + "\n")
    text = run_cli(make(tmp_path), home, 2, needle)
    assert len(text) < 1500


def test_a_cache_folder_through_a_file_falls_back(tmp_path, monkeypatch):
    from merit_core.paths import cache_dir

    (tmp_path / "afile").write_text("x")
    monkeypatch.setenv("MERIT_CACHE_DIR", str(tmp_path / "afile" / "cache"))
    path = cache_dir("data")
    assert path.is_dir() and os.access(path, os.W_OK) and str(tmp_path) not in str(path)
    assert (tmp_path / "afile").read_text() == "x"


def _subprocess(args, **env):
    return subprocess.run(
        [sys.executable, "-m", "merit_cli", *map(str, args)],
        env={**os.environ, "PYTHONPATH": str(REPO), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_ascii_output_encoding_and_a_closed_stdout(tmp_path):
    (tmp_path / "ünï.toml").write_text("lr = 'ünïcödé ✓'\n")
    result = _subprocess(["train", tmp_path / "ünï.toml"], PYTHONIOENCODING="ascii")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    closed = subprocess.run(
        [sys.executable, "-m", "merit_cli", "--version"],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        timeout=60,
        pass_fds=(),
        preexec_fn=lambda: os.close(1),
    )
    assert closed.returncode == 0 and closed.stderr == ""


# ---------------------------------------------------------------- resume
def test_resume_refuses_a_config_toml_that_is_a_folder(home, tmp_path):
    (tmp_path / "run" / "config.toml").mkdir(parents=True)
    run_cli(["train", "--resume", "--out", tmp_path / "run"], home, 2, "config.toml is not a file")
    assert (tmp_path / "run" / "config.toml").is_dir()


@pytest.mark.parametrize(
    "moment",
    [
        lambda: __import__("torch").zeros(3).expand(4, 3),  # stride 0: every row is one row
        lambda: __import__("torch").zeros(1, 1).expand(4, 3),
        lambda: __import__("torch").zeros(6).as_strided((4, 3), (1, 1)),  # interleaved strides
    ],
    ids=["expanded rows", "expanded scalar", "interleaved"],
)
def test_optimizer_moments_that_share_memory_are_refused_before_resuming(moment):
    import torch

    from merit_core.checkpoint.tensors import check_optimizer_state
    from merit_core.errors import CheckpointError

    param = torch.nn.Parameter(torch.zeros(4, 3))
    optimizer = torch.optim.AdamW([param])
    good = {"step": torch.tensor(1.0), "exp_avg": torch.zeros(4, 3), "exp_avg_sq": torch.zeros(4, 3)}
    state = {"state": {0: good}, "param_groups": [{**optimizer.param_groups[0], "params": [0]}]}
    check_optimizer_state(optimizer, state, "trainer_state.pt")  # a real state passes
    state["state"][0] = {**good, "exp_avg": moment()}
    with pytest.raises(CheckpointError, match="view with strides") as err:
        check_optimizer_state(optimizer, state, "trainer_state.pt")
    assert "\n" not in str(err.value)


def test_more_fewshot_examples_than_the_task_has_documents(home, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"the cat sees the ball number {i} today"}) + "\n" for i in range(3)))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "few.yaml").write_text(
        f"task: tiny_few\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {docs}\ntest_split: test\n"
        "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: word_perplexity\n"
    )
    args = [
        "eval",
        home["ckpt"],
        "--tasks",
        "tiny_few",
        "--include-path",
        tasks,
        "--trust-task-code",
        "--device",
        "cpu",
    ]
    run_cli([*args, "--num-fewshot", "5"], home, 2, "only 3 documents", "at most 2")


# ---------------------------------------------------------------- words
@pytest.mark.parametrize(
    ("raised", "absent", "present"),
    [
        (
            RuntimeError(
                "You set `ignore_mismatched_sizes` to `False`, thus raising an error. For details look at the above report!"
            ),
            "above report",
            "shape differs",
        ),
        (
            RuntimeError(
                "We encountered some issues during automatic conversion of the weights. For details look at the `CONVERSION` entries of the above report!"
            ),
            "above report",
            "could not convert",
        ),
        (ValueError("plain message"), "report", "plain message"),
    ],
)
def test_no_pointer_to_a_report_merit_silenced(raised, absent, present):
    from merit_core.evaluation.checkpoint import _load_error

    text = _load_error(raised)
    assert absent not in text and present in text


def test_a_huge_message_is_one_short_line():
    from merit_core.errors import one_line

    text = one_line("lr must be a number, got '" + "x" * 10_000_000 + "'\nsecond line")
    assert "\n" not in text and len(text) < 1100 and "left out" in text and text.endswith("second line")
