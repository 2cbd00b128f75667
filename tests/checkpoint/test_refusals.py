"""What resume, inspect and eval do with a checkpoint that is tampered with beyond the tables of
tests/cli/test_reliability_families.py (damaged files, crafted trainer states): inspect names a crafted
optimizer state it cannot measure in one note; a tampered step in trainer_state.json is refused with or
without checksums; an older checkpoint without checksums still loads, said once; eval warns when the
weights leave modules of the config at random init."""

import json
import shutil
from pathlib import Path

import pytest

from merit_core.checkpoint.state import NOT_VERIFIED, SKIPPED, STATE_JSON
from tests.cli_runs import TINY_TRAIN, invoke, train_args
from tests.family_checks import craft_trainer_state

# One checkpoint at step 2 (and no other to fall back to).
SETTINGS = {**TINY_TRAIN, "save_every": 0, "eval_every": 0}


@pytest.fixture(scope="module")
def trained(tmp_path_factory, model_cfg, data_dir):
    run = tmp_path_factory.mktemp("refusals") / "run"
    result = invoke(train_args(model_cfg, data_dir, run, "--steps", "2", settings=SETTINGS))
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in run.glob("step_*")) == ["step_2"]
    return run


@pytest.fixture
def run(trained, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    return copy


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _resume(model_cfg, data_dir, run, *extra):
    return invoke(train_args(model_cfg, data_dir, run, "--steps", "4", "--resume", *extra, settings=SETTINGS))


def _refused(result, *words):
    """Exit 2 with one error line naming `words`, and no traceback."""
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result.output, result.output
    for word in words:
        assert word in errors[0], errors[0]
    return errors[0]


# A flipped byte in each checkpoint file and crafted trainer states, through resume, inspect and eval:
# the tables of tests/cli/test_reliability_families.py.


def test_inspect_says_in_one_line_that_a_crafted_optimizer_state_gives_no_update_size(run):
    craft_trainer_state(run / "step_2", lambda s: s["optimizer"]["state"][0].pop("exp_avg_sq"))
    result = invoke(["inspect", str(run / "step_2"), "--no-verify", "--seq-len", "8"])
    assert result.exit_code == 0 and "Traceback" not in result.output, result.output
    flat = " ".join(result.output.split())  # rich wraps long notes
    assert flat.count("update size not measured") == 1, result.output
    assert "has no 'exp_avg_sq'" in flat.split("update size not measured")[1].split("note ")[0]
    assert flat.count(SKIPPED) == 1


def test_a_tampered_step_in_trainer_state_json_is_refused_with_or_without_checksums(run, model_cfg, data_dir):
    path = run / "step_2" / STATE_JSON
    path.write_text(path.read_text().replace('"step": 2', '"step": 5', 1))
    before = _snapshot(run)
    _refused(_resume(model_cfg, data_dir, run), "altered")
    _refused(_resume(model_cfg, data_dir, run, "--no-verify"), "says step 5 but the folder is step_2")
    assert _snapshot(run) == before


def test_a_checkpoint_without_checksums_loads_and_is_said_not_verified_once(run, model_cfg, data_dir):
    path = run / "step_2" / STATE_JSON
    state = json.loads(path.read_text())
    for key in ("checksums", "state_sha256"):
        state.pop(key)
    path.write_text(json.dumps(state))  # as merit wrote it before checksums were recorded
    result = invoke(["inspect", str(run), "--no-logits", "--no-updates"])
    assert result.exit_code == 0, result.output
    assert " ".join(result.output.split()).count(NOT_VERIFIED) == 1
    assert f"{run}: took step_2 (--checkpoints all)" in result.output
    resumed = _resume(model_cfg, data_dir, run)
    assert resumed.exit_code == 0, resumed.output
    assert " ".join(resumed.output.split()).count(NOT_VERIFIED) == 1


def test_eval_warns_when_the_weights_leave_modules_of_the_config_at_random_init(run, tmp_path):
    from merit_core.evaluation.checkpoint import load_model_and_tokenizer, resolve_checkpoint

    folder = tmp_path / "claims-more"
    shutil.copytree(run / "step_2", folder)
    for name in (STATE_JSON, "trainer_state.pt"):
        (folder / name).unlink()
    config = json.loads((folder / "config.json").read_text())
    layers = config["n_layer"]
    (folder / "config.json").write_text(json.dumps({**config, "n_layer": layers + 3}))
    notes: list[str] = []
    load_model_and_tokenizer(resolve_checkpoint(folder), "cpu", "float32", note=notes.append)
    assert len(notes) == 1 and "random init" in notes[0] and f"h.{layers}." in notes[0], notes
    notes.clear()
    load_model_and_tokenizer(resolve_checkpoint(run / "step_2"), "cpu", "float32", note=notes.append)
    assert notes == []  # the checkpoint as trained: every parameter from its weights
