"""--parallel fsdp: FSDP2 training under torchrun (2 CPU processes, gloo) against one process.

One torchrun launch (tests/dist_scripts/fsdp_checks.py) trains MERIT and AdamW under fsdp,
resumes the MERIT run, steps every registry optimizer on sharded and plain copies with the
same gradients, and trains MERIT on parameters whose dim 0 is below the world size; the tests
below compare its outputs with single-process runs.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from merit_core.checkpoint import runs
from merit_core.metrics import read_metrics
from tests.prepared_data import write_prepared, write_tiny_model_config

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "dist_scripts" / "fsdp_checks.py"
KEYS = ("loss", "val_loss", "grad_norm", "lr")


def _load_checks():
    import importlib.util

    spec = importlib.util.spec_from_file_location("fsdp_checks", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CHECKS = _load_checks()


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """The folder the torchrun launch filled: fsdp_merit/, fsdp_adamw/, resumed/, results.json."""
    work = tmp_path_factory.mktemp("fsdp")
    write_prepared(work / "data", n_sentences=1500)
    write_tiny_model_config(work / "model")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TMPDIR": str(work)}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(SCRIPT),
        str(work),
    ]
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return work


@pytest.fixture(scope="module")
def results(work):
    return json.loads((work / "results.json").read_text())


def _records(run_dir):
    return [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in read_metrics(run_dir)]


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["merit", "adamw"])
def test_fsdp_matches_single_process(work, tmp_path, optimizer):
    """Same global batch (2 ranks x 2 micro-batches of 2 vs 1 process x 2 micro-batches of 4)."""
    from safetensors.torch import load_file

    from merit_core.train.config import load_config
    from merit_core.train.training_run import run_training

    single_out = tmp_path / "single"
    values = {
        **CHECKS.COMMON,
        "micro_batch_size": 4,
        "optimizer": optimizer,
        "lr": CHECKS.LRS[optimizer],
        "model": str(work / "model" / "config.json"),
        "data": str(work / "data"),
        "out": str(single_out),
    }
    run_training(load_config(values=values))
    fsdp, single = _records(work / f"fsdp_{optimizer}"), _records(single_out)
    # MERIT's update ratio is recorded from whole (unsharded) optimizer state only: FSDP2 runs skip it
    unsharded_only = {"update_rms_ratio"}
    assert [sorted(r) for r in fsdp] == [sorted(set(r) - unsharded_only) for r in single]
    assert sum("loss" in r for r in fsdp) == 4 and sum("val_loss" in r for r in fsdp) == 3
    for a, b in zip(fsdp, single):
        for key in KEYS:
            if key in a:
                assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (key, a, b)
        if "max_attention_logit" in a:
            assert a["max_attention_logit"] == pytest.approx(b["max_attention_logit"], rel=1e-4)
    assert single[-1]["val_loss"] < single[0]["val_loss"]  # it trains
    wa = load_file(work / f"fsdp_{optimizer}" / "step_4" / "model.safetensors")
    wb = load_file(single_out / "step_4" / "model.safetensors")
    assert wa.keys() == wb.keys()  # the tied LM head is not stored, as in a single-process checkpoint
    for key in wa:
        torch.testing.assert_close(wa[key], wb[key], atol=1e-5, rtol=1e-4, msg=lambda m, k=key: f"{k}: {m}")


@pytest.mark.slow
def test_checkpoint_layout_and_hf_load(work):
    from transformers import AutoModelForCausalLM

    from merit_core.checkpoint.state import read_trainer_state
    from merit_core.checkpoint.tensors import load_trainer_state

    run = work / "fsdp_merit"
    assert [step for step, _ in runs.checkpoints(run)] == [2, 4]
    assert not list(run.glob(".tmp-*"))
    ckpt = run / "step_4"
    assert (ckpt / "optimizer" / ".metadata").is_file()
    assert sorted(p.name for p in (ckpt / "optimizer").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    info = read_trainer_state(ckpt).to_dict()
    assert (info["parallel"], info["world_size"], info["step"]) == ("fsdp", 2, 4)
    marker = load_trainer_state(ckpt)["optimizer"]
    assert marker == {"format": "torch.distributed.checkpoint", "path": "optimizer", "world_size": 2}

    model = AutoModelForCausalLM.from_pretrained(ckpt).eval()
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    from safetensors.torch import load_file

    saved = load_file(ckpt / "model.safetensors")
    for name, tensor in model.state_dict().items():
        if name in saved:
            assert torch.equal(tensor, saved[name]), name
    x = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(input_ids=x).logits
    assert torch.isfinite(logits).all() and logits.shape == (2, 16, model.config.vocab_size)


@pytest.mark.slow
def test_resume_reproduces_the_losses(work):
    """step_4 removed, resumed from step_2 (optimizer shards loaded through DCP): identical numbers."""
    from safetensors.torch import load_file

    full, resumed = _records(work / "fsdp_merit"), _records(work / "resumed")
    assert resumed == full
    a = load_file(work / "fsdp_merit" / "step_4" / "model.safetensors")
    b = load_file(work / "resumed" / "step_4" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_every_optimizer_is_exact_under_fsdp_or_refused(results):
    """Sharded vs plain with identical gradients: within the optimizer's own float noise floor;
    the ones that fail are exactly those refused up front."""
    from merit_core.optim.registry import get_spec

    for name, r in results["optimizers"].items():
        assert r["dtensor_params"], name
        if get_spec(name).fsdp_refused is not None:
            assert "error" in r, (name, r)
            continue
        assert "error" not in r, (name, r)
        assert r["update"] > 1e-3, (name, r)  # the weights really moved
        assert r["weight_diff"] <= 2 * r["noise_floor"] + 1e-6, (name, r)
        assert r["norm_diff"] < 1e-5, (name, r)  # the clipped norm is the full one, not a shard's
        merit_family = r["optimizer"] == "MERIT"
        assert r["all_reduces_per_step"] == (2.0 if merit_family else 0.0), (name, r)  # one per param group
    assert "in-place" in results["optimizers"]["lamb"]["error"]
    assert results["optimizers"]["adamw"]["kernel"] == {"foreach": True, "fused": None}  # fused takes no DTensors


@pytest.mark.slow
def test_empty_shards_train_without_hanging(results):
    rank0, rank1 = results["empty_shard"]
    assert rank0["local_rows"] == [1, 1, 2, 2] and rank1["local_rows"] == [0, 0, 1, 1]
    for r in (rank0, rank1):
        assert r["weight_diff"] < 1e-6 and r["moved"] > 1e-2


@pytest.mark.slow
def test_bf16_policy_computes_in_bf16_over_fp32_shards(results):
    mp = results["mixed_precision"]
    assert mp["auto"] == {"compute": "torch.float32", "weights": ["torch.float32"], "grads": ["torch.float32"]}
    assert mp["bfloat16"] == {"compute": "torch.bfloat16", "weights": ["torch.float32"], "grads": ["torch.float32"]}


def test_refused_optimizer_gets_one_line(tmp_path, monkeypatch):
    from merit_cli.main import cli

    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli, ["train", "--parallel", "fsdp", "--optimizer", "lamb", "--out", "run"])
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2, result.output + result.stderr
    assert len(lines) == 1, lines
    assert "optimizer 'lamb' does not support --parallel fsdp" in lines[0] and "lamb-ref" in lines[0]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_fsdp_checkpoint_refused_without_fsdp(work, tmp_path):
    from merit_core.errors import CheckpointError
    from merit_core.train.config import load_config
    from merit_core.train.training_run import run_training

    run = shutil.copytree(work / "fsdp_merit", tmp_path / "run")
    values = {
        **CHECKS.COMMON,
        "optimizer": "merit",
        "lr": CHECKS.LRS["merit"],
        "steps": 6,
        "model": str(work / "model" / "config.json"),
        "data": str(work / "data"),
        "out": str(run),
        "resume": True,
    }
    with pytest.raises(CheckpointError, match="written under --parallel fsdp"):
        run_training(load_config(values=values))
    assert sorted(p.name for p in run.iterdir()) == sorted(p.name for p in (work / "fsdp_merit").iterdir())
