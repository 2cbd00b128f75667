"""`merit eval --output_path DIR` writes the file lm-eval's own command line writes for the same run, key by
key (timings, dates and host fields aside), on a tiny local checkpoint and the local task of
examples/eval-task; `-o FILE` beside it writes merit's JSON there too; a link planted at DIR/<model> is
refused, never written through."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from merit_cli.main import cli
from tests.tiny_models import tiny_gpt2

ROOT = Path(__file__).resolve().parents[2]
# what differs between two runs of one command: when and how long it ran, and the machine's description
NOT_COMPARED = {"date", "start_time", "end_time", "total_evaluation_time_seconds", "pretty_env_info", "git_hash"}


def _checkpoint(folder: Path) -> None:
    """A tiny GPT-2 with a word-level BPE tokenizer trained on the task's sentences."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    text = (ROOT / "examples" / "eval-task" / "sentences.jsonl").read_text(encoding="utf-8")
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=120, special_tokens=["[UNK]"]))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="[UNK]").save_pretrained(folder)
    tiny_gpt2(vocab_size=128, n_positions=64).save_pretrained(folder)


def _differences(ours: object, theirs: object, where: str = "") -> list[str]:
    if isinstance(ours, dict) and isinstance(theirs, dict):
        found = [f"{where}/{k}: only lm-eval's" for k in theirs.keys() - ours.keys()]
        found += [f"{where}/{k}: only merit's" for k in ours.keys() - theirs.keys()]
        for key in ours.keys() & theirs.keys():
            if not (where == "" and key in NOT_COMPARED):
                found += _differences(ours[key], theirs[key], f"{where}/{key}")
        return found
    return [] if ours == theirs else [f"{where}: merit {ours!r} != lm-eval {theirs!r}"]


@pytest.mark.slow
def test_output_path_equals_lm_evals_own_file_key_by_key(tmp_path, monkeypatch):
    _checkpoint(tmp_path / "ckpt")
    shutil.copytree(ROOT / "examples" / "eval-task", tmp_path / "examples" / "eval-task")  # its data path is relative
    monkeypatch.chdir(tmp_path)
    ckpt = str(tmp_path / "ckpt")  # absolute, as typed: lm-eval keeps it so (folder name included)
    common = ["--model", "hf", "--model_args", f"pretrained={ckpt},dtype=float32", "--tasks", "my_lastword"]
    common += ["--include_path", "examples/eval-task", "--limit", "3", "--log_samples", "--seed", "5"]
    common += ["--device", "cpu", "--batch_size", "1"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    theirs_run = subprocess.run(
        [sys.executable, "-m", "lm_eval", *common, "--output_path", str(tmp_path / "lm")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert theirs_run.returncode == 0, theirs_run.stderr[-3000:]
    ours_run = CliRunner().invoke(
        cli, ["eval", *common, "--trust-task-code", "--output_path", str(tmp_path / "ours"), "-o", "merit.json"]
    )
    assert ours_run.exit_code == 0, ours_run.output

    (theirs_file,) = glob.glob(str(tmp_path / "lm" / "*" / "results_*.json"))
    (ours_file,) = glob.glob(str(tmp_path / "ours" / "*" / "results_*.json"))
    assert Path(ours_file).parent.name == Path(theirs_file).parent.name  # lm-eval's folder for pretrained=
    theirs, ours = (json.loads(Path(f).read_text()) for f in (theirs_file, ours_file))
    assert _differences(ours, theirs) == []
    assert {"results", "configs", "config", "model_name"} <= theirs.keys()  # the comparison compared something
    assert 0 < float(ours["total_evaluation_time_seconds"]) < 600  # the model load and scoring, not ~0
    (theirs_samples,) = glob.glob(str(tmp_path / "lm" / "*" / "samples_my_lastword_*.jsonl"))
    (ours_samples,) = glob.glob(str(tmp_path / "ours" / "*" / "samples_my_lastword_*.jsonl"))
    assert Path(ours_samples).read_text().splitlines() == Path(theirs_samples).read_text().splitlines()
    # -o and --output_path together: merit's JSON where -o says, lm-eval's files in the folder
    merit_json = json.loads((tmp_path / "merit.json").read_text())
    assert merit_json["checkpoints"][0]["results"] == theirs["results"]
    assert not list((tmp_path / "ours").glob("results-*.json"))


def _fake_out() -> dict:
    """The parts of simple_evaluate's output lm-eval's EvaluationTracker reads, for one task."""
    return {
        "results": {"t": {"alias": "t", "acc,none": 0.5}},
        "configs": {"t": {"task": "t", "metadata": {"version": 1.0}}},
        "versions": {"t": 1.0},
        "n-shot": {"t": 0},
        "higher_is_better": {"t": {"acc": True}},
        "n-samples": {"t": {"original": 2, "effective": 2}},
        "config": {},
    }


def test_a_link_planted_at_the_model_folder_is_refused(tmp_path):
    from lm_eval.utils import sanitize_model_name

    from merit_core.errors import MeritError
    from merit_core.evaluation.lm_eval_output import write_lm_eval_results

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = tmp_path / "evals"
    out.mkdir()
    (out / sanitize_model_name("run/step_1")).symlink_to(elsewhere)
    with pytest.raises(MeritError, match="is a symbolic link .* never follows links inside --output_path"):
        write_lm_eval_results(out, "run/step_1", _fake_out(), {"model_args": "pretrained=run/step_1"})
    assert list(elsewhere.iterdir()) == []
    assert [p.name for p in out.iterdir()] == [sanitize_model_name("run/step_1")]  # no staging left behind
    (written,) = write_lm_eval_results(out, "other", _fake_out(), {"model_args": "pretrained=other,dtype=float32"})
    data = json.loads(written.read_text())
    assert data["config"]["model"] == "hf" and data["config"]["model_args"] == {
        "pretrained": "other",
        "dtype": "float32",
    }
    assert data["configs"]["t"]["metadata"] == {"version": 1.0, "pretrained": "other", "dtype": "float32"}
