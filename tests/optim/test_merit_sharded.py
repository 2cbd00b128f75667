"""merit_sharded: exact MERIT on plain tensors and, under torchrun, on DTensor shards."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from merit_core.optim.merit.dtensor_step import merit_sharded

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "dist_scripts" / "merit_sharded_check.py"


def _load_check():
    spec = importlib.util.spec_from_file_location("merit_sharded_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CHECK = _load_check()
HP = CHECK.HP
sharded_step = CHECK.sharded_step
STEP_DEFAULTS = CHECK.STEP_DEFAULTS


def _run_plain(weights, grads, opts, dtype=torch.float64, state_dtype=None):
    """STEPS steps of merit_step_sharded on plain tensors; returns {name: (w, m, v)} and steps."""
    ws = {k: w.to(dtype, copy=True) for k, w in weights.items()}
    ms = {k: torch.zeros_like(w, dtype=state_dtype) for k, w in ws.items()}
    vs = {k: torch.zeros_like(w, dtype=state_dtype) for k, w in ws.items()}
    steps = [torch.tensor(0.0) for _ in ws]
    for t in range(CHECK.STEPS):
        gs = [grads[k][t].to(dtype) for k in ws]
        sharded_step(
            merit_sharded,
            list(ws.values()),
            gs,
            list(ms.values()),
            list(vs.values()),
            steps,
            lr=HP["lr"],
            beta1=HP["beta1"],
            beta2=HP["beta2"],
            eps=HP["eps"],
            **opts,
        )
    return {k: (ws[k], ms[k], vs[k]) for k in ws}, steps


@pytest.mark.parametrize("local", ["cpu", "torch"])
@pytest.mark.parametrize("opts", CHECK.combos(), ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_plain_tensors_match_literal_reference(opts, local):
    weights, grads = CHECK.make_problem(seed=1)
    got, steps = _run_plain(weights, grads, dict(opts, local=local))
    want = CHECK.reference_run(weights, grads, opts)
    assert [float(s) for s in steps] == [CHECK.STEPS] * len(steps)
    for name in weights:
        for g, w, what in zip(got[name], want[name], "wmv"):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-12, msg=lambda m, n=f"{name}.{what}": f"{n}: {m}")


@pytest.mark.parametrize(
    ("dtype", "state_dtype", "tol"),
    [
        (torch.float32, None, dict(rtol=0, atol=2e-5)),
        (torch.bfloat16, torch.float32, dict(rtol=1e-2, atol=2e-3)),  # bf16 weights (1 ulp ~ 0.8%), fp32 moments
    ],
)
def test_low_precision_close_to_float64_reference(dtype, state_dtype, tol):
    opts = CHECK.combos()[0]  # max-norm, element-wise, weight bound, clipped
    weights, grads = CHECK.make_problem(seed=2)
    # The reference starts from the same (rounded) numbers the low-precision run sees.
    weights = {k: w.to(dtype).double() for k, w in weights.items()}
    grads = {k: [g.to(dtype).double() for g in gs] for k, gs in grads.items()}
    got, _ = _run_plain(weights, grads, opts, dtype=dtype, state_dtype=state_dtype)
    want = CHECK.reference_run(weights, grads, opts)
    for name in weights:
        assert got[name][0].dtype == dtype and got[name][1].dtype == (state_dtype or dtype)
        torch.testing.assert_close(got[name][0].double(), want[name][0], **tol, msg=lambda m, n=name: f"{n}: {m}")
        torch.testing.assert_close(
            got[name][1].double(), want[name][1], rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )


def test_moves_at_most_lr_times_clip_and_transpose_is_symmetric():
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(6, 9, generator=gen, dtype=torch.float64)
    g = torch.randn(6, 9, generator=gen, dtype=torch.float64) * 100
    kw = {**STEP_DEFAULTS, "weight_decay": 0.01}
    a, at = w.clone(), w.T.clone()
    sharded_step(
        merit_sharded,
        [a, at],
        [g, g.T.contiguous()],
        [torch.zeros_like(a), torch.zeros_like(at)],
        [torch.zeros_like(a), torch.zeros_like(at)],
        [torch.tensor(0.0), torch.tensor(0.0)],
        **kw,
    )
    assert (a - w).abs().max() <= 0.1 + 1e-12
    assert ((a - w).abs() > 0.1 - 1e-9).any(), "the clip never bound: the bound above is vacuous"
    torch.testing.assert_close(at, a.T, rtol=0, atol=1e-15)


def test_3d_tensor_is_one_matrix_per_trailing_index():
    """Rows along dim 0, columns along dim 1; without the tensor-wide floor, each [:, :, k] slice
    gets exactly the update it would get as a 2-D parameter of its own."""
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(4, 3, 2, generator=gen, dtype=torch.float64)
    g = torch.randn(4, 3, 2, generator=gen, dtype=torch.float64)
    kw = {**STEP_DEFAULTS, "weight_decay": 0.1, "weight_bound": False}
    cube = w.clone()
    slices = [w[:, :, k].clone() for k in range(2)]
    tensors = [cube] + slices
    grads = [g] + [g[:, :, k].contiguous() for k in range(2)]
    sharded_step(
        merit_sharded,
        tensors,
        grads,
        [torch.zeros_like(t) for t in tensors],
        [torch.zeros_like(t) for t in tensors],
        [torch.tensor(0.0) for _ in tensors],
        **kw,
    )
    torch.testing.assert_close(cube, torch.stack(slices, dim=2), rtol=0, atol=1e-15)


def test_no_host_sync_in_step(monkeypatch):
    """The step never reads a tensor value on the host (it would stall a GPU pipeline)."""
    weights, grads = CHECK.make_problem(seed=4)

    def refuse(self, *args, **kwargs):
        raise AssertionError("host sync inside merit_sharded")

    for attr in ("item", "tolist", "__bool__", "__float__", "__int__"):
        monkeypatch.setattr(torch.Tensor, attr, refuse)
    # The torch path is the one that runs on GPUs (the C++ passes read CPU step counters: no sync).
    _run_plain(weights, grads, dict(CHECK.combos()[1], bias_correction=True, local="torch"))


def test_bad_arguments_are_refused_before_touching_state():
    w, g = torch.ones(2, 2), torch.ones(2, 2)
    m = torch.zeros(2, 2)
    kw = {k: v for k, v in STEP_DEFAULTS.items() if k != "norm"}
    with pytest.raises(ValueError, match="norm must be"):
        sharded_step(merit_sharded, [w], [g], [m], [m.clone()], [torch.tensor(0.0)], norm="linf", **kw)
    with pytest.raises(ValueError, match="differ in length"):
        sharded_step(merit_sharded, [w], [g], [m], [], [torch.tensor(0.0)], norm="max", **kw)
    with pytest.raises(TypeError, match="steps must be scalar tensors"):
        sharded_step(merit_sharded, [w], [g], [m], [m.clone()], [0], norm="max", **kw)
    assert torch.equal(w, torch.ones(2, 2)) and torch.equal(m, torch.zeros(2, 2))


@pytest.mark.slow
def test_dtensor_shards_match_reference_under_torchrun(tmp_path):
    """Two gloo processes: FSDP, TP, replicated, HSDP, 2-D meshes and real fully_shard params,
    every ablation, empty and uneven shards, one all-reduce per sharded step; and the non-finite
    rule across ranks (a NaN on one rank's shard poisons the parameter's shards on both)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), TMPDIR=str(tmp_path))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(SCRIPT)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "ALL OK world=2" in out
    assert "NONFINITE cases=24 ok" in out, out[-4000:]  # the NaN/inf rule on DTensor shards
    configs = dict(re.findall(r"CONFIG (\S+) .*?all_reduces_per_step=(\d+)", out))
    assert configs == {"fsdp": "1", "tp": "1", "replicate": "0", "hsdp_1x2": "1", "2d_2x1": "1"}, out[-4000:]
    errors = dict(re.findall(r"CONFIG (\S+) .*?max_abs_err=(\S+)", out))
    assert len(errors) == 7, out[-4000:]
    assert all(float(e) <= (2e-5 if name == "fsdp_fp32" else 1e-12) for name, e in errors.items()), errors


@pytest.mark.parametrize("local", ["cpu", "torch"])
def test_tensor_lr_equals_the_float_one(local):
    weights, grads = CHECK.make_problem(seed=5)
    opts = dict(CHECK.combos()[0], local=local)
    a, _ = _run_plain(weights, grads, opts)
    hp = dict(HP)
    try:
        HP["lr"] = torch.tensor(HP["lr"], dtype=torch.float64)
        b, _ = _run_plain(weights, grads, opts)
    finally:
        HP.update(hp)
    for name in weights:
        torch.testing.assert_close(a[name][0], b[name][0], rtol=0, atol=1e-15)
