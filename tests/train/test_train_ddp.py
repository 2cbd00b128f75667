"""DDP under torchrun (2 CPU processes, gloo) follows the single-process run with the same global batch."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from merit_core.metrics import read_metrics
from tests.prepared_data import write_prepared, write_tiny_model_config

ROOT = Path(__file__).resolve().parents[2]
COMMON = {
    "batch_size": 8,
    "seq_len": 32,
    "steps": 4,
    "lr": 3e-3,
    "eval_every": 2,
    "save_every": 4,
    "log_every": 1,
    "eval_batches": 2,
    "eval_batch_size": 4,
}


def _strip(records):
    return [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in records]


@pytest.mark.slow
def test_ddp_two_processes_match_single_process(tmp_path):
    from safetensors.torch import load_file

    from merit_core.train.config import load_config
    from merit_core.train.training_run import run_training

    data = write_prepared(tmp_path / "data", n_sentences=1500)
    model = write_tiny_model_config(tmp_path / "model")
    ddp_out, single_out = tmp_path / "ddp", tmp_path / "single"
    sets = [a for k, v in {**COMMON, "micro_batch_size": 2}.items() for a in ("--set", f"{k}={v}")]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "merit_cli",
        "train",
        "--model",
        str(model),
        "--data",
        str(data),
        "--out",
        str(ddp_out),
        *sets,
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "x 2 processes" in proc.stdout and proc.stdout.count("Run summary") == 1  # only rank 0 renders

    # one process, a different micro-batch (accumulation 2 instead of 2 ranks x 2 micro-steps)
    config = load_config(
        values={**COMMON, "micro_batch_size": 4, "model": str(model), "data": str(data), "out": str(single_out)}
    )
    run_training(config)

    ddp, single = _strip(read_metrics(ddp_out)), _strip(read_metrics(single_out))
    assert [sorted(r) for r in ddp] == [sorted(r) for r in single]
    for a, b in zip(ddp, single):
        for key in ("loss", "val_loss", "grad_norm", "lr"):
            if key in a:
                assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (key, a, b)
        if "max_attention_logit" in a:
            assert a["max_attention_logit"] == pytest.approx(b["max_attention_logit"], rel=1e-4)
    wa, wb = load_file(ddp_out / "step_4" / "model.safetensors"), load_file(single_out / "step_4" / "model.safetensors")
    assert wa.keys() == wb.keys()
    assert all(torch.allclose(wa[k], wb[k], atol=1e-5, rtol=1e-4) for k in wa)
    assert single[-1]["val_loss"] < single[0]["val_loss"]
