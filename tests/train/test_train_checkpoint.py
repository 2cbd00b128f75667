"""Checkpoint folders: atomic writes, what counts as complete, pruning, safe loading."""

import json
import os

import pytest
import torch

from merit_core.checkpoint import runs
from merit_core.checkpoint.resolve import latest_checkpoint
from merit_core.checkpoint.state import TrainerState, optional_trainer_state, read_trainer_state
from merit_core.checkpoint.tensors import load_model_weights, load_trainer_state
from merit_core.checkpoint.writer import prune_checkpoints, save_checkpoint
from merit_core.errors import CheckpointError
from tests.prepared_data import TINY_GPT2


@pytest.fixture(scope="module")
def model():
    from transformers import GPT2Config

    from merit_core.models import build_model

    return build_model(GPT2Config(**TINY_GPT2), seed=0)


class Arbitrary:
    pass


def save(run, step, model, **state):
    return save_checkpoint(
        run,
        step,
        model=model,
        state_dict=None,
        tokenizer_dir=None,
        info=TrainerState(step=step),
        state={"step": step, **state},
    )


def test_complete_checkpoints_only_and_atomic_replace(tmp_path, model):
    for step in (2, 10, 4):
        save(tmp_path, step, model)
    (tmp_path / "step_12").mkdir()  # a folder without trainer state: not complete
    (tmp_path / ".tmp-step_14").mkdir()  # a crash while writing
    assert [s for s, _ in runs.checkpoints(tmp_path)] == [2, 4, 10]
    assert latest_checkpoint(tmp_path) == (10, tmp_path / "step_10")
    save(tmp_path, 10, model, extra=torch.ones(2))  # rewriting a step replaces it whole
    assert torch.equal(load_trainer_state(tmp_path / "step_10")["extra"], torch.ones(2))
    runs.remove_stale_staging(tmp_path)
    assert not (tmp_path / ".tmp-step_14").exists() and not list(tmp_path.glob(".tmp-*"))
    prune_checkpoints(tmp_path, keep=2)
    assert [s for s, _ in runs.checkpoints(tmp_path)] == [4, 10]
    assert json.loads((tmp_path / "step_10" / "trainer_state.json").read_text())["format"] == "merit-trainer-v1"


def test_weights_round_trip_and_mismatch(tmp_path, model):
    from transformers import GPT2Config

    from merit_core.models import build_model

    path = save(tmp_path, 1, model)
    other = build_model(GPT2Config(**TINY_GPT2), seed=1)
    load_model_weights(other, path)  # the tied lm_head is not stored; it follows wte
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values()))
    wider = build_model(GPT2Config(**{**TINY_GPT2, "n_layer": 3}), seed=0)
    with pytest.raises(CheckpointError, match="does not match the model"):
        load_model_weights(wider, path)


def test_trainer_state_refuses_pickled_objects(tmp_path, model):
    path = save(tmp_path, 1, model)
    torch.save({"step": 1, "evil": Arbitrary()}, path / "trainer_state.pt")  # would run code on unpickling
    with pytest.raises(CheckpointError, match="cannot be loaded safely"):
        load_trainer_state(path)
    with pytest.raises(CheckpointError, match="no trainer_state.pt"):
        load_trainer_state(tmp_path)


def test_resume_reads_refuse_truncated_weights_and_special_files(tmp_path, model, no_hang):
    """What a resume reads goes through merit_core.checkpoint.safe: a model.safetensors whose tensors end
    past the file, or a FIFO where trainer_state.pt / trainer_state.json / the weights should be, is
    one CheckpointError naming the file (never a blocked read), and the resume falls back to an
    older checkpoint that loads, saying why."""
    from merit_core.train.resume import ResumePlan, load_resumable

    resumable = {"optimizer": {"state": {}, "param_groups": []}, "rng": {"torch": torch.get_rng_state()}}
    old, new = save(tmp_path, 1, model, **resumable), save(tmp_path, 2, model, **resumable)
    weights = new / runs.WEIGHTS_NAME
    weights.write_bytes(weights.read_bytes()[:-16])  # the header's offsets now run past the end
    with pytest.raises(CheckpointError, match=r"model\.safetensors is truncated: tensor .* ends at byte"):
        load_model_weights(model, new)
    weights.unlink()
    os.mkfifo(weights)
    with pytest.raises(CheckpointError, match="FIFO"):
        load_model_weights(model, new)
    for name, read in ((runs.STATE_PT, load_trainer_state), (runs.STATE_JSON, read_trainer_state)):
        (new / name).unlink()
        os.mkfifo(new / name)
        with pytest.raises(CheckpointError, match=rf"{name} is a FIFO \(named pipe\); merit reads only regular"):
            read(new)
    assert optional_trainer_state(new, strict=False) is None  # optional metadata: a FIFO is no metadata
    notes = []
    assert load_resumable(ResumePlan([new, old]), model, tmp_path, notes.append)[0] == old
    assert len(notes) == 1 and "FIFO" in notes[0] and str(old) in notes[0]
