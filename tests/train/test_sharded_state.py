"""An fsdp checkpoint's optimizer shards are read back exactly, and nothing in them can run code."""

import os
import pickle
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from merit_core.checkpoint.optimizer_shards import METADATA_FILE, load_sharded
from merit_core.checkpoint.tensors import DCP_FORMAT
from merit_core.errors import CheckpointError
from merit_core.optim import MERIT
from merit_core.train.fsdp import OPTIMIZER_DIR, FSDPParallel


class Planted:
    """What a hostile run folder could pickle: unpickling it creates the folder `marker`."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


def _trained(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    opt = MERIT(model.parameters(), lr=0.01, weight_decay=0.1)
    for _ in range(2):
        model(torch.randn(5, 4)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _save(state, folder):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # single-process save: torch warns that no process group is set up
        dcp.save(state, checkpoint_id=folder, no_dist=True)


def _load(target, folder):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_sharded(target, folder)


def test_the_shards_load_back_exactly(tmp_path):
    model, opt = _trained()
    _save(get_optimizer_state_dict(model, opt), tmp_path)
    fresh_model, fresh_opt = _trained(seed=1)
    fresh_model.load_state_dict(model.state_dict())
    target = get_optimizer_state_dict(fresh_model, fresh_opt)
    _load(target, tmp_path)
    set_optimizer_state_dict(fresh_model, fresh_opt, target)
    want, got = opt.state_dict(), fresh_opt.state_dict()
    for group in got["param_groups"]:
        group.pop("differentiable", None)  # set_optimizer_state_dict adds torch's default
    assert want["param_groups"] == got["param_groups"]
    for key, entry in want["state"].items():
        for name, value in entry.items():
            assert torch.equal(value, got["state"][key][name]), (key, name)


def test_metadata_that_calls_a_function_is_refused_before_the_call(tmp_path):
    model, opt = _trained()
    _save(get_optimizer_state_dict(model, opt), tmp_path)
    marker = tmp_path / "ran"
    (tmp_path / METADATA_FILE).write_bytes(pickle.dumps(Planted(marker)))
    with pytest.raises(CheckpointError, match="never unpickles code"):
        _load(get_optimizer_state_dict(model, opt), tmp_path)
    assert not marker.exists()


class UnknownLayout:
    """A metadata pickle that calls an allowed function (the layout lookup) with a name it does not know."""

    def __reduce__(self):
        return (torch.serialization._get_layout, ("torch.no_such_layout",))


@pytest.mark.parametrize(
    "planted",
    [UnknownLayout(), torch.Size([2, 3]), b"not a pickle", b""],
    ids=["unknown layout", "a torch.Size", "not a pickle", "empty"],
)
def test_metadata_an_allowed_call_cannot_build_is_one_error_line(tmp_path, planted):
    """An allowed constructor given a crafted argument (a KeyError inside torch), a record of the wrong
    type, bytes that are no pickle: each is one CheckpointError line naming the file."""
    model, opt = _trained()
    _save(get_optimizer_state_dict(model, opt), tmp_path)
    raw = planted if isinstance(planted, bytes) else pickle.dumps(planted)
    (tmp_path / METADATA_FILE).write_bytes(raw)
    with pytest.raises(CheckpointError, match=r"\.metadata is not .*metadata") as caught:
        _load(get_optimizer_state_dict(model, opt), tmp_path)
    assert "\n" not in str(caught.value)


def test_a_planted_non_tensor_value_is_refused_before_it_is_unpickled(tmp_path):
    marker = tmp_path / "ran"
    _save({"x": torch.zeros(2), "planted": Planted(marker)}, tmp_path / "shards")
    assert not marker.exists()
    with pytest.raises(
        CheckpointError, match="'planted' of the checkpoint is not plain data [(]it names os.makedirs[)]"
    ):
        _load({"x": torch.ones(2), "planted": 0}, tmp_path / "shards")
    assert not marker.exists()


def _rewrite_shard_name(folder, name):
    with open(folder / METADATA_FILE, "rb") as fh:
        metadata = pickle.load(fh)  # the test's own file, written just before
    for info in metadata.storage_data.values():
        info.relative_path = name
    with open(folder / METADATA_FILE, "wb") as fh:
        pickle.dump(metadata, fh)


def test_shards_outside_the_folder_or_not_regular_files_are_refused(tmp_path):
    model, opt = _trained()
    folder = tmp_path / "shards"
    _save(get_optimizer_state_dict(model, opt), folder)
    (tmp_path / "elsewhere").write_bytes(b"")
    _rewrite_shard_name(folder, "../elsewhere")
    with pytest.raises(CheckpointError, match="names a shard outside the folder"):
        _load(get_optimizer_state_dict(model, opt), folder)
    os.mkfifo(folder / "pipe")
    _rewrite_shard_name(folder, "pipe")
    with pytest.raises(CheckpointError, match="pipe is not a regular file"):
        _load(get_optimizer_state_dict(model, opt), folder)


def test_the_trainer_states_marker_cannot_point_the_shards_out_of_the_checkpoint(tmp_path):
    marker = {"format": DCP_FORMAT, "path": "../../elsewhere", "world_size": 2}
    with pytest.raises(CheckpointError, match=f"not '{OPTIMIZER_DIR}'"):
        FSDPParallel.load_optimizer_state_dict(None, None, None, marker, tmp_path)


def test_shards_of_another_model_give_one_error_line_not_torchs_exception(tmp_path):
    model, opt = _trained()
    _save(get_optimizer_state_dict(model, opt), tmp_path)
    other = torch.nn.Linear(6, 3)
    other_opt = MERIT(other.parameters(), lr=0.01)
    other(torch.randn(2, 6)).sum().backward()
    other_opt.step()
    with pytest.raises(CheckpointError, match="cannot be loaded into this optimizer: Size mismatch") as caught:
        _load(get_optimizer_state_dict(other, other_opt), tmp_path)
    assert "\n" not in str(caught.value)
