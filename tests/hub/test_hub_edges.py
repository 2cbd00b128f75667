"""What `--revisions` picks, what a revision's name says, and what a hub model's files must be before
merit reads them: each refusal one line, before any weight is read or downloaded."""

import errno
import json

import pytest

from merit_core.checkpoint import hub_cache
from merit_core.checkpoint.hub_cache import MAX_CONFIG_BYTES, drop_weights, fetch_snapshot, repo_dir
from merit_core.checkpoint.hub_revisions import (
    HubModel,
    HubRequest,
    choose_revisions,
    nearest_revisions,
    parse_hub_model,
    parse_revisions,
    revision_step,
)
from merit_core.checkpoint.resolve import find_checkpoints
from merit_core.errors import CheckpointError, ConfigError, DiskFull
from merit_core.progress import Progress
from tests.hub.hub_cache import add_revision
from tests.tiny_models import tiny_gpt2

PYTHIA = ["main", "step0", "step1", "step2", "step4", "step1000", "step2000", "step3000", "step143000"]


@pytest.mark.parametrize(
    "name, step, tokens",
    [
        ("step1000", 1000, 1000 * 2_097_152),
        ("step1000-tokens4B", 1000, 4 * 10**9),
        ("stage1-step928646-tokens3896B", 928646, 3896 * 10**9),
        ("ckpt_042", 42, None),
        ("main", None, None),
        ("step1000-extra", None, None),
    ],
)
def test_a_revision_name_gives_its_step_and_tokens(name, step, tokens):
    assert revision_step(name) == (step, tokens)


@pytest.mark.parametrize(
    "text, picked",
    [
        ("all", ["step0", "step1", "step2", "step4", "step1000", "step2000", "step3000", "step143000"]),
        ("all/3", ["step0", "step4", "step3000", "step143000"]),  # every 3rd, the last kept
        ("step2..step2000", ["step2", "step4", "step1000", "step2000"]),
        ("1000..", ["step1000", "step2000", "step3000", "step143000"]),
        ("..1", ["step0", "step1"]),
        ("step3000,main,step1", ["step1", "step3000", "main"]),  # by step, names without one last
    ],
)
def test_revisions_picks_in_step_order(text, picked):
    assert choose_revisions("EleutherAI/pythia-70m", PYTHIA, parse_revisions(text)) == picked


def test_all_takes_every_revision_when_none_names_a_step():
    assert choose_revisions("org/m", ["main", "v2", "v1"], parse_revisions("all")) == ["main", "v1", "v2"]


@pytest.mark.parametrize("text", ["", "/2", "all/0", "step1,../x"])
def test_revisions_that_are_not_a_choice_are_one_line(text):
    with pytest.raises(ConfigError, match="--revisions"):
        parse_revisions(text)


def test_a_missing_revision_names_the_nearest_by_step_else_by_spelling():
    assert nearest_revisions("step2500", PYTHIA, limit=3) == ["step2000", "step3000", "step1000"]
    assert nearest_revisions("mian", ["main", "v1", "step5"], limit=1) == ["main"]
    with pytest.raises(ConfigError, match=r"has no revision 'step2500'; nearest it has \(of 9\): step2000, step3000"):
        choose_revisions("org/m", PYTHIA, parse_revisions("step2500"))


@pytest.mark.parametrize(
    "text, model",
    [
        ("EleutherAI/pythia-160m", HubModel("EleutherAI/pythia-160m")),
        (
            "allenai/OLMo-2-1124-7B@stage1-step1000-tokens5B",
            HubModel("allenai/OLMo-2-1124-7B", "stage1-step1000-tokens5B"),
        ),
        ("gpt2", None),
        ("./runs/a", None),
        ("org/../etc", None),
        ("runs/a/step_5", None),
    ],
)
def test_hub_model_names(text, model):
    assert parse_hub_model(text) == model


def test_the_files_downloaded_are_safetensors_config_and_tokenizer_at_the_top():
    listing = {
        "config.json": 700,
        "model-00001-of-00002.safetensors": 10,
        "model-00002-of-00002.safetensors": 10,
        "model.safetensors.index.json": 50,
        "pytorch_model.bin": 20,
        "tokenizer.json": 30,
        "README.md": 5,
        "modeling_x.py": 5,
    }
    assert hub_cache._wanted("org/m@main", listing, trust_remote_code=False) == [
        "config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
    ]
    assert "modeling_x.py" in hub_cache._wanted("org/m@main", listing, trust_remote_code=True)


@pytest.mark.parametrize(
    "listing, says",
    [
        ({"config.json": 700, "pytorch_model.bin": 20}, "never unpickles"),
        ({"config.json": MAX_CONFIG_BYTES + 1, "model.safetensors": 20}, "not a model config"),
        ({"model.safetensors": 20}, "has no config.json"),
    ],
)
def test_a_listing_is_refused_before_any_download(listing, says):
    with pytest.raises(CheckpointError, match=says):
        hub_cache._wanted("org/m@main", listing, trust_remote_code=False)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "cache"


def _tiny_folder(path, **changes):
    tiny_gpt2(**changes).save_pretrained(path)
    return path


def test_config_asking_to_run_code_is_refused_unless_trusted(cache, tmp_path):
    source = _tiny_folder(tmp_path / "coded")
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoModelForCausalLM": "m.Model"}}))
    add_revision(cache, "org/coded", "main", source)
    with pytest.raises(CheckpointError, match="auto_map.*--trust-remote-code"):
        fetch_snapshot(HubModel("org/coded"))
    assert fetch_snapshot(HubModel("org/coded"), HubRequest(trust_remote_code=True)).is_dir()


def test_a_missing_shard_and_an_absurd_config_are_one_line(cache, tmp_path):
    source = _tiny_folder(tmp_path / "sharded")
    weights = source / "model.safetensors"
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    weights.rename(source / "model-00001-of-00002.safetensors")
    (source / "model.safetensors.index.json").write_text(json.dumps(index))
    add_revision(cache, "org/sharded", "main", source)
    with pytest.raises(CheckpointError, match="names shard model-00002-of-00002.safetensors, which is missing"):
        find_checkpoints("org/sharded")
    big = _tiny_folder(tmp_path / "big")
    (big / "config.json").write_text(json.dumps({"n": " " * MAX_CONFIG_BYTES}))
    add_revision(cache, "org/big", "main", big)
    with pytest.raises(CheckpointError, match="past 4,194,304: not a model config"):
        find_checkpoints("org/big")
    with pytest.raises(CheckpointError, match="past 4,194,304: not a model config"):
        find_checkpoints(big)  # a local folder alike


def test_drop_weights_reads_each_revision_then_frees_its_blobs(cache, tmp_path):
    for seed, revision in enumerate(("step1", "step2")):
        add_revision(cache, "org/linked", revision, _tiny_folder(tmp_path / revision, seed=seed), linked=True)
    request = HubRequest(parse_revisions("all"), drop_weights=True)
    found = find_checkpoints("org/linked", hub=request)
    assert [c.step for c in found] == [1, 2] and all(not c.files for c in found)  # nothing read yet
    blobs = repo_dir("org/linked") / "blobs"
    before = len(list(blobs.iterdir()))
    with found[0].held() as ckpt:
        assert ckpt.tensors and (ckpt.folder / "model.safetensors").is_file()
    assert not (found[0].folder / "model.safetensors").exists() and (found[0].folder / "config.json").is_file()
    assert len(list(blobs.iterdir())) == before - 1  # its weights' blob, and only that
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes(b"mine")
    planted = repo_dir("org/linked") / "snapshots" / "planted"
    planted.mkdir()
    (planted / "model.safetensors").symlink_to(outside)
    drop_weights("org/linked", planted)
    assert not (planted / "model.safetensors").is_symlink()
    assert outside.read_bytes() == b"mine"  # a link out of the cache is unlinked, its target kept


def test_a_full_disk_during_a_download_is_one_line(cache, monkeypatch):
    import huggingface_hub

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", full)
    with pytest.raises(DiskFull, match="filled while downloading org/m@main.*a re-run resumes"):
        hub_cache._snapshot_download("org/m", "main", ["config.json"], None, "org/m@main")


def test_download_progress_is_told_in_bytes():
    events: list[Progress] = []
    bar = hub_cache._progress_bar(events.append, "org/m@main")
    written = bar(desc="Reconstructing", total=10, initial=0, unit="B")
    network = bar(desc="Downloading bytes", total=10, initial=0, unit="B")
    written.update(4)
    network.update(9)
    written.update(6)
    assert [(e.done, e.total, e.unit, e.item) for e in events] == [
        (4, 10, "bytes", "org/m@main"),
        (10, 10, "bytes", "org/m@main"),
    ]


class _FakeHub:
    """huggingface_hub's listing and download, served from a local folder: what was asked for is kept."""

    def __init__(self, source, cache, monkeypatch):
        import huggingface_hub

        self.source, self.cache, self.downloads = source, cache, []
        fake = self

        class Api:
            def model_info(self, repo_id, revision=None, files_metadata=False):
                siblings = [
                    type("S", (), {"rfilename": p.name, "size": p.stat().st_size}) for p in sorted(source.iterdir())
                ]
                return type("Info", (), {"siblings": siblings, "sha": "0" * 40})()

        monkeypatch.setattr(huggingface_hub, "HfApi", Api)
        monkeypatch.setattr(huggingface_hub, "snapshot_download", fake.download)
        monkeypatch.setattr(hub_cache, "_offline", lambda: False)

    def download(self, repo_id, revision, allow_patterns, cache_dir, tqdm_class):
        self.downloads.append(sorted(allow_patterns))
        snapshot = self.cache / "snapshot"
        snapshot.mkdir(parents=True, exist_ok=True)
        for name in allow_patterns:
            (snapshot / name).write_bytes((self.source / name).read_bytes())
        return str(snapshot)


def test_online_the_small_files_come_first_and_code_is_refused_before_any_weight(tmp_path, monkeypatch):
    source = _tiny_folder(tmp_path / "remote")
    (source / "pytorch_model.bin").write_bytes(b"not to be fetched")
    fake = _FakeHub(source, tmp_path / "cache", monkeypatch)
    folder = fetch_snapshot(HubModel("org/m", "step5"))
    assert fake.downloads == [
        ["config.json", "generation_config.json"],
        sorted(["config.json", "generation_config.json", "model.safetensors"]),
    ]
    assert (folder / "model.safetensors").is_file() and not (folder / "pytorch_model.bin").exists()
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoModelForCausalLM": "m.Model"}}))
    (tmp_path / "cache" / "snapshot" / "model.safetensors").unlink()
    fake.downloads.clear()
    with pytest.raises(CheckpointError, match="auto_map"):
        fetch_snapshot(HubModel("org/m", "step5"))
    assert fake.downloads == [["config.json", "generation_config.json"]]  # no weight asked for
