"""Compare's CPU workers take one run after another (the same numbers as a fresh process per run), and the
estimate said before the runs start."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from merit_core.checkpoint.resolve import latest_checkpoint
from merit_core.compare import estimate, plan_compare, run_compare, runner
from merit_core.data import load_meta
from merit_core.metric_names import TOKENS_PER_S
from merit_core.metrics import read_metrics
from tests.compare.test_compare import Counting, tiny_spec


def _records(run_dir):
    """The run's metrics records without the throughput (the one clock-dependent value)."""
    return [{k: v for k, v in r.items() if k != TOKENS_PER_S} for r in read_metrics(run_dir)]


def _cells(summary) -> list[dict]:
    """The best cells of a summary without their folder and throughput."""
    return [
        {k: v for k, v in cell.items() if k != "run_dir" and not k.startswith(TOKENS_PER_S)}
        for cell in summary.to_dict()["best"]
    ]


def _same(a, b) -> bool:
    """Equal, NaN equal to NaN (a diverged run's last loss)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def test_reused_workers_train_exactly_what_fresh_workers_train(tmp_path, model_cfg, data_dir, monkeypatch):
    started: list[int] = []

    class Recorded(runner._Worker):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            started.append(self.proc.pid)

    monkeypatch.setattr(runner, "_Worker", Recorded)
    # lr 1e3 diverges: a worker goes on after a diverged run too
    values = dict(optimizers="adamw,merit", batch_sizes="4", lrs="1e-3,1e3", jobs=2)
    calls = Counting()
    spec_reused = tiny_spec(model_cfg, data_dir, tmp_path / "reused", **values)
    reused = run_compare(spec_reused, calls)
    assert len(started) == 2, "two slots, one process each for the four runs"
    names = ["adamw-b4-lr0.001", "adamw-b4-lr1e+03", "merit-b4-lr0.001", "merit-b4-lr1e+03"]
    assert sorted(name for name, _ in calls.ended) == names
    # Which lr-1e3 runs diverge is the torch build's call (MERIT's clipped step may stay finite): the
    # reused workers must end every run as the fresh ones do, and at least one run diverged before a
    # worker went on to its next run.
    assert any(status == "diverged" for _, status in calls.ended), calls.ended

    started.clear()
    monkeypatch.setattr(runner, "reusable_worker", lambda run, n_gpus: False)
    spec_fresh = tiny_spec(model_cfg, data_dir, tmp_path / "fresh", **values)
    fresh_calls = Counting()
    fresh = run_compare(spec_fresh, fresh_calls)
    assert len(started) == 4, "a fresh process per run"
    assert sorted(fresh_calls.ended) == sorted(calls.ended)

    for a, b in zip(plan_compare(spec_reused).runs, plan_compare(spec_fresh).runs, strict=True):
        assert a.name == b.name
        assert _same(_records(a.run_dir), _records(b.run_dir)), a.name
        found_a, found_b = latest_checkpoint(a.run_dir), latest_checkpoint(b.run_dir)
        assert (found_a is None) == (found_b is None), a.name
        if found_a is not None and found_b is not None:
            assert found_a[0] == found_b[0], a.name
            weights_a = load_file(found_a[1] / "model.safetensors")
            weights_b = load_file(found_b[1] / "model.safetensors")
            assert weights_a.keys() == weights_b.keys()
            assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a), a.name
    assert _same(_cells(reused.summary), _cells(fresh.summary))


def test_the_estimate_lays_the_runs_out_over_the_jobs(tmp_path, model_cfg, data_dir, monkeypatch):
    """Every timed pass taking 0.1 s per sequence: the estimate is the hand-computed makespan."""
    monkeypatch.setattr(estimate, "_fastest", lambda work: 0.1 * estimate.PROBE_SEQUENCES)
    spec = tiny_spec(model_cfg, data_dir, tmp_path / "cmp", lrs="1e-3", jobs=2)  # adamw, merit x b2, b4
    plan = plan_compare(spec)
    meta = load_meta(data_dir)
    # b2: 8 steps of 2 sequences, evaluations at steps 0, 4, 8 of (2 batches + the probe) x 4 sequences;
    # b4: 4 steps of 4 sequences, evaluations at steps 0, 4
    work_b2, work_b4 = 8 * 2 * 0.1 + 3 * 3 * 4 * 0.1, 4 * 4 * 0.1 + 2 * 3 * 4 * 0.1
    side_by_side = [w * estimate.SHARED_SLOWDOWN + estimate.RUN_OVERHEAD_S for w in (work_b2, work_b4)]
    # adamw b2 -> slot 0, adamw b4 -> slot 1, merit b2 -> slot 1 (free first), merit b4 -> slot 0
    got = estimate.estimate_runs(plan.runs, plan.states, plan.jobs, 1, meta)
    assert got is not None and (got.runs, got.jobs) == (4, 2)
    assert got.seconds == pytest.approx(estimate.WORKER_START_S + sum(side_by_side))
    alone = estimate.estimate_runs(plan.runs, plan.states, 1, 1, meta)  # one job, in this process: no worker
    assert alone is not None
    assert alone.seconds == pytest.approx(2 * (work_b2 + work_b4) + 4 * estimate.RUN_OVERHEAD_S)
    assert estimate.estimate_runs(plan.runs, plan.states, 2, None, meta) is None  # GPUs: no estimate
    done = dict.fromkeys(plan.states, "finished")
    assert estimate.estimate_runs(plan.runs, done, 2, 1, meta) is None  # nothing left to train


def test_the_estimate_is_one_line(capsys):
    from merit_cli.compare_cmd import RichCompareReport

    report = RichCompareReport()
    assert report.plain  # pytest captures stdout: not a terminal
    report.on_estimate(estimate.CompareEstimate(75.4, 6, 2))
    report.on_estimate(estimate.CompareEstimate(3725.0, 18, 2, more=True))
    assert capsys.readouterr().out.splitlines() == [
        "estimate time=1m15s runs=6",
        "estimate time=1h02m05s runs=18 more=True",
    ]


def test_the_merit_kernel_is_warmed_beside_the_data_only_for_merit_on_a_cpu(tmp_path, model_cfg, data_dir):
    from merit_core.compare import _warm_merit_kernel

    merit = tiny_spec(model_cfg, data_dir, tmp_path / "a", optimizers="adamw,merit")
    thread = _warm_merit_kernel(merit, threads=1)
    assert thread is not None
    thread.join()
    assert _warm_merit_kernel(merit, threads=None) is None  # GPUs: each run checks its own device
    assert _warm_merit_kernel(tiny_spec(model_cfg, data_dir, tmp_path / "b", optimizers="adamw"), threads=1) is None
