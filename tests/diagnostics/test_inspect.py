"""`merit inspect` end to end on tiny checkpoints: logits vs a direct computation, JSON, plots, run folders."""

import json
import math

import pytest
import torch
from click.testing import CliRunner
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from merit_cli.main import cli
from merit_core.diagnostics.inspect_report import InspectOptions, inspect_paths
from merit_core.diagnostics.probe_batch import PROBE_TEXT
from tests.diagnostics.direct_attention import gpt2_direct, llama_direct
from tests.diagnostics.planted_models import GPT2_K_HEAD, LLAMA_KV_HEAD, PLANT, diag_gpt2, diag_llama, plant

TEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat by the door."


def save_tokenizer(folder):
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([PROBE_TEXT, TEXT], trainers.BpeTrainer(vocab_size=200, special_tokens=["[UNK]"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    fast.save_pretrained(folder)
    return fast


def scaled(model, factor=8.0):
    """Larger weights, so max logits are large and distinct (as in test_attention_logits)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.mul_(factor)
    return model.eval()


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    out = {}
    for name, model in (("gpt2", scaled(plant(diag_gpt2(seed=1)))), ("llama", scaled(plant(diag_llama(seed=2))))):
        model.save_pretrained(root / name)
        tok = save_tokenizer(root / name)
        out[name] = (root / name, model, tok)
    return out


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_max_logits_equal_direct_computation(ckpts, arch):
    folder, model, tok = ckpts[arch]
    report = inspect_paths([folder], InspectOptions(text=TEXT, text_source="text", query_chunk=5))
    (c,) = report.checkpoints
    ids = torch.tensor([tok(TEXT, add_special_tokens=False)["input_ids"]])
    assert ids.shape[1] < 256  # the text is measured as given: not repeated to fill a length
    assert (c.probe.source, c.probe.n_tokens, c.probe.notes) == ("text", ids.shape[1], [])
    with torch.no_grad():
        direct = (gpt2_direct if arch == "gpt2" else llama_direct)(model.eval(), ids)
    got = torch.tensor([[h.max_attention_logit for h in layer.heads] for layer in c.layers])
    torch.testing.assert_close(got, direct, rtol=1e-4, atol=1e-4)
    assert [l.max_attention_logit for l in c.layers] == pytest.approx(direct.amax(1).tolist(), rel=1e-4)
    assert direct.abs().max() > 1.0
    # a longer text is cut to --seq-len, and says so
    (cut,) = inspect_paths([folder], InspectOptions(text=TEXT, seq_len=8)).checkpoints
    assert cut.probe.n_tokens == 8 and "first 8" in cut.probe.notes[0]
    with torch.no_grad():
        direct = (gpt2_direct if arch == "gpt2" else llama_direct)(model.eval(), ids[:, :8])
    assert [l.max_attention_logit for l in cut.layers] == pytest.approx(direct.amax(1).tolist(), rel=1e-4)


def test_typed_report_to_dict_is_the_json(ckpts, tmp_path):
    from merit_core.diagnostics.inspect_report import write_json

    report = inspect_paths([ckpts["llama"][0]], InspectOptions(seq_len=12))
    write_json(report, tmp_path / "r.json")
    assert json.loads((tmp_path / "r.json").read_text()) == json.loads(json.dumps(report.to_dict()))
    (c,) = report.to_dict()["checkpoints"]
    assert list(c) == [
        "path", "label", "step", "run", "architecture", "n_layers", "n_heads", "n_kv_heads", "head_dim",
        "d_model", "row_axis", "layers", "weights", "notes", "probe", "hessian", "summary",
        "output", "updates", "verdict",  # additions
    ]  # fmt: skip
    assert list(c["layers"][0]) == [
        "layer", "q_max_norm", "k_max_norm", "q_l2_norm", "k_l2_norm", "q_max_over_l2", "k_max_over_l2",
        "bound", "max_attention_logit", "heads", "q_rows", "q_cols", "k_rows", "k_cols",
        "input_max_l1", "logit_bound", "input_max_l2", "spectral_logit_bound",  # additions
        "attention_entropy_mean", "attention_entropy_min", "normalized_attention_entropy_mean",
        "normalized_attention_entropy_min", "activation_max", "activation_median", "activation_ratio",
        "activation_max_position", "activation_max_dim",
    ]  # fmt: skip
    assert list(c["layers"][0]["heads"][0]) == [
        "head", "kv_head", "q_max_norm", "k_max_norm", "q_l2_norm", "k_l2_norm", "bound", "max_attention_logit",
        "logit_bound", "spectral_logit_bound",  # additions
        "attention_entropy_mean", "attention_entropy_min", "normalized_attention_entropy_mean",
        "normalized_attention_entropy_min",
    ]  # fmt: skip
    assert list(c["output"]) == ["output_logit_max_abs", "log_z_mean", "log_z_std", "log_z_max"]
    assert c["updates"] is None  # a bare checkpoint: no optimizer state
    typed = report.checkpoints[0]
    assert c["summary"]["bound"] == typed.summary.bound == max(l.q_max_norm * l.k_max_norm for l in typed.layers)


def test_cli_json_shape_and_side_by_side(ckpts, tmp_path):
    out = tmp_path / "r" / "inspect.json"
    g, l = ckpts["gpt2"][0], ckpts["llama"][0]
    res = CliRunner().invoke(cli, ["inspect", str(g), str(l), "--seq-len", "24", "--json", str(out), "--per-head"])
    assert res.exit_code == 0, res.output
    assert "side by side" in res.output and "per checkpoint" in res.output
    data = json.loads(out.read_text())
    assert [c["architecture"] for c in data["checkpoints"]] == ["gpt2", "llama"]
    assert not list(out.parent.glob(".*tmp"))  # atomic write left nothing behind
    for c in data["checkpoints"]:
        assert isinstance(c["path"], str) and c["n_layers"] == 2 and len(c["layers"]) == 2
        assert c["probe"]["n_tokens"] == 24 and c["probe"]["source"] == "builtin"
        for i, layer in enumerate(c["layers"]):
            assert layer["layer"] == i
            for key in ("q_max_norm", "k_max_norm", "q_l2_norm", "k_l2_norm", "max_attention_logit", "bound"):
                assert isinstance(layer[key], float)
            assert len(layer["heads"]) == 4
            assert all(isinstance(h["max_attention_logit"], float) for h in layer["heads"])
            assert set(layer["k_cols"]) >= {"p50", "p90", "p99", "max", "outliers"}
        assert c["summary"]["max_attention_logit"] == max(l["max_attention_logit"] for l in c["layers"])
        assert c["hessian"] is None
    gl, ll = data["checkpoints"][0]["layers"][1], data["checkpoints"][1]["layers"][1]
    assert gl["k_max_norm"] == pytest.approx(PLANT * 8) and gl["heads"][GPT2_K_HEAD]["k_max_norm"] == pytest.approx(56)
    assert ll["heads"][2 * LLAMA_KV_HEAD]["k_max_norm"] == pytest.approx(56)


def test_text_file_probe_matches_the_library_call(ckpts, tmp_path):
    folder = ckpts["llama"][0]
    (tmp_path / "probe.txt").write_text(TEXT)
    out = tmp_path / "t.json"
    res = CliRunner().invoke(
        cli, ["inspect", str(folder), "--text-file", str(tmp_path / "probe.txt"), "--seq-len", "12", "--json", str(out)]
    )
    assert res.exit_code == 0, res.output
    (c,) = json.loads(out.read_text())["checkpoints"]
    assert (c["probe"]["source"], c["probe"]["n_tokens"]) == ("file", 12)
    lib = inspect_paths([folder], InspectOptions(text=TEXT, seq_len=12)).checkpoints[0]
    assert [l["max_attention_logit"] for l in c["layers"]] == [l.max_attention_logit for l in lib.layers]
    builtin = inspect_paths([folder], InspectOptions(seq_len=12)).checkpoints[0]
    assert builtin.probe.source == "builtin"
    assert builtin.layers[0].max_attention_logit != lib.layers[0].max_attention_logit


def test_hessian_option_and_no_logits(ckpts, tmp_path):
    out = tmp_path / "h.json"
    res = CliRunner().invoke(
        cli,
        [
            "inspect",
            str(ckpts["gpt2"][0]),
            "--no-logits",
            "--hessian",
            "--hessian-iters",
            "3",
            "--hutchinson-samples",
            "2",
            "--seq-len",
            "8",
            "--json",
            str(out),
        ],
        env={"COLUMNS": "240"},  # the summary table's many columns fit: headers are read below
    )
    assert res.exit_code == 0, res.output
    (c,) = json.loads(out.read_text())["checkpoints"]
    h = c["hessian"]
    assert h["eigen_iters"] <= 2 * 3 and h["trace_samples"] == 2 and math.isfinite(h["largest_algebraic_eigenvalue"])
    assert all(l["max_attention_logit"] is None for l in c["layers"])
    assert h["smallest_algebraic_eigenvalue"] <= h["largest_algebraic_eigenvalue"]
    assert abs(h["largest_magnitude_eigenvalue"]) == max(
        abs(h["largest_algebraic_eigenvalue"]), abs(h["smallest_algebraic_eigenvalue"])
    )
    for header in ("largest alg.", "smallest", "largest |eig|"):  # rich may wrap the rest of a header
        assert header in res.output


def _png_ok(path):
    import matplotlib.image as mpimg

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = mpimg.imread(path)
    assert img.shape[0] > 300 and img.shape[1] > 500 and img.std() > 0.01  # a real picture, not blank


def _make_run(root, ckpts):
    """A run folder like `merit train` writes, with steps out of order, a temp dir and an incomplete step."""
    run = root / "run"
    for step, factor in ((10, 1.5), (0, 1.0), (5, 1.2)):
        model = diag_gpt2(seed=1)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(factor)
        model.save_pretrained(run / f"step_{step}")
        (run / f"step_{step}" / "trainer_state.json").write_text(json.dumps({"step": step, "optimizer": "merit"}))
    (run / ".tmp_step_20").mkdir()
    (run / "step_30").mkdir()  # interrupted before the weights were written
    (run / "config.toml").write_text("[model]\nname = 'gpt2-tiny'\n")
    return run


def test_run_folder_trajectory_and_plots(ckpts, tmp_path):
    run = _make_run(tmp_path, ckpts)
    out, png = tmp_path / "run.json", tmp_path / "traj.png"
    res = CliRunner().invoke(cli, ["inspect", str(run), "--seq-len", "8", "--json", str(out), "--plot", str(png)])
    assert res.exit_code == 0, res.output
    assert "trajectory" in res.output and "step_30" in res.output  # the skipped folder is named in a note
    data = json.loads(out.read_text())
    (given,) = data["inputs"]
    assert {k: given[k] for k in ("path", "kind", "n_checkpoints")} == {
        "path": str(run),
        "kind": "run",
        "n_checkpoints": 3,
    }
    assert given["verdict"]["steps"] == [0, 5, 10] and given["verdict"]["history"]
    steps = [c["step"] for c in data["checkpoints"]]
    assert steps == [0, 5, 10] and [c["optimizer"] for c in data["checkpoints"]] == ["merit"] * 3
    q = [c["summary"]["q_max_norm"] for c in data["checkpoints"]]
    assert q[1] == pytest.approx(1.2 * q[0]) and q[2] == pytest.approx(1.5 * q[0])
    _png_ok(png)
    bars = tmp_path / "bars.png"
    res = CliRunner().invoke(
        cli, ["inspect", str(ckpts["gpt2"][0]), str(ckpts["llama"][0]), "--no-logits", "--plot", str(bars)]
    )
    assert res.exit_code == 0 and "per-layer bars" in res.output
    _png_ok(bars)


def test_two_runs_trajectory_plot(ckpts, tmp_path):
    from merit_core.diagnostics.plots import plot_report

    a = _make_run(tmp_path / "a", ckpts)
    b = _make_run(tmp_path / "b", ckpts)
    report = inspect_paths([a, b], InspectOptions(logits=False))
    assert len(report.checkpoints) == 6
    assert plot_report(report, tmp_path / "two.png") == "trajectory"
    _png_ok(tmp_path / "two.png")
