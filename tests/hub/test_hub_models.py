"""Hub models read from a hub cache built on disk, offline: `merit inspect ORG/NAME --revisions all` is
the trajectory of its snapshot folders, `merit eval ORG/NAME@REV` the eval of its folder, and what
cannot be read (a pickle-only repository, a revision it lacks, a model not cached) is one line, exit 2."""

import json
import shutil

import pytest
from click.testing import CliRunner

from merit_cli.main import cli
from merit_core.checkpoint import resolve
from merit_core.checkpoint.hub_revisions import PYTHIA_TOKENS_PER_STEP
from tests.eval.local_tasks import HARBOUR_TEXT, eval_gpt2, set_offline, train_tokenizer
from tests.hub.hub_cache import add_revision

REVISIONS = ("step1000", "step2000", "step3000", "step4000")
REPO = "org/tiny"


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """An offline hub cache holding org/tiny at four Pythia-named revisions (and main, the last)."""
    root = tmp_path_factory.mktemp("hub")
    with pytest.MonkeyPatch.context() as mp:
        set_offline(mp, root)
        mp.setenv("HF_HUB_CACHE", str(root / "cache"))
        corpus = root / "harbour.txt"
        corpus.write_text(HARBOUR_TEXT * 8, encoding="utf-8")
        tokenizer = train_tokenizer(corpus)
        snapshots = {}
        for seed, revision in enumerate(REVISIONS):
            source = root / "models" / revision
            eval_gpt2(seed).save_pretrained(source)
            tokenizer.save_pretrained(source)
            snapshots[revision] = add_revision(root / "cache", REPO, revision, source)
        add_revision(root / "cache", REPO, "main", root / "models" / REVISIONS[-1])
        yield {"root": root, "cache": root / "cache", "snapshots": snapshots, "models": root / "models"}


def _merit(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def _one_line_error(result, *words):
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.output
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


MEASURED = ("layers", "summary", "output", "n_layers", "n_heads", "head_dim", "weights")


def test_inspect_revisions_all_is_the_trajectory_of_the_snapshot_folders(hub, tmp_path):
    out, direct = tmp_path / "hub.json", tmp_path / "folders.json"
    result = _merit("inspect", REPO, "--revisions", "all", "--json", out)
    assert result.exit_code == 0, result.output
    assert f"{REPO}: took tiny@step1000, tiny@step2000, tiny@step3000, tiny@step4000 (--revisions)" in result.output
    assert _merit("inspect", *(hub["snapshots"][r] for r in REVISIONS), "--json", direct).exit_code == 0
    report, folders = json.loads(out.read_text()), json.loads(direct.read_text())
    assert report["inputs"][0]["kind"] == "run" and report["inputs"][0]["n_checkpoints"] == 4
    assert report["inputs"][0]["verdict"]["steps"] == [1000, 2000, 3000, 4000]
    points = report["checkpoints"]
    assert [c["label"] for c in points] == [f"{REPO}@{r}" for r in REVISIONS]
    assert [c["step"] for c in points] == [1000, 2000, 3000, 4000]
    assert [c["tokens"] for c in points] == [s * PYTHIA_TOKENS_PER_STEP for s in (1000, 2000, 3000, 4000)]
    assert all(c["run"] == REPO for c in points)
    for point, folder in zip(points, folders["checkpoints"]):
        assert {k: point[k] for k in MEASURED} == {k: folder[k] for k in MEASURED}  # the same files, read alike
    assert points[0]["summary"]["max_attention_logit"] != points[1]["summary"]["max_attention_logit"]


def test_inspect_thinned_revisions_and_one_revision(hub):
    result = _merit("inspect", REPO, "--revisions", "all/2", "--no-logits")
    assert result.exit_code == 0, result.output
    assert "took tiny@step1000, tiny@step3000, tiny@step4000 (--revisions)" in result.output  # the last kept
    result = _merit("inspect", REPO, "--revisions", "1500..3000", "--no-logits")
    assert "took tiny@step2000, tiny@step3000 (--revisions)" in result.output
    result = _merit("inspect", f"{REPO}@step2000", "--no-logits")
    assert result.exit_code == 0 and f"{REPO}@step2000" in result.output


def test_eval_of_a_revision_equals_eval_of_its_folder(hub, tmp_path):
    hub_out, folder_out = tmp_path / "hub.json", tmp_path / "folder.json"
    common = ["--tasks", "builtin", "--limit", "2", "--bootstrap-iters", "0"]
    assert _merit("eval", f"{REPO}@step2000", *common, "-o", hub_out).exit_code == 0
    assert _merit("eval", hub["models"] / "step2000", *common, "-o", folder_out).exit_code == 0
    (scored,), (direct,) = (
        json.loads(hub_out.read_text())["checkpoints"],
        json.loads(folder_out.read_text())["checkpoints"],
    )
    assert scored["results"] == direct["results"]
    assert scored["path"] == str(hub["snapshots"]["step2000"].resolve())  # the folder scored
    assert scored["meta"]["source"] == "hub" and scored["meta"]["hub"] == f"{REPO}@step2000"


def test_a_pickle_only_repository_is_refused(hub, tmp_path):
    source = tmp_path / "pickled"
    source.mkdir()
    shutil.copy(hub["models"] / "step1000" / "config.json", source / "config.json")
    (source / "pytorch_model.bin").write_bytes(b"PK\x03\x04 not to be unpickled")
    add_revision(hub["cache"], "org/pickled", "main", source)
    for command in ("inspect", "eval"):
        extra = ["--tasks", "builtin"] if command == "eval" else []
        _one_line_error(_merit(command, "org/pickled", *extra), "pytorch_model.bin", "pickle", "never unpickles")


def test_a_revision_it_lacks_names_those_it_has_nearest_first(hub):
    line = _one_line_error(_merit("inspect", REPO, "--revisions", "step2400,step1000"), "no revision 'step2400'")
    assert line.index("step2000") < line.index("step3000") < line.index("step1000") < line.index("step4000")
    _one_line_error(_merit("inspect", f"{REPO}@step9"), "no revision 'step9'", "step1000")
    _one_line_error(_merit("eval", f"{REPO}@step9", "--tasks", "builtin"), "no revision 'step9'", "step1000")


def test_a_model_offline_and_not_cached_is_one_line(hub):
    _one_line_error(_merit("inspect", "org/absent"), "org/absent is not in the hub cache", "offline")
    _one_line_error(_merit("eval", "org/absent@step1", "--tasks", "builtin"), "not in the hub cache")


def test_the_revision_given_twice_is_refused(hub):
    _one_line_error(_merit("inspect", f"{REPO}@step1000", "--revisions", "all"), "give the revision once")


def _own_cache(hub, tmp_path, monkeypatch):
    """A copy of the module's hub cache for a test that deletes weights from it."""
    cache = tmp_path / "cache"
    shutil.copytree(hub["cache"], cache, symlinks=True)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache / "models--org--tiny" / "snapshots"


EVAL = ("--tasks", "builtin", "--limit", "2", "--bootstrap-iters", "0")


def test_eval_dropping_each_revisions_weights_gives_the_same_scores_and_max_logits(hub, tmp_path, monkeypatch):
    snapshots = _own_cache(hub, tmp_path, monkeypatch)
    kept, dropped = tmp_path / "kept.json", tmp_path / "dropped.json"
    picked = ("step1000", "step3000")
    result = _merit("eval", REPO, "--revisions", ",".join(picked), *EVAL, "-o", kept)
    assert result.exit_code == 0, result.output
    fetched, fetch = [], resolve.fetch_snapshot

    def watched(model, request=None):  # each fetch: the revisions fetched before hold no weights by then
        held = [r for r in fetched if (snapshots / hub["snapshots"][r].name / "model.safetensors").exists()]
        assert not held, f"{held} still hold weights when {model} is fetched"
        fetched.append(model.revision)
        return fetch(model, request)

    monkeypatch.setattr(resolve, "fetch_snapshot", watched)
    result = _merit("eval", REPO, "--revisions", ",".join(picked), "--drop-weights", *EVAL, "-o", dropped)
    assert result.exit_code == 0, result.output
    assert fetched == list(picked)  # each fetched once, when its turn came
    assert f"{REPO}: took tiny@step1000, tiny@step3000 (--revisions)" in result.output
    assert json.loads(dropped.read_text()) == json.loads(kept.read_text())  # scores, max logits, meta alike
    logits = [c["meta"]["recorded_max_attention_logit"] for c in json.loads(dropped.read_text())["checkpoints"]]
    assert all(isinstance(v, float) for v in logits) and logits[0] != logits[1]
    for revision in REVISIONS:
        folder = snapshots / hub["snapshots"][revision].name
        left = sorted(p.name for p in folder.iterdir())
        assert ("model.safetensors" in left) == (revision not in picked), (revision, left)
        assert {"config.json", "tokenizer.json"} <= set(left)  # config and tokenizer stay


def test_eval_of_a_revision_whose_weights_are_gone_is_one_line_offline(hub, tmp_path, monkeypatch):
    snapshots = _own_cache(hub, tmp_path, monkeypatch)
    (snapshots / hub["snapshots"]["step2000"].name / "model.safetensors").unlink()  # after listing, before scoring
    result = _merit("eval", REPO, "--revisions", "step2000", "--drop-weights", *EVAL)
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "step2000 has no safetensors weights in the hub cache" in errors[0], result.output
    assert "Traceback" not in result.output
    out = tmp_path / "rest.json"  # among others: the rest scored, the lost one named once
    result = _merit("eval", REPO, "--revisions", "step1000,step2000", "--drop-weights", *EVAL, "-o", out)
    assert result.exit_code == 2 and result.output.count("step2000 has no safetensors weights") == 1, result.output
    written = json.loads(out.read_text())
    assert [c["meta"]["hub"] for c in written["checkpoints"]] == [f"{REPO}@step1000"]
    assert [m["path"] for m in written["missing"]] == [f"{REPO}@step2000"]


def test_drop_weights_refuses_local_folders_and_several_devices(hub, tmp_path, monkeypatch):
    _own_cache(hub, tmp_path, monkeypatch)
    folder = hub["models"] / "step1000"
    _one_line_error(_merit("eval", folder, "--drop-weights", *EVAL), "--drop-weights", "is not a hub model")
    line = _one_line_error(_merit("eval", REPO, "--revisions", "all", "--drop-weights", "--devices", "cpu,cpu", *EVAL))
    assert "--devices" in line
    assert (folder / "model.safetensors").is_file()
